"""Packing parameters into chunks: the layout, and the automatic chunk-size search.

Pure functions over parameter descriptions; nothing here touches tensors.

Rules (DESIGN.md, "chunk"):
- parameters go in first-use order (registration order before a trace exists);
- a chunk never mixes dtypes, optimizer param groups, or trainable and frozen
  parameters (a flat optimizer step over a frozen range would decay it);
- a parameter never spans two chunks (it is one contiguous view of a payload);
- a parameter starts at a multiple of ``ALIGN_NUMEL`` elements ([Note: aligned parameters]);
- capacity is padded to a multiple of the world size so every rank owns an
  equal shard.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from ..errors import LayoutError


@dataclass(frozen=True)
class ChunkKey:
    """What must be equal for two parameters to share a chunk."""

    group: int  # optimizer param group index, -1 when in no group
    requires_grad: bool
    dtype: torch.dtype
    own_dtype: bool = False  # payloads in ``dtype`` under mixed precision ([Note: normalisation in mixed precision])


@dataclass(frozen=True)
class ParamSpec:
    index: int  # registration order (position in ``module.named_parameters()``)
    name: str
    numel: int
    key: ChunkKey


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: ``chunk_id`` and the element range ``[offset, offset+numel)``."""

    param_index: int
    chunk_id: int
    offset: int
    numel: int


@dataclass(frozen=True)
class ChunkSpec:
    chunk_id: int
    key: ChunkKey
    slots: tuple[Slot, ...]
    capacity_numel: int  # the layout's chunk size, or less for the last chunk of a key (trimmed)

    @property
    def used_numel(self) -> int:
        return sum(s.numel for s in self.slots)


@dataclass(frozen=True)
class Layout:
    """Interior chunks all have ``capacity_numel`` elements (uniform sizes let the CUDA caching allocator
    reuse freed payload blocks); the last chunk of each key is trimmed to what it holds, rounded up to
    the world size, so a small param group (biases, norms) does not cost a whole chunk."""

    capacity_numel: int  # elements per chunk, a multiple of world_size
    world_size: int
    chunks: tuple[ChunkSpec, ...]
    order: tuple[int, ...]  # param indices in packing order

    def slot_of(self) -> dict[int, Slot]:
        return {s.param_index: s for c in self.chunks for s in c.slots}

    @property
    def padding_numel(self) -> int:
        return sum(c.capacity_numel - c.used_numel for c in self.chunks)


def round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


ALIGN_NUMEL = 16
"""Every parameter's offset in its chunk is a multiple of this many elements.

[Note: aligned parameters]
Parameters were packed back to back, so one of an odd size (a 50,257-entry bias, a 3-element scale) left every
parameter after it at an odd element offset. A parameter's data pointer is its payload's plus that offset, and
what a plain module's parameter never is, misaligned, broke user code and slowed kernels: ``torch.view_as_complex``
on a real pair (the usual way to train complex weights, as Fourier neural operators do) raised "Tensor must have a
storage_offset divisible by 2" where plain Lightning trained, and CUDA's vectorised elementwise kernels fall back
to their scalar paths on an address that is not a multiple of the vector's width. Padding each offset to 16 elements
puts every parameter on 32 bytes in bf16 and 64 in fp32 (payload blocks come from the allocator, aligned wider),
as FSDP aligns each original parameter in its flat parameter; it costs at most 15 elements a parameter, zeroed as
the chunk's tail padding is."""


def _extent(numels: Sequence[int]) -> int:
    """Elements from a chunk's start to the end of its last parameter when ``numels`` are packed in order."""
    end = 0
    for n in numels:
        end = round_up(end, ALIGN_NUMEL) + n
    return end


def _bins(params: Sequence[ParamSpec], order: Sequence[int], capacity: int) -> list[tuple[ChunkKey, list[ParamSpec]]]:
    """Greedy sequential packing: one open chunk per key, a new one when the next parameter does not fit."""
    by_index = {p.index: p for p in params}
    open_bins: dict[ChunkKey, tuple[ChunkKey, list[ParamSpec], list[int]]] = {}
    bins: list[tuple[ChunkKey, list[ParamSpec], list[int]]] = []
    for i in order:
        p = by_index[i]
        b = open_bins.get(p.key)
        if b is None or round_up(b[2][0], ALIGN_NUMEL) + p.numel > capacity:
            b = (p.key, [], [0])
            open_bins[p.key] = b
            bins.append(b)
        b[1].append(p)
        b[2][0] = round_up(b[2][0], ALIGN_NUMEL) + p.numel
    return [(k, ps) for k, ps, _ in bins]


