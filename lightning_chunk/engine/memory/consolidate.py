"""Whole values out of shards and back: parameters and optimizer state in the plain format.

Off the hot path (checkpoints, the end of ``fit``). With several ranks every
function here is a collective: all ranks call it, and chunks are visited in
chunk-id order so the all-gathers pair up. Each chunk is gathered once, so peak
memory is one chunk's worth beyond the result.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.parked import show
from ..chunks.repack import piece_range
from ..system.lazy_mapping import LazyMapping
from .manager import ChunkManager
from .master_writes import copies_made

_HOST = torch.device("cpu")


def _pieces(mgr: ChunkManager, chunk: Chunk, info: TensorInfo) -> tuple[int, int]:
    """The element range ``[a, b)`` of the chunk that this rank's shard holds of ``info`` (empty when a >= b)."""
    return piece_range(chunk, info.offset, info.numel)


def chunk_values(
    mgr: ChunkManager, c: Chunk, *, device: torch.device | None = None, grads: bool = False
) -> dict[int, torch.Tensor]:
    """The whole trained value of each parameter of ``c`` (original dtype and shape, on ``device``, the host by
    default), keyed by parameter index; with ``grads``, the whole gradient in the gradient shards instead (what
    the optimizer reads: averaged over the ranks). A collective with several ranks."""
    shard = c.grad if grads else c.master_tensor_for_read()
    assert shard is not None
    full = mgr.gather_shard(c, shard)
    return {
        t.slot.param_index: full[t.offset : t.offset + t.numel]
        .view(t.shape)
        .to(device=device or _HOST, dtype=t.orig_dtype, copy=True)
        for t in c.tensors
    }


def full_values(mgr: ChunkManager, *, device: torch.device | None = None) -> dict[int, torch.Tensor]:
    """Every parameter's whole trained value (original dtype and shape), gathering each chunk once."""
    out: dict[int, torch.Tensor] = {}
    for chunk in mgr.chunks:
        out.update(chunk_values(mgr, chunk, device=device))
    return out


def unpack(mgr: ChunkManager, *, materialize: bool, device: torch.device | None = None) -> None:
    """Drop every chunk, giving each parameter a plain tensor: its whole trained value (original dtype, on
    ``device``, the host by default) when ``materialize``, else an empty one.

    Streams: each chunk is gathered, its parameters take their values, and its shards are freed before
    the next, so the peak is the model plus one chunk, not the model next to every shard. With several
    ranks and ``materialize`` this is a collective (chunks go in id order on every rank)."""
    for c in mgr.chunks:
        values = chunk_values(mgr, c, device=device) if materialize else {}
        for t in c.tensors:
            empty = torch.empty(0, dtype=t.orig_dtype, device=t.param.device)
            show(t.param, values.get(t.slot.param_index, empty))
        del values
        mgr.drop(c)
    mgr.forget_layout()


def whole_model_fits(mgr: ChunkManager, *, optimizer_state: bool, room: int | None) -> tuple[bool, int, int | None]:
    """Whether the whole trained model (and, with ``optimizer_state``, its whole optimizer state) fits in this
    rank's share of ``room`` (what the host has available now) with a fifth kept free; the same answer on every
    rank (the smallest room decides). ``(fits, bytes needed, rank's share)``.

    [Note: the model after fit]
    With ``materialize_on_teardown=None`` (the default) the end of ``fit`` gives every rank's parameters their whole
    trained values where they fit, as DDP leaves them, so ``state_dict()``, inference and ``trainer.validate`` just
    work. Where they do not (13B in fp32 is 52 GB a rank, 416 GB for 8 ranks of a node), building them would end a
    finished run in the out-of-memory killer; the parameters are left empty instead, rank 0 says so, and the
    weights are in the checkpoints (``lightning-chunk consolidate`` writes one file). ``True`` always builds them,
    ``False`` never. Chunks are gathered one at a time and their shards freed as they go, so what must fit is the
    model and this rank's optimizer state, copied for a later save, not the model beside the training state.
    ``host_memory_limit`` does not decide: it bounds the chunks' memory while training, and a model whose training
    state needs the disk tier often fits whole once it is trained (7B in fp32 is 28 GB, its training state 112 GB)."""
    need = sum(t.numel * t.orig_dtype.itemsize for c in mgr.chunks for t in c.tensors)
    # the whole state, or this rank's pieces of it kept for a later save ([Note: optimizer state after fit])
    need += sum(c.optim_state_bytes for c in mgr.chunks) * (mgr.comm.world_size if optimizer_state else 1)
    share = None if room is None else int(room * 0.8) // max(mgr.comm.ranks_on_this_host(), 1)
    fits = share is None or need <= share
    if mgr.comm.world_size > 1:
        flag = torch.tensor([int(fits)], dtype=torch.int32, device=mgr.comm.tensor_device())
        fits = bool(mgr.comm.all_reduce(flag, "min", what="the agreement on building the whole model").item())
    return fits, need, share


