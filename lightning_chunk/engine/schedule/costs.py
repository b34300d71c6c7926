"""What a chunk costs on each tier, in bytes: from a chunk, or from a layout before any chunk exists.

Pure arithmetic over shapes and dtypes (no tensors are made), shared by the manager's views of its
chunks and by placement before a (re)pack.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence

import torch

from ..chunks.chunk import Chunk, Tier
from ..chunks.packing import Layout
from ..config import DtypePolicy
from .placement import ChunkView


def shard_cost(
    capacity: int, world_size: int, compute: torch.dtype, master: torch.dtype, trainable: bool, optim_bytes: int
) -> int:
    """Bytes a shard holds when it lives on the device tier (payload too, when one rank aliases it)."""
    n = capacity // world_size
    master_b = n * master.itemsize
    low_b = n * compute.itemsize if compute != master else 0
    grad_b = n * master.itemsize if trainable else 0
    if world_size == 1:  # aliased: the payload is the low shard
        return capacity * compute.itemsize + (master_b if low_b else 0) + grad_b + optim_bytes
    return master_b + low_b + grad_b + optim_bytes


def disk_cost(capacity: int, world_size: int, master: torch.dtype, trainable: bool, optim_bytes: int) -> int:
    """Bytes of a shard that go to files on the disk tier: master, gradient shard, optimizer state."""
    n = capacity // world_size * master.itemsize
    return n + (n if trainable else 0) + optim_bytes


def grad_payload_cost(capacity: int, world_size: int, dtype: torch.dtype, trainable: bool) -> int:
    """Several ranks: the whole-chunk gradient buffer backward needs on the device, in the reduce dtype."""
    return 0 if world_size == 1 or not trainable else capacity * dtype.itemsize


@functools.lru_cache(maxsize=1024)
def _static_costs(
    capacity: int,
    world_size: int,
    compute: torch.dtype,
    master: torch.dtype,
    trainable: bool,
    optim_bytes: int,
    reduce: torch.dtype,
) -> tuple[int, int, int]:
    """(device shard, gradient payload, disk) bytes: the same for every chunk of one shape, asked at every moment."""
    return (
        shard_cost(capacity, world_size, compute, master, trainable, optim_bytes),
        grad_payload_cost(capacity, world_size, reduce, trainable),
        disk_cost(capacity, world_size, master, trainable, optim_bytes),
    )


def chunk_view(c: Chunk) -> ChunkView:
    """What a policy may know about an existing chunk."""
    shard, grad, disk = _static_costs(
        c.capacity_numel,
        c.world_size,
        c.compute_dtype,
        c.master_dtype,
        c.trainable,
        c.optim_state_bytes,
        c.grad_payload_dtype,
    )
    return ChunkView(
        c.chunk_id, c.payload_bytes, shard, c.is_resident, c.is_evictable, c.shard_tier, c.last_used, grad, disk
    )


def chunk_views(
    chunks: Sequence[Chunk], include: Iterable[int] | None = None, *, resident: bool = True
) -> list[ChunkView]:
    """A view of every chunk; with ``include``, only of those it names and (unless ``resident=False``) the
    resident ones ([Note: the views a plan reads] in ``placement.py``)."""
    if include is None:
        return [chunk_view(c) for c in chunks]
    wanted = set(include)
    if not resident:
        return [chunk_view(chunks[i]) for i in sorted(wanted)]
    return [chunk_view(c) for c in chunks if c.chunk_id in wanted or c.is_resident]


def planned_views(layout: Layout, dtypes: DtypePolicy, optim_bytes_per_element: Mapping[int, int]) -> list[ChunkView]:
    """What the chunks of ``layout`` would cost, before any of them exists (for placement)."""
    out = []
    ws = layout.world_size
    for spec in layout.chunks:
        trainable = spec.key.requires_grad
        compute = dtypes.compute_for(spec.key.dtype, own_dtype=spec.key.own_dtype)  # as ``build_chunk`` makes it
        master = dtypes.master_for(spec.key.dtype, trainable=trainable, own_dtype=spec.key.own_dtype)
        optim = spec.capacity_numel // ws * optim_bytes_per_element.get(spec.key.group, 0) if trainable else 0
        out.append(
            ChunkView(
                spec.chunk_id,
                spec.capacity_numel * compute.itemsize,
                shard_cost(spec.capacity_numel, ws, compute, master, trainable, optim),
                resident=False,
                evictable=False,
                shard_tier=Tier.HOST,
                grad_payload_bytes=grad_payload_cost(spec.capacity_numel, ws, dtypes.reduce_for(master), trainable),
                disk_bytes=disk_cost(spec.capacity_numel, ws, master, trainable, optim),
            )
        )
    return out