def build_layout(params: Sequence[ParamSpec], order: Sequence[int], capacity_numel: int, world_size: int) -> Layout:
    """Pack ``params`` in ``order`` into chunks of ``capacity_numel`` elements (rounded up to the world size)."""
    if not params:
        return Layout(
            capacity_numel=round_up(max(capacity_numel, 1), world_size), world_size=world_size, chunks=(), order=()
        )
    if sorted(order) != sorted(p.index for p in params):
        raise LayoutError(f"order {list(order)} is not a permutation of the parameter indices")
    capacity = round_up(capacity_numel, world_size)
    largest = max(params, key=lambda p: p.numel)
    if largest.numel > capacity:
        raise LayoutError(
            f"parameter {largest.name!r} has {largest.numel} elements, more than chunk_numel={capacity}; "
            f"a parameter never spans two chunks, so chunk_numel must be at least {largest.numel}."
        )
    bins = _bins(params, order, capacity)
    caps = _capacities(bins, capacity, world_size)
    chunks = []
    for cid, ((key, ps), cap) in enumerate(zip(bins, caps, strict=True)):
        offset, slots = 0, []
        for p in ps:
            offset = round_up(offset, ALIGN_NUMEL)
            slots.append(Slot(param_index=p.index, chunk_id=cid, offset=offset, numel=p.numel))
            offset += p.numel
        chunks.append(ChunkSpec(chunk_id=cid, key=key, slots=tuple(slots), capacity_numel=cap))
    return Layout(capacity_numel=capacity, world_size=world_size, chunks=tuple(chunks), order=tuple(order))


def _capacities(bins: list[tuple[ChunkKey, list[ParamSpec]]], capacity: int, world_size: int) -> list[int]:
    """Uniform capacity, except the last chunk of each key: trimmed to its contents (rounded to the world size)."""
    last = {key: i for i, (key, _) in enumerate(bins)}
    return [
        round_up(_extent([p.numel for p in ps]), world_size) if last[key] == i else capacity
        for i, (key, ps) in enumerate(bins)
    ]


def padding_waste(params: Sequence[ParamSpec], order: Sequence[int], capacity: int, world_size: int = 1) -> int:
    bins = _bins(params, order, capacity)
    return sum(
        cap - sum(p.numel for p in ps)
        for (_, ps), cap in zip(bins, _capacities(bins, capacity, world_size), strict=True)
    )


TARGET_CHUNKS = 32
"""The automatic size search keeps chunks at or below ``2 * total / TARGET_CHUNKS`` elements, so a
model gets at least ``TARGET_CHUNKS / 2`` chunks unless ``chunk_numel_min`` or its largest
parameter forces fewer (see [Note: chunk granularity])."""