def load_values(mgr: ChunkManager, values: Mapping[int, torch.Tensor], *, keep_unchanged: bool = False) -> None:
    """Overwrite masters (and compute copies) with whole values; each rank keeps its own piece. ``keep_unchanged``:
    an element equal to its master cast to the value's dtype keeps the master's (finer) value."""
    mgr.readers.before_change()  # a save running beside training has what it reads first
    for chunk in mgr.chunks:
        lo, _ = chunk.shard_range
        touched = False
        for t in chunk.tensors:
            if t.slot.param_index not in values:
                continue
            a, b = _pieces(mgr, chunk, t)
            if a < b:  # asked for only here: a lazy mapping reads it now ([Note: resuming a peer's sharded checkpoint])
                piece = values[t.slot.param_index].reshape(-1)[a - t.offset : b - t.offset]
                master = chunk.master_tensor_for_read()[a - lo : b - lo]
                if keep_unchanged:
                    piece = piece.to(master.device)
                    piece = torch.where(piece == master.to(piece.dtype), master, piece.to(master.dtype))
                master.copy_(piece)
                if chunk.low is not None:
                    chunk.low[a - lo : b - lo].copy_(piece)
                if chunk.aliased and not chunk.master_is_payload():
                    assert chunk.payload is not None
                    chunk.payload[a:b].copy_(piece)
                    t.looked = None  # [Note: writes through .data] in full_params.py
            touched = True
        if touched and chunk.is_resident and not chunk.aliased:
            mgr.release(chunk, eviction=False)  # stale: re-gathered on next use
        if touched:
            copies_made(chunk)  # [Note: the optimizer's views written outside its step] in master_writes.py


def _per_element(key: str, v: Any, numel: int, whole_keys: frozenset[str]) -> bool:
    """Per-element state (Adam's moments), cut into pieces as the values are. ``whole_keys`` name an optimizer's
    state of a whole parameter, kept beside ``step`` on every rank holding a piece (Adafactor's ``row_var``, which
    for a ``(R, 1)`` matrix has the parameter's own shape: the key tells them apart, not the shape)."""
    return key not in whole_keys and torch.is_tensor(v) and v.dim() > 0 and v.numel() == numel


@dataclass
class OptimizerStateParts:
    """One optimizer's state on this rank, split the way shards need it (every rank agrees on keys and scalars)."""

    local: dict[int, dict[str, Any]]  # param index -> its state on this rank (flat pieces, like the views)
    # per-element state keys (Adam's moments), union over ranks, each with its dtype by the master's dtype: one
    # optimizer can step fp32 masters beside float64 ones ([Note: float64 parameters under mixed precision] in
    # config.py), and one dtype a key cast the moments of the others to it in every repack and save
    keys: dict[str, dict[torch.dtype, torch.dtype]]
    scalars: dict[int, dict[str, Any]]  # param index -> scalar state (``step``), from whichever rank has a piece
    # param index -> the per-element keys its state has, union over ranks ([Note: state keys a parameter has])
    held: dict[int, frozenset[str]]

    def dtype(self, key: str, chunk: Chunk) -> torch.dtype:
        """The dtype of ``key``'s state for ``chunk``'s masters (theirs, where no parameter of theirs has it)."""
        return self.keys[key].get(chunk.master_dtype, chunk.master_dtype)

    def has(self, i: int, key: str) -> bool:
        """Parameter ``i``'s state has per-element state ``key`` (on whichever ranks hold its pieces)."""
        return key in self.held.get(i, ())

    def in_chunk(self, chunk: Chunk, among: Container[int] | None = None) -> list[str]:
        """The per-element keys some parameter of ``chunk`` (of ``among``, if given) has, sorted: the same on every
        rank, so a collective per key pairs up; a chunk of frozen parameters has none."""
        idx = [t.slot.param_index for t in chunk.tensors]
        return sorted(k for k in self.keys if any(self.has(i, k) for i in idx if among is None or i in among))


