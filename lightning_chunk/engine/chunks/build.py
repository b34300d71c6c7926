"""One chunk of a pack, built from a source of values (``repack.py``'s ``FromModule`` or ``OldChunks``): its shard
buffers on its tier, written where they live, and its parameters made views of its payload."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .chunk import Chunk, Role, TensorInfo, Tier
from .packing import ChunkSpec, Slot
from .parked import show
from .states import TensorState as S

if TYPE_CHECKING:  # the manager imports this module
    from ..memory.manager import ChunkManager


def fill_range(
    out: torch.Tensor, slots: tuple[Slot, ...], lo: int, piece: Callable[[int, int, int], torch.Tensor | None]
) -> None:
    """Elements ``[lo, lo + out.numel())`` of a chunk into ``out``: ``piece(i, a, b)`` gives elements ``[a, b)`` of
    parameter ``i``'s flat value (``None``: zeros, as in the padding between and after the slots)."""
    hi, done = lo + out.numel(), lo
    for s in sorted(slots, key=lambda s: s.offset):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a >= b:
            continue
        if a > done:
            out[done - lo : a - lo].zero_()
        write_slots(out, (s,), lo, piece)
        done = b
    if done < hi:
        out[done - lo :].zero_()


def write_slots(
    out: torch.Tensor, slots: tuple[Slot, ...], lo: int, piece: Callable[[int, int, int], torch.Tensor | None]
) -> None:
    """The elements of ``slots`` that ``out`` holds (a chunk's ``[lo, lo + out.numel())``) from ``piece``, as
    ``fill_range`` writes them; nothing else of ``out``."""
    hi = lo + out.numel()
    for s in slots:
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a >= b:
            continue
        got = piece(s.param_index, a - s.offset, b - s.offset)
        if got is None:
            out[a - lo : b - lo].zero_()
        else:  # from another device: converted where it is, and only the converted bytes cross
            out[a - lo : b - lo].copy_(got if got.device == out.device else got.to(out.dtype))


def zero_gaps(out: torch.Tensor, slots: tuple[Slot, ...], lo: int, keep: Callable[[int], bool]) -> None:
    """Zero the elements ``[lo, lo + out.numel())`` of a chunk in ``out`` that hold no parameter ``keep`` says holds
    its value there: the padding, and the slots of the others."""
    hi, done = lo + out.numel(), lo
    for s in sorted(slots, key=lambda s: s.offset):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a >= b or not keep(s.param_index):
            continue
        if a > done:
            out[done - lo : a - lo].zero_()
        done = b
    if done < hi:
        out[done - lo :].zero_()


def flat_piece(value: torch.Tensor | None, a: int, b: int) -> torch.Tensor | None:
    return None if value is None else value.reshape(-1)[a:b]