def choose_chunk_numel(
    params: Sequence[ParamSpec],
    order: Sequence[int],
    *,
    world_size: int,
    numel_min: int,
    numel_max: int,
    max_payload_numel: int | None = None,
    target_chunks: int = TARGET_CHUNKS,
    candidates: int = 96,
    keep: int | None = None,
) -> int:
    """The chunk capacity with the least padding waste in ``[numel_min, numel_max]``.

    The lower bound is raised to the largest parameter (which must fit in one chunk), the
    upper bound is capped at the model's size (a larger chunk only adds padding), at
    ``max_payload_numel`` (two payloads plus the traced non-model peak must fit under the
    device limit) and at twice ``total / target_chunks`` (see the note on granularity).
    Ties go to the larger capacity: fewer chunks, fewer collectives. ``keep``, the capacity the chunks have now,
    is chosen instead where it is within the bounds and pads little more ([Note: the chunk size a repack keeps]).
    """
    if not params:
        return round_up(max(numel_min, 1), world_size)
    largest = max(p.numel for p in params)
    total = sum(p.numel for p in params)
    lo = max(numel_min, largest)
    # ``numel_max`` bounds the search, not the model: a parameter never spans two chunks, so a larger one (a 7B
    # Llama's 131M-element embedding, over the default 2**26) raises it, to twice its size (room to pack the
    # rest without padding: one size of exactly the embedding padded a 7B Llama by 28%). Only the device limit
    # is a hard bound.
    hi = min(numel_max if numel_max >= largest else 2 * largest, total)
    if max_payload_numel is not None:
        hi = min(hi, max_payload_numel)
    if hi < largest:
        raise LayoutError(
            f"no chunk size fits: the largest parameter has {largest} elements but chunks may hold at most {hi} "
            "(two payloads plus the traced non-model memory must fit under the device limit)."
        )
    # [Note: chunk granularity] Least padding alone is a bad objective: trimming each key's
    # last chunk makes "one chunk holding the whole model" waste nothing, and then every
    # step gathers the whole model at once (no overlap of communication with compute,
    # and a working set as large as the unsharded model). Measured on a 99.5M GPT with
    # 2 gloo ranks and host placement (benchmarks/peers_cpu.py, docs/benchmarks.md): two
    # 50M chunks stepped in 11.4 s; after [Note: releasing after use], chunks of 21.5M,
    # 12.1M, 7.1M (one block) and 2.4M stepped in 2.76, 2.56, 2.05 and 2.27 s. So the
    # search stays at or below twice ``total / target_chunks`` (32 by default: at least
    # 16 chunks, so the gathered working set of current + prefetched chunk is at most an
    # eighth of the model), or twice the lower bound when ``numel_min`` or the largest
    # parameter is above that (a single size would force padding: 18% on a 10.8M GPT).
    # Within that range least waste still decides, and ties go to the larger size.
    if target_chunks > 0:
        hi = min(hi, max(2 * lo, 2 * -(-total // target_chunks)))  # at least [lo, 2 lo]: room to avoid padding
    lo = min(lo, hi)
    # geometric sweep plus the exact sums of leading runs (which give zero waste on the first chunk)
    sizes = {lo, hi}
    if hi > lo:
        ratio = (hi / lo) ** (1.0 / (candidates - 1))
        sizes.update(int(lo * ratio**k) for k in range(candidates))
    numel_of = {p.index: p.numel for p in params}
    running = 0
    for i in order:
        running = round_up(running, ALIGN_NUMEL) + numel_of[i]
        if running > hi:
            break
        if running >= lo:
            sizes.add(running)
    best: tuple[int, int] | None = None
    for size in sorted(sizes):
        cap = round_up(size, world_size)
        if cap < largest or cap > round_up(hi, world_size):
            continue
        waste = padding_waste(params, order, cap, world_size)
        if best is None or waste < best[0] or (waste == best[0] and cap > best[1]):
            best = (waste, cap)
    assert best is not None
    if keep is not None and keep % world_size == 0 and largest <= keep <= round_up(hi, world_size):
        near = abs(keep - best[1]) <= best[1] * KEEP_SIZE
        if near and padding_waste(params, order, keep, world_size) <= best[0] + total * KEEP_PADDING:
            return keep
    return best[1]


KEEP_SIZE, KEEP_PADDING = 1 / 100, 1 / 1000
"""[Note: the chunk size a repack keeps]
The automatic chunk size is the least padding among candidate sizes, some of them the sums of the parameters that
lead ``order``. The warm-up repacks in first-use order, where a block's norms sit elsewhere than in registration
order, so the size chosen again differed from the set-up's by a few elements: on a 168M-parameter Llama (width 1024,
8 layers) 62,657,536 against 62,658,560, which pads 2,048 elements (0.001%) less. A chunk keeps its shard buffers
through a repack only at the same capacity ([Note: a chunk that keeps its buffers] in ``kept.py``), so that
difference rebuilt every chunk, a fresh allocation and a copy of every shard, in the first step: 1.0-2.4 s of a
3.6-5.1 s first step there on the 2-core CPU machine, where the repack now takes 0.15 s. So a repack keeps the
chunks' capacity where it is within the same bounds (the device limit's among them), within ``KEEP_SIZE`` of the
search's size and pads at most ``KEEP_PADDING`` of the model more. A size the trace moves further (room the traced
activations leave for larger chunks, or take) is the search's, and so is the size tried next where the kept one's
layout does not fit the limit (``LayoutChooser.choose``)."""


def describe(layout: Layout) -> str:
    used = sum(c.used_numel for c in layout.chunks)
    total = sum(c.capacity_numel for c in layout.chunks)
    pct = 100.0 * (total - used) / total if total else 0.0
    return f"{len(layout.chunks)} chunks of {layout.capacity_numel} elements ({pct:.1f}% padding)"


def keep_slots(new: Layout, old: Layout) -> Layout:
    """``new``, with each chunk that holds mostly what a chunk of ``old`` held (the same key and capacity) laid out
    as that one is: the parameters both hold in their old slots, the others where the old ones left room.

    [Note: a chunk's parameters in their old places]
    The warm-up packs in first-use order, and within a chunk that order rarely matches registration order even
    where the chunks hold what they held: Llama registers a block's two norms before its attention, and uses the
    second after it. Every chunk then had its parameters at other offsets, so none could keep its buffers ([Note: a
    chunk that keeps its buffers] in ``repack.py``) and the repack after the warm-up rebuilt every chunk of a model
    whose chunks it left as they were (on one rank and a 0.12B Llama, all of them). Where in a chunk a parameter
    sits changes nothing that is planned: a chunk is gathered, reduced and stepped whole, and the trace maps
    parameters to chunks. So such a chunk keeps its old slots; ``order`` follows, each chunk's parameters in their
    old order where the new order had them.

    Where a chunk holds a block and a half, first-use order also moves small parameters across chunk bounds: the
    next block's second norm, used after an attention output that lies in the next chunk, goes there, and every
    chunk after it holds one norm more and one less. None held what it held, and the repack rebuilt 5 of the 9 host
    chunks of a 0.54B Llama in 64M-element chunks. So a chunk whose parameters that an old chunk held are at least
    half of both keeps those in their old slots and places the others first-fit (aligned) where nothing kept lies,
    which is the old chunk's tail or a parameter's place that left; where they do not fit, it is packed anew. The
    planned chunks hold what first-use order put in them either way."""
    if new.world_size != old.world_size:
        return new
    owner = {s.param_index: (c, s) for c in old.chunks for s in c.slots}
    taken: set[int] = set()
    chunks, order = [], list(new.order)
    place = {i: k for k, i in enumerate(order)}
    for c in new.chunks:
        kept = _in_old_places(c, owner, taken)
        chunks.append(c if kept is None else kept[1])
        if kept is None:
            continue
        taken.add(kept[0])
        for k, s in zip(sorted(place[s.param_index] for s in c.slots), kept[1].slots, strict=True):
            order[k] = s.param_index  # the chunk's places in the order, in its slots' order
    return Layout(new.capacity_numel, new.world_size, tuple(chunks), tuple(order))


def _in_old_places(
    c: ChunkSpec, owner: dict[int, tuple[ChunkSpec, Slot]], taken: set[int]
) -> tuple[int, ChunkSpec] | None:
    """The old chunk that held most of ``c`` and ``c`` laid out in it ([Note: a chunk's parameters in their old
    places]), its slots in offset order; ``None`` where no old chunk qualifies or the others do not fit."""
    was = holding_most(c, owner, taken, same_slots=False)
    if was is None:
        return None
    members = {s.param_index for s in c.slots}
    slots = sorted((replace(s, chunk_id=c.chunk_id) for s in was.slots if s.param_index in members), key=_offset)
    for s in c.slots:
        if owner[s.param_index][0] is not was:
            at = _first_fit(slots, s.numel, c.capacity_numel)
            if at is None:
                return None
            slots.append(replace(s, offset=at))
            slots.sort(key=_offset)
    return was.chunk_id, ChunkSpec(c.chunk_id, c.key, tuple(slots), c.capacity_numel)


def _offset(s: Slot) -> int:
    return s.offset


def holding_most(
    c: ChunkSpec, owner: Mapping[int, tuple[ChunkSpec, Slot]], taken: Collection[int], *, same_slots: bool
) -> ChunkSpec | None:
    """The old chunk of ``c``'s key and capacity, not in ``taken``, that holds the most of ``c``'s elements (``owner``:
    each parameter's old chunk and slot), counting only those in the same slots where ``same_slots``; ``None`` where
    those are less than half of either chunk ([Note: a chunk's parameters in their old places])."""
    shared: dict[int, int] = {}
    spec_of: dict[int, ChunkSpec] = {}
    for s in c.slots:
        was, slot = owner[s.param_index]
        if (was.key, was.capacity_numel) != (c.key, c.capacity_numel) or was.chunk_id in taken:
            continue
        if not same_slots or (slot.offset, slot.numel) == (s.offset, s.numel):
            shared[was.chunk_id] = shared.get(was.chunk_id, 0) + s.numel
            spec_of[was.chunk_id] = was
    if not shared:
        return None
    best = max(shared, key=lambda k: (shared[k], -k))
    return spec_of[best] if 2 * shared[best] >= max(c.used_numel, spec_of[best].used_numel) else None


def _first_fit(slots: list[Slot], numel: int, capacity: int) -> int | None:
    """The first aligned offset where ``numel`` elements fit between ``slots`` (sorted by offset) in ``capacity``."""
    at = 0
    for s in slots:
        if at + numel <= s.offset:
            return at
        at = max(at, round_up(s.offset + s.numel, ALIGN_NUMEL))
    return at if at + numel <= capacity else None