def optimizer_state_parts(
    mgr: ChunkManager,
    views: dict[int, torch.Tensor],
    state: dict[Any, dict[str, Any]],
    whole_keys: frozenset[str] = frozenset(),
) -> OptimizerStateParts:
    """A collective with several ranks (two small object all-gathers).

    [Note: state keys a parameter has]
    Within one optimizer, parameters may keep different per-element state: torch's Adam keeps ``max_exp_avg_sq``
    only in a group with ``amsgrad=True``. A chunk's state shard of a key is zero where a parameter has none, so
    what is rebuilt from shards (a repack's pieces, a gathered or consolidated state, a resume) takes from them
    only the keys each parameter had: ``held``, saved in a checkpoint's optimizer meta. A checkpoint without it
    (before 2026-12-07) gives every parameter with state every key, as it was saved."""
    local = {i: state[v] for i, v in views.items() if v in state and state[v]}
    held = {
        i: frozenset(k for k, v in st.items() if _per_element(k, v, views[i].numel(), whole_keys))
        for i, st in local.items()
    }
    keys: dict[str, dict[torch.dtype, torch.dtype]] = {}
    for i, st in local.items():
        for k, v in st.items():
            if _per_element(k, v, views[i].numel(), whole_keys):
                keys.setdefault(k, {})[views[i].dtype] = v.dtype
    scalars = {
        i: {
            k: (v.cpu() if torch.is_tensor(v) else v)
            for k, v in st.items()
            if not _per_element(k, v, views[i].numel(), whole_keys)
        }
        for i, st in local.items()
    }
    if mgr.comm.world_size > 1:
        for part in mgr.comm.all_gather_object(keys):
            for k, by_master in part.items():
                keys.setdefault(k, {}).update(by_master)
        merged: dict[int, dict[str, Any]] = {}
        merged_held: dict[int, frozenset[str]] = {}
        for part, part_held in mgr.comm.all_gather_object((scalars, held)):
            for i, st in part.items():
                merged.setdefault(i, st)
            for i, ks in part_held.items():
                merged_held[i] = merged_held.get(i, frozenset()) | ks
        scalars, held = merged, merged_held
    return OptimizerStateParts(local, keys, scalars, held)


def state_shard(mgr: ChunkManager, chunk: Chunk, parts: OptimizerStateParts, key: str) -> torch.Tensor:
    """This rank's shard of per-element state ``key`` for ``chunk``, laid out like the chunk's master shard."""
    region = mgr.tiers.state_region(chunk, key)
    if region is not None and region.dtype == parts.dtype(key, chunk):
        return region  # a disk shard's state is laid out like this already: no copy of the whole tier
    lo, _ = chunk.shard_range
    # on the host: checkpoints write it from there and repacks gather it from there; building it on the
    # device would stage the whole optimizer state of an offloaded run in device memory
    shard = torch.empty(chunk.shard_numel, dtype=parts.dtype(key, chunk))
    filled = 0  # the shard's elements are written once each: the pieces copied, the rest (padding, no state) zeroed
    for t in sorted(chunk.tensors, key=lambda t: t.offset):
        st = parts.local.get(t.slot.param_index)
        a, b = _pieces(mgr, chunk, t)
        if st is not None and key in st and a < b:
            shard[filled : a - lo].zero_()
            shard[a - lo : b - lo].copy_(st[key].reshape(-1))
            filled = b - lo
    shard[filled:].zero_()
    return shard