def build_chunk(mgr: ChunkManager, spec: ChunkSpec, tier: Tier, source: Any, *, broadcast: bool) -> Chunk:
    """One chunk of a (re)pack: its values from ``source``, its shard on ``tier``, its parameters views of its
    payload.

    [Note: the compute copy from the values]
    A host shard in mixed precision holds its master and its compute copy (bf16 beside fp32). The copy was
    converted from the master on the host: a pass over 6 bytes a parameter on the host's memory bus at set-up,
    some 60 GB at 10B parameters. Where the values are the module's own, in memory (deferred init makes them on the
    GPU there: [Note: deferred initialisation]), the copy is written from them as the master is, parameter by
    parameter: converted on the device, and 2 bytes a parameter come over instead of being made on the host. The
    same rounding either way (to nearest even), so the copy is the master's bit for bit. A chunk with any value read
    from a file (read twice, it would be read twice), one whose values rank 0 broadcast, and a repack's from the
    old chunks still convert the master."""
    # the parameters' own dtype is the layout key's, read when the manager first saw them: on a repack they are
    # views of the old payloads, in the compute dtype (bf16 under bf16-mixed), which would have become each
    # parameter's "original" dtype, the one it is given back in at the end of fit and saved in
    own_dtype = spec.key.dtype
    chunk = Chunk(
        spec=spec,
        capacity_numel=spec.capacity_numel,
        rank=mgr.comm.rank,
        world_size=mgr.comm.world_size,
        compute_dtype=mgr.dtypes.compute_for(own_dtype, own_dtype=spec.key.own_dtype),
        master_dtype=mgr.dtypes.master_for(own_dtype, trainable=spec.key.requires_grad, own_dtype=spec.key.own_dtype),
        shard_tier=tier,
    )
    chunk.reduce_dtype = mgr.dtypes.reduce_for(chunk.master_dtype)
    lo, hi = chunk.shard_range
    whole = None
    if broadcast and not source.same_everywhere(chunk):  # every rank starts from rank 0's values, as DDP does
        whole = torch.empty(chunk.capacity_numel, dtype=chunk.master_dtype)
        source.fill(whole, chunk, 0)
        mgr.comm.broadcast(whole)

    def values_into(out: torch.Tensor, start: int) -> None:
        """Elements ``[start, start + out.numel())`` of the chunk's values, written where they go (a device shard
        parameter by parameter from the host: no host buffer of its size first; [Note: reading an old chunk in
        place])."""
        if whole is not None:
            out.copy_(whole[start : start + out.numel()])
        else:
            source.fill(out, chunk, start)

    with_grad = any(source.has_grad(s.param_index) for s in spec.slots)
    taken = source.adopt(chunk)  # [Note: a chunk that keeps its buffers]
    chunk.aliased = mgr.comm.world_size == 1 and tier is Tier.DEVICE
    # the shard, when it lives on the device, and the payload: allocated to make the views, and released at
    # once unless it is the shard itself
    need = mgr.device_shard_bytes(chunk) if tier is Tier.DEVICE else 0
    need += 0 if chunk.aliased else chunk.payload_bytes
    mgr.ledger.reserve(
        need, f"building chunk {spec.chunk_id}" + (" with its shard on the device tier" if tier is Tier.DEVICE else "")
    )
    with mgr.ledger.tracked(chunk):
        chunk.payload = torch.empty(chunk.capacity_numel, dtype=chunk.compute_dtype, device=mgr.device)
        if taken is not None:  # the parameters that came written where others were, the padding zeroed again
            chunk.master, chunk.low, kept_grad = taken.master, taken.low, taken.grad
            for out in (chunk.master, chunk.low) if chunk.low is not None else (chunk.master,):
                zero_gaps(out, spec.slots, lo, lambda i: True)
                write_slots(out, taken.fresh, lo, lambda i, a, b: flat_piece(source.value(i), a, b))
        elif chunk.aliased and chunk.master_is_payload():
            values_into(chunk.payload, 0)
        else:
            chunk.master = mgr.tiers.alloc(chunk, Role.MASTER, chunk.master_dtype)
            values_into(chunk.master, lo)
            if chunk.aliased:  # one rank: the master is the whole chunk
                chunk.payload.copy_(chunk.master)
            elif chunk.compute_dtype != chunk.master_dtype:
                chunk.low = mgr.tiers.alloc(chunk, Role.LOW, chunk.compute_dtype)
                if whole is None and source.in_memory(chunk):  # [Note: the compute copy from the values]
                    values_into(chunk.low, lo)
                else:
                    chunk.low.copy_(chunk.master)
        if chunk.trainable:  # persistent: no allocation churn per step (pinned allocations are slow)
            if taken is not None and kept_grad is not None:  # its gradients where they are, the rest zeroed
                chunk.grad = kept_grad
                if with_grad:
                    zero_gaps(chunk.grad, spec.slots, lo, source.has_grad)
                    came = tuple(s for s in taken.fresh if source.has_grad(s.param_index))
                    write_slots(chunk.grad, came, lo, lambda i, a, b: flat_piece(source.grad(i), a, b))
            else:
                # stepping in backward, a shard without gradients is given back once packed: memory for views only
                make = mgr.tiers.for_views if mgr.grads.given_back_when_packed and not with_grad else mgr.tiers.alloc
                chunk.grad = make(chunk, Role.GRAD, chunk.master_dtype)
                if with_grad:
                    fill_range(chunk.grad, spec.slots, lo, lambda i, a, b: flat_piece(source.grad(i), a, b))
            if with_grad:
                chunk.grad_written = mgr.comm.world_size > 1
        state = S.HOLD if chunk.aliased else S.FREE
        for s in spec.slots:  # views first: a view of a released storage cannot be made
            p = mgr.params[s.param_index]
            info = TensorInfo(
                param=p,
                name=mgr.names[s.param_index],
                slot=s,
                shape=p.shape,
                orig_dtype=own_dtype,
                state=state,
                has_grad=source.has_grad(s.param_index),
            )
            chunk.tensors.append(info)
            info.view = chunk.payload[s.offset : s.offset + s.numel].view(p.shape)
            show(p, info.view)
            info.pointed()
            mgr.place_param(p, chunk, info)
        if not chunk.aliased:
            chunk.payload.untyped_storage().resize_(0)
            chunk.park_params()
    return chunk
