"""Which old chunk's shard buffers each chunk of a repack keeps, and what it takes with them.

[Note: a chunk that keeps its buffers]
A repack rebuilds every chunk, yet most often most of them come out as they were: the warm-up's layout in first-use
order is the registration order's for a stack of blocks, and a chunk's parameters stay in their old places where it
holds mostly what it held ([Note: a chunk's parameters in their old places] in ``packing.py``); the chunks that stay on
the host keep their tier. Such a chunk's host shard is the new one but for the parameters that came or went: the new
chunk takes the old one's master, compute copy and gradient as they are (``Kept``), the values of the parameters that
leave it are copied out first (``OldChunks`` in ``repack.py``), those that come are written into their slots, and the
padding is zeroed again (a gradient's, and the parameters' that carry none). Only a parameter in the same slot of both
stays: one at another offset (a layout ``keep_slots`` could not keep, paired all the same) is copied out and written
back as one that came; counted as staying, it took the bytes the old chunk held there. On a GPU that spares a pinned
allocation and a copy of each such shard (a repack after the warm-up of 10B parameters keeps some 45 GB of them on the
host); with several ranks, its all-gather too: only what leaves is all-gathered (``gather_pieces``). Every rank pairs
alike, as the layouts and tiers are the same on every rank. The optimizer state still moves by piece ([Note:
optimizer state through a repack] in ``repack.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .chunk import Chunk, TensorInfo, Tier
from .packing import ChunkSpec, Layout, Slot, holding_most

if TYPE_CHECKING:  # the manager imports this package
    from ..memory.manager import ChunkManager

_HOST = torch.device("cpu")


@dataclass
class Kept:
    """An old chunk's shard buffers as a new chunk takes them; ``fresh``: its slots whose values were elsewhere."""

    master: torch.Tensor
    low: torch.Tensor | None
    grad: torch.Tensor | None  # ``None`` where the old chunk had none to give
    fresh: tuple[Slot, ...]


def pair_chunks(layout: Layout, old: list[Chunk], tiers: Mapping[int, Tier]) -> dict[int, Chunk]:
    """New chunk id -> the old chunk whose buffers it keeps: both on the host, and the parameters in the same slots
    of both at least half of each (``holding_most``); each old chunk kept once."""
    owner = {s.param_index: (c.spec, s) for c in old for s in c.spec.slots}
    chunk_of = {c.chunk_id: c for c in old}
    pairs: dict[int, Chunk] = {}
    for spec in layout.chunks:
        if tiers.get(spec.chunk_id, Tier.HOST) is not Tier.HOST:
            continue
        was = holding_most(spec, owner, {c.chunk_id for c in pairs.values()}, same_slots=True)
        c = chunk_of[was.chunk_id] if was is not None else None
        if c is not None and c.shard_tier is Tier.HOST and c.master is not None:
            pairs[spec.chunk_id] = c
    return pairs


def staying(spec: ChunkSpec, old: Chunk) -> set[int]:
    """The parameters of new chunk ``spec`` that stay where they are in the buffers it keeps of ``old``: those in the
    same slot of both. One that moved within the chunk is copied out and written back as one that came."""
    was = {s.param_index: (s.offset, s.numel) for s in old.spec.slots}
    return {s.param_index for s in spec.slots if was.get(s.param_index) == (s.offset, s.numel)}


def gather_pieces(mgr: ChunkManager, c: Chunk, shard: torch.Tensor, tensors: Sequence[TensorInfo]) -> torch.Tensor:
    """The whole values of ``tensors`` (parameters of old chunk ``c``) in ``shard``, a per-rank buffer of ``c``, back
    to back on the host. Each rank writes the pieces it holds where they go in a buffer of their total size, the ranks
    all-gather those, and each element is taken from the rank that holds it: a few norms' bytes cross, not a chunk's."""
    lo, hi = c.shard_range
    total, n, world = sum(t.numel for t in tensors), c.shard_numel, mgr.comm.world_size
    mine = torch.zeros(total, dtype=shard.dtype)
    at = 0
    with mgr.tiers.reading(c):
        for t in tensors:
            a, b = max(t.offset, lo), min(t.offset + t.numel, hi)
            if a < b:
                mine[at + a - t.offset : at + b - t.offset].copy_(shard[a - lo : b - lo])
            at += t.numel
    device = mgr.comm.tensor_device()
    everyone = torch.empty(world * total, dtype=shard.dtype, device=device)
    mgr.comm.all_gather(everyone, mine.to(device), chunk=c.chunk_id).wait()
    mgr.comm.verify_issued()  # it leaves the engine ([Note: checking once a micro-batch])
    everyone = everyone.to(_HOST).view(world, total)
    out = torch.empty(total, dtype=shard.dtype)
    at = 0
    for t in tensors:
        for r in range(world):  # rank r holds elements [r * n, (r + 1) * n) of the chunk
            a, b = max(t.offset, r * n), min(t.offset + t.numel, (r + 1) * n)
            if a < b:
                out[at + a - t.offset : at + b - t.offset] = everyone[r, at + a - t.offset : at + b - t.offset]
        at += t.numel
    return out