def gather_optimizer_state(
    mgr: ChunkManager,
    views: dict[int, torch.Tensor],
    state: dict[Any, dict[str, Any]],
    param_order: Iterable[int],
    whole_keys: frozenset[str] = frozenset(),
) -> dict[int, dict[str, Any]]:
    """Whole per-parameter optimizer state (parameter shapes), keyed by parameter index.

    Per-element state (Adam's moments) is gathered chunk by chunk like the values; scalar state
    (``step``) comes from whichever rank holds a piece of the parameter.
    """
    parts = optimizer_state_parts(mgr, views, state, whole_keys)
    out: dict[int, dict[str, Any]] = {i: dict(st) for i, st in parts.scalars.items()}
    wanted = set(param_order)
    for chunk in mgr.chunks:
        for key in parts.in_chunk(chunk):
            full = mgr.gather_shard(chunk, state_shard(mgr, chunk, parts, key))
            for t in chunk.tensors:
                i = t.slot.param_index
                if i in out and i in wanted and parts.has(i, key):
                    out[i][key] = full[t.offset : t.offset + t.numel].view(t.shape).clone()
    return out


def local_optimizer_state(
    mgr: ChunkManager,
    views: dict[int, torch.Tensor],
    whole: Mapping[int, dict[str, Any]],
    whole_keys: frozenset[str] = frozenset(),
) -> dict[int, dict[str, Any]]:
    """This rank's pieces of whole per-parameter state (flat, like the views). Every tensor is a copy: one kept by
    reference (a ``step``) would keep a mapped checkpoint file mapped for the whole fit ([Note: a plain checkpoint
    mapped] in ``checkpointing.py``)."""
    out: dict[int, dict[str, Any]] = {}
    for i, _v in views.items():
        st = whole.get(i)
        if st is None:
            continue
        chunk, info = mgr.lookup(mgr.params[i])
        a, b = _pieces(mgr, chunk, info)
        numel = info.numel
        out[i] = {
            k: (
                val.reshape(-1)[a - info.offset : b - info.offset].clone()
                if _per_element(k, val, numel, whole_keys)
                else val.clone()
                if torch.is_tensor(val)
                else val
            )
            for k, val in st.items()
        }
    return out


def module_state_dict(mgr: ChunkManager, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s ``state_dict`` with every parameter's full trained value (host tensors). A collective with
    several ranks: every rank calls it."""
    sd = module.state_dict(keep_vars=True)
    index_of = mgr.index_of
    values = full_values(mgr)
    return {
        k: (values[index_of[id(v)]] if id(v) in index_of else (v.detach() if torch.is_tensor(v) else v))
        for k, v in sd.items()
    }


def load_module_state_dict(
    mgr: ChunkManager, module: torch.nn.Module, state_dict: Mapping[str, Any], *, strict: bool = True
) -> None:
    """Load a plain ``state_dict`` (full tensors) into the masters and ``module``'s buffers. A meta tensor stands
    for the value the chunks hold already (a sharded checkpoint's, [Note: the state_dict of a sharded save] in
    ``state/checkpoint.py``): it counts as present and loads nothing."""
    sd = module.state_dict(keep_vars=True)
    index_of = mgr.index_of
    param_keys = {k for k, v in sd.items() if id(v) in index_of}
    missing = [k for k in sd if k not in state_dict]
    unexpected = [k for k in state_dict if k not in sd]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}: "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    shape_of = getattr(state_dict, "shape_of", None)  # a lazy mapping knows shapes without reading values
    keys: dict[int, str] = {}
    for k in param_keys:
        if k not in state_dict:
            continue
        i = index_of[id(sd[k])]
        shape = shape_of(k) if shape_of is not None else tuple(state_dict[k].shape)
        if tuple(shape) != tuple(mgr.params[i].shape):
            raise RuntimeError(
                f"size mismatch for {k}: copying a param with shape {tuple(shape)}, "
                f"the parameter in the current model has shape {tuple(mgr.params[i].shape)}"
            )
        if shape_of is not None or not state_dict[k].is_meta:
            keys[i] = k
    load_values(mgr, LazyMapping(keys, state_dict.__getitem__))
    module.load_state_dict({k: state_dict[k] for k in state_dict if k not in param_keys and k in sd}, strict=False)
