"""Where a new layout's chunks take their values from: the module itself, or the chunks of the layout
being replaced.

``ChunkManager.pack`` builds the new chunks one at a time and asks a *source* for each parameter's
whole value (``value(i)``), its gradient so far (``grad(i)``, ``None`` when it has none) and whether
it had one (``has_grad(i)``); after each new chunk it calls ``placed(chunk)``. The source also says
in which order the chunks are built (``build_order``) and fills each one's values (``fill``): a
value the same on every rank that can be read in pieces (from a weights file) is read only for the
pieces this rank's shard holds.

[Note: streaming repack] Snapshotting every chunk before building the new layout held the
whole model's values and gradients unsharded on the host at once (8 bytes a fp32 parameter
on top of the shards; on a 99.5M GPT on 2 ranks, 0.9 GiB of the 2.2 GiB peak RSS a rank).
``OldChunks`` all-gathers an old chunk when the new layout first needs one of its parameters,
drops it at once (its shards go), and frees its host copy when every parameter it held has been
placed. New chunks are built in layout order on every rank, so the all-gathers run in one order
everywhere. ``eager=True`` first moves every old device shard to the host (this rank's pieces only):
used when a device limit is set and shards live on the device, where old and new shards must not
overlap on the device ([Note: a repack under a device limit]). ``drop`` frees an old
chunk's shard storage at once although the optimizers' param groups and the gradients attached to
them still view it until the rebind: freed when the last view went, every old shard lived to the
end of the repack (+425 MB at the peak of a 113.6M GPT on 2 ranks); and the heap's freed pages go
back to the OS after each old chunk, which glibc did not reuse for the new chunks' shards.

[Note: optimizer state through a repack] A repack moves shard boundaries (another chunk size,
first-use order instead of registration order, another world size after a resume), so the piece
of a parameter that a rank owns changes size and place. Values and gradients are all-gathered
per old chunk and each rank copies out what its new shards hold; per-element optimizer state
(Adam's moments) must travel the same way. Moved by parameter instead, a rank whose piece grew
kept a state tensor of the old size (the fused kernel then read past its end: heap corruption
on 2 ranks), pieces arriving on a rank started from zero state, and pieces leaving it were
orphaned. So the state rides along as *extra shards*: ``ExtraShards.take(old_chunk)`` lays each
per-element state key out like the old chunk's master shard (and lets go of the old state), the
repack all-gathers it with the values, and ``give`` hands each rank the piece of each parameter
that its new shard holds, sliced at once so nothing whole outlives its old chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from ..files.weights import ModuleWeights
from ..system.host_heap import release_freed_memory
from .build import fill_range, flat_piece
from .chunk import Chunk, Tier
from .kept import Kept, gather_pieces, pair_chunks, staying
from .materialize import DeferredInit
from .packing import ChunkSpec, Layout

_HOST = torch.device("cpu")

if TYPE_CHECKING:  # the manager imports this module
    from ..memory.manager import ChunkManager


class ExtraShards(Protocol):
    """Per-element state kept beside the chunks (the optimizers'), carried through a repack."""

    def take(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """This rank's shard of each state key for ``chunk``, laid out like its master shard; the holder lets go
        of the chunk's state. Every rank returns the same keys for the same chunk (the tensors are all-gathered)."""

    def give(self, param_index: int, pieces: dict[str, torch.Tensor], chunk: Chunk, offset: int) -> None:
        """This rank's new piece of each state key of one parameter (flat, like its new master view), which starts
        at element ``offset`` of ``chunk``'s shard."""


def piece_range(chunk: Chunk, offset: int, numel: int) -> tuple[int, int]:
    """The element range ``[a, b)`` of the chunk that this rank's shard holds of a parameter at
    ``[offset, offset + numel)`` (empty when ``a >= b``)."""
    lo, hi = chunk.shard_range
    return max(offset, lo), min(offset + numel, hi)


class FromModule:
    """The first pack: values are the parameters' own, read from a weights file, or made by deferred init.

    A value read from ``weights`` is the same on every rank, so ``exact(i)``: when a whole chunk is, the
    pack reads only this rank's pieces of it and needs no broadcast. Otherwise a value is the tensor itself,
    after ``deferred`` initialised its module when it was built on the meta device."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        *,
        deferred: DeferredInit | None = None,
        weights: ModuleWeights | None = None,
    ) -> None:
        self.params = params
        self.deferred = deferred
        self.weights = weights
        if deferred is not None:
            deferred.start(
                provided=[t for t in params if weights is not None and weights.provides(t)]
                + [b for _, _, b in (weights.buffers if weights is not None else [])]
            )

    def exact(self, i: int) -> bool:
        return self.weights is not None and self.weights.provides(self.params[i])

    def build_order(self, layout: Layout) -> list[ChunkSpec]:
        """Each chunk once all its parameters exist: in the order of its last parameter in registration order,
        which is the order deferred initialisation makes them ([Note: deferred initialisation]). In layout
        order, the one chunk of a param group's biases and norms, which spans the model, came second and made
        every module before its last bias initialise first: the whole model at once."""
        return sorted(layout.chunks, key=lambda spec: (max(s.param_index for s in spec.slots), spec.chunk_id))

    def same_everywhere(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s values are the same on every rank (all read from the file): no broadcast needed, and
        only this rank's pieces are read."""
        return all(self.exact(s.param_index) for s in chunk.spec.slots)

    def in_memory(self, chunk: Chunk) -> bool:
        """Whether every value of ``chunk`` is in memory, none read from the file: reading them twice costs no I/O
        ([Note: the compute copy from the values] in ``build.py``)."""
        return not any(self.exact(s.param_index) for s in chunk.spec.slots)

    def fill(self, out: torch.Tensor, chunk: Chunk, lo: int) -> None:
        """Elements ``[lo, lo + out.numel())`` of ``chunk``'s values into ``out``."""
        if self.same_everywhere(chunk):
            read = self.weights.read  # type: ignore[union-attr]
            fill_range(out, chunk.spec.slots, lo, lambda i, a, b: read(self.params[i], a, b))
        else:
            fill_range(out, chunk.spec.slots, lo, lambda i, a, b: flat_piece(self.value(i), a, b))

    def adopt(self, chunk: Chunk) -> None:
        return None  # the first pack has no old chunks

    def value(self, i: int) -> torch.Tensor:
        p = self.params[i]
        if self.exact(i):
            assert self.weights is not None
            return self.weights.read(p)
        if self.deferred is not None and self.deferred.is_deferred(p):
            return self.deferred.value(p)
        return p.detach()

    def grad(self, i: int) -> torch.Tensor | None:
        return None

    def has_grad(self, i: int) -> bool:
        return False

    def placed(self, chunk: Chunk) -> None:
        if self.deferred is not None:
            for t in chunk.tensors:
                self.deferred.take(t.param)

    def finish(self, buffer_device: torch.device) -> None:
        """After the last chunk: initialise what is left (buffer-only modules) and load the file's buffers."""
        if self.deferred is not None:
            self.deferred.finish()
        for m, name, b in self.weights.buffers if self.weights is not None else []:
            value = self.weights.read(b).reshape(b.shape)  # type: ignore[union-attr]
            if self.deferred is not None and self.deferred.is_deferred(b):
                m._buffers[name] = value.to(device=buffer_device, dtype=b.dtype)
                self.deferred.take(b)
            else:
                with torch.no_grad():
                    b.copy_(value)

    def done(self) -> bool:
        return True


def _grads_anywhere(mgr: ChunkManager, chunks: list[Chunk]) -> set[int]:
    """The parameters whose gradients a repack carries: those that got one on any rank. Every parameter of a chunk
    reduced this step once counted (its ``grad_written`` is the same on every rank), and a parameter no rank had
    used then stepped from a zero gradient after the repack: weight decay moved it where ``torch.optim`` skips it.
    A rank's flag covers the parameter, or (after the vote) its pieces of it, and some rank holds every piece."""
    moving = [t for c in chunks if mgr.grads.to_move(c) for t in c.tensors]
    flags = [t.has_grad for t in moving]
    if mgr.comm.world_size > 1:  # the same chunks, in the same order, on every rank
        voted = torch.tensor([int(f) for f in flags] or [0], dtype=torch.int32, device=mgr.comm.tensor_device())
        flags = [
            bool(f)
            for f in mgr.comm.all_reduce(voted, "max", what="the vote on gradients a repack carries").tolist()[
                : len(moving)
            ]
        ]
    return {t.slot.param_index for t, f in zip(moving, flags, strict=True) if f}


class OldChunks:
    """The chunks of the layout being replaced, read one at a time (see [Note: streaming repack])."""

    def __init__(
        self,
        mgr: ChunkManager,
        chunks: list[Chunk],
        tiers: Mapping[int, Tier],
        *,
        extras: ExtraShards | None = None,
        eager: bool = False,
    ) -> None:
        self.mgr = mgr
        self.extras = extras
        self.chunks, self.tiers = chunks, tiers
        self.owner = {t.slot.param_index: c for c in chunks for t in c.tensors}
        self.left = {c.chunk_id: len(c.tensors) for c in chunks}
        self.loaded: set[int] = set()  # old chunk ids already read
        self.had_grad = _grads_anywhere(mgr, chunks)
        # per parameter, views of its old chunk's whole values, gradients and extra state on the host
        self._values: dict[int, torch.Tensor] = {}
        self._grads: dict[int, torch.Tensor] = {}
        self._extra: dict[int, dict[str, torch.Tensor]] = {}
        # an old device shard staged on the host: (master, gradient or None, extra state), this rank's pieces only
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]] = {}
        self._read_in_place: dict[int, Chunk] = {}  # old chunks read where they are, dropped once placed
        # [Note: a chunk that keeps its buffers] in kept.py: new chunk id -> the old chunk it keeps (``build_order``);
        # per old chunk kept, the parameters its keeper holds, whether the others were copied out, its extra state
        self._keeps: dict[int, Chunk] = {}
        self._stays: dict[int, set[int]] = {}
        self._emptied: set[int] = set()
        self._taken: dict[int, dict[str, torch.Tensor]] = {}
        self.kept = 0  # new chunks that kept an old chunk's buffers
        if eager:
            for c in chunks:
                if c.shard_tier is Tier.DEVICE:
                    self._stage(c)

    # ------------------------------------------------------------------ reads
    def _stage(self, c: Chunk) -> None:
        """[Note: a repack under a device limit] Old and new device shards must not overlap on the device, so
        before the first new chunk is built every old device shard goes to the host and its device memory is freed.
        Reading every old chunk whole instead (all-gathered, per parameter) held the whole unsharded model's values
        and gradients (and, on later repacks, its optimizer state) on every rank's host at once: 4x the rank's shard
        on 2 ranks, 2 x world_size x in general, about 56 GB a rank for 7B on 8 GPUs. Staged, a rank holds only its
        own shards, and the chunks are then read one at a time as without a limit ([Note: streaming repack])."""
        mgr = self.mgr
        master = c.master_tensor_for_read().to(_HOST, copy=True)
        grad = c.grad.to(_HOST, copy=True) if mgr.grads.to_move(c) and c.grad is not None else None
        extra = {k: v.to(_HOST, copy=True) for k, v in self.extras.take(c).items()} if self.extras else {}
        self._staged[c.chunk_id] = (master, grad, extra)
        mgr.drop(c)

    def _load(self, c: Chunk) -> None:
        """Old chunk ``c``'s values, gradients and extra state, whole on the host, viewed per parameter.

        [Note: reading an old chunk in place]
        With one rank a host shard is the whole chunk, and so is a shard staged from the device: its parameters are
        read where they are, and the old chunk is dropped once the last of them is placed. With several ranks the
        chunk is all-gathered, its shards dropped at once, and the parameters are views of the gathered copy, which
        goes with the last of them. ``build_chunk`` writes each new shard where it lives, not through a whole
        chunk's buffer first (on a GPU a device shard is copied to parameter by parameter from the old host shards).
        Copied to the host, cloned per parameter and built whole, every element of a one-rank repack went through
        five fresh buffers it did not need, each a pass of page faults and copies: a 0.43B Llama's first step (its
        warm-up and repack) on a 2-core CPU took 15.7 s against 10.9 read in place, and its set-up 4.8 s against
        3.3, at the same peak; the repack above the model's own memory held 2.5 chunks' shards, then 0.5."""
        if c.chunk_id in self.loaded:
            return
        mgr = self.mgr
        staged = self._staged.pop(c.chunk_id, None)
        if staged is not None:
            master, grad, shards = staged
        else:
            master = c.master_tensor_for_read()
            grad = c.grad if mgr.grads.to_move(c) else None
            shards = self.extras.take(c) if self.extras else {}
        was_staged = staged is not None
        in_place = mgr.comm.world_size == 1 and (was_staged or _in_host_memory(c, master))
        if in_place:
            full, full_grad, extra = master, grad, shards
        else:
            full = mgr.gather_shard(c, master)
            full_grad = mgr.gather_shard(c, grad) if grad is not None else None
            extra = {k: mgr.gather_shard(c, v) for k, v in shards.items()}
        del master, grad, shards, staged
        for t in c.tensors:
            i, span = t.slot.param_index, slice(t.offset, t.offset + t.numel)
            self._values[i] = full[span]
            if full_grad is not None and i in self.had_grad:
                self._grads[i] = full_grad[span]
            if extra:
                self._extra[i] = {k: v[span] for k, v in extra.items()}
        del full, full_grad, extra
        if in_place and not was_staged:  # its buffers are read until its last parameter is placed
            self._read_in_place[c.chunk_id] = c
        else:
            mgr.drop(c)
            release_freed_memory()  # freed heap blocks are not reused in this pattern of sizes: give them back now
        self.loaded.add(c.chunk_id)

    def _open(self, c: Chunk) -> None:
        """Old chunk ``c``'s values for the new chunks that hold its parameters: all of them, or those its keeper
        does not hold."""
        if c.chunk_id in self._stays:
            self._take_out(c)
        else:
            self._load(c)

    def _take_out(self, c: Chunk) -> None:
        """Copy out the values, gradients and extra state of the parameters of ``c`` that its keeper does not hold,
        whole (on several ranks through an all-gather of their pieces), and leave its buffers to the keeper."""
        if c.chunk_id in self._emptied:
            return
        self._emptied.add(c.chunk_id)
        leaving = [t for t in c.tensors if t.slot.param_index not in self._stays[c.chunk_id]]
        extra = self._taken[c.chunk_id] = self.extras.take(c) if self.extras else {}  # the keeper's, for ``adopt``
        if not leaving:
            return
        mgr = self.mgr
        master, grad = c.master_tensor_for_read(), (c.grad if mgr.grads.to_move(c) else None)
        if mgr.comm.world_size > 1:  # the same old chunks, in the same order, on every rank
            spans, at = {}, 0
            for t in leaving:  # each one's place in the pieces gathered, back to back
                spans[t.slot.param_index], at = slice(at, at + t.numel), at + t.numel
            master = gather_pieces(mgr, c, master, leaving)
            grad = gather_pieces(mgr, c, grad, leaving) if grad is not None else None
            extra = {k: gather_pieces(mgr, c, v, leaving) for k, v in extra.items()}
        else:  # the shard is the whole chunk
            spans = {t.slot.param_index: slice(t.offset, t.offset + t.numel) for t in leaving}
        for t in leaving:
            i, span = t.slot.param_index, spans[t.slot.param_index]
            self._values[i] = master[span].clone()
            if grad is not None and i in self.had_grad:
                self._grads[i] = grad[span].clone()
            if extra:
                self._extra[i] = {k: v[span].clone() for k, v in extra.items()}

    def adopt(self, chunk: Chunk) -> Kept | None:
        """The shard buffers of the old chunk ``chunk`` keeps, for it to take ([Note: a chunk that keeps its
        buffers] in ``kept.py``); ``None`` where it keeps none."""
        old = self._keeps.get(chunk.chunk_id)
        if old is None:
            return None
        assert (old.master_dtype, old.compute_dtype) == (chunk.master_dtype, chunk.compute_dtype)
        self._take_out(old)
        stays, lo = self._stays[old.chunk_id], chunk.shard_range[0]
        fresh = tuple(s for s in chunk.spec.slots if s.param_index not in stays)  # came, or moved within
        for s in fresh:  # every rank reads the same old chunks in one order, whatever pieces its shard holds
            self._open(self.owner[s.param_index])
        extra = self._taken.pop(old.chunk_id, {})
        for t in old.tensors if extra else ():  # this rank's pieces of those it holds, where the old shard held them
            a, b = piece_range(chunk, t.offset, t.numel)
            if a < b and t.slot.param_index in stays:
                assert self.extras is not None
                self.extras.give(
                    t.slot.param_index, {k: v[a - lo : b - lo].clone() for k, v in extra.items()}, chunk, a - lo
                )
        master = old.master
        assert master is not None
        mgr = self.mgr
        with mgr.ledger.tracked(old):  # they leave the old chunk's accounting for the new one's
            grad = old.grad if old.grad is not None and not old.grad_released else None
            taken = Kept(master, old.low, grad, fresh)
            old.master = old.low = None
            if grad is not None:
                old.grad = None
        mgr.drop(old)
        self.loaded.add(old.chunk_id)
        self.kept += 1
        return taken

    def build_order(self, layout: Layout) -> list[ChunkSpec]:
        self._keeps = pair_chunks(layout, self.chunks, self.tiers)
        spec_of = {spec.chunk_id: spec for spec in layout.chunks}
        self._stays = {c.chunk_id: staying(spec_of[new], c) for new, c in self._keeps.items()}
        return list(layout.chunks)  # the order every rank all-gathers the old chunks in

    def same_everywhere(self, chunk: Chunk) -> bool:
        return True  # a repack never broadcasts: every rank holds (or gathers) the old values

    def in_memory(self, chunk: Chunk) -> bool:
        return False  # the copy is converted from the master just built: the old values were gathered or paged in

    def fill(self, out: torch.Tensor, chunk: Chunk, lo: int) -> None:
        for s in chunk.spec.slots:  # every rank gathers the same old chunks in one order, whatever pieces it keeps
            self._open(self.owner[s.param_index])
        fill_range(out, chunk.spec.slots, lo, lambda i, a, b: flat_piece(self.value(i), a, b))

    def value(self, i: int) -> torch.Tensor:
        self._open(self.owner[i])
        return self._values[i]

    def has_grad(self, i: int) -> bool:
        return i in self.had_grad

    def grad(self, i: int) -> torch.Tensor | None:
        if i not in self.had_grad:
            return None
        self._open(self.owner[i])
        return self._grads.get(i)

    # ----------------------------------------------------------------- writes
    def placed(self, chunk: Chunk) -> None:
        """``chunk`` of the new layout is built: hand out its extra-state pieces and forget its parameters."""
        for t in chunk.tensors:
            i = t.slot.param_index
            self._values.pop(i, None)
            self._grads.pop(i, None)
            extra = self._extra.pop(i, None)
            a, b = piece_range(chunk, t.offset, t.numel)
            if extra and self.extras is not None and a < b:
                self.extras.give(
                    i,
                    {k: v[a - t.offset : b - t.offset].clone() for k, v in extra.items()},
                    chunk,
                    a - chunk.shard_range[0],
                )
            old = self.owner[i].chunk_id
            self.left[old] -= 1
            if not self.left[old]:
                del self.left[old]
                read = self._read_in_place.pop(old, None)
                if read is not None:
                    self.mgr.drop(read)
                    release_freed_memory()

    def done(self) -> bool:
        return not (self.left or self._values or self._grads or self._extra or self._read_in_place)


def _in_host_memory(c: Chunk, master: torch.Tensor) -> bool:
    """Whether an old chunk's shard buffers are ordinary host memory, readable after the call that got them (a disk
    shard's are paged in only while read)."""
    return c.shard_tier is not Tier.DISK and master.device.type == "cpu"
