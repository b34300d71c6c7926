"""Gradient reduction with several ranks: which chunk reduces when, and where its result lands.

Backward adds each parameter's gradient into its chunk's *gradient payload* (the whole chunk's
worth, master dtype, on the device). When a chunk's gradients are final the payload is
reduce-scattered, asynchronously, into every rank's gradient shard; a few reduce-scatters stay in
flight while backward goes on, and each lands through ``GradOffload`` (a side-stream copy when
the shard lives on the host of a CUDA machine).

The manager owns the bytes and their accounting; this module only schedules. It asks the
manager to track every buffer it creates or frees (``manager.ledger.tracked``) and to find room on the
device tier (``manager.grads.room_for``), so the ledger stays the one account of chunk memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..chunks.chunk import Chunk, Tier
from ..chunks.chunk import nbytes as tensor_nbytes
from ..chunks.repack import piece_range
from ..chunks.states import TensorState
from ..errors import ChunkError
from ..tiers.offload import GradOffload
from .replicas import ReplicaSums

if TYPE_CHECKING:  # the manager builds the reducer; no import at run time, so no cycle
    from ..memory.manager import ChunkManager
    from ..system.exact_pinned import ExactPinned

S = TensorState
_EMPTY, _RAW, _SCALED = object(), object(), object()  # a gradient payload range: unwritten, a raw sum, scaled
MakeRoom = Callable[[int], None] | None  # evict by the placement policy until this many more bytes fit


class GradReducer:
    def __init__(
        self, manager: ChunkManager, *, pinned: bool, in_flight: int = 2, exact: ExactPinned | None = None
    ) -> None:
        self.manager = manager
        self.offload = GradOffload(manager.device, pinned=pinned, exact=exact)  # exact: staging pinned to the byte
        self.offload.clock = manager.clock
        self.in_flight = in_flight  # reduce-scatters allowed in flight: bounds the gradient payloads alive
        self.sync = True  # False inside no_sync(): keep gradients local (accumulation)
        self.payload_peak = 0  # most bytes of unreduced whole-chunk gradients alive at once
        self._inflight: list[tuple[Chunk, Any, Any]] = []  # reduce-scatters launched (and votes), not yet landed
        # stepping in backward: each reduce also votes on which of the chunk's parameters got a gradient on some
        # rank, so every rank decides alike whether the chunk steps when it lands ([Note: gradients some ranks lack])
        self.vote = False
        self.voted: dict[int, bool] = {}  # chunk id -> every trainable parameter got a gradient on some rank
        self._order: list[int] = []  # chunks reduce in this order on every rank
        # in a traced backward, the moment (``MomentKey``) at whose start each chunk reduces -> those chunks; None:
        # reduce each chunk as soon as every rank has all its gradients ([Note: when a chunk reduces])
        self._due: dict[Hashable, list[int]] | None = None
        self._payload_due: dict[Any, list[int]] = {}  # the same moments -> the chunks whose gradient payload is made
        self._traced = False  # this backward follows a trace with ``_due``
        self._launched: set[int] = set()  # chunks reduced in this backward (a later gradient for one is an error)
        self._filled: dict[int, dict[int, object]] = {}  # chunk id -> payload offset -> _RAW or _SCALED
        # called with a chunk whose gradients of this backward are final in its shard ([Note: stepping in backward])
        self.on_final: Callable[[Chunk], None] | None = None
        self.replicas = ReplicaSums(manager)

    # ================================================================== order
    def reset_order(self, chunks: Sequence[Chunk]) -> None:
        """Highest id first: right when each chunk holds consecutive layers (the trace refines it)."""
        self._order = sorted((c.chunk_id for c in chunks if c.trainable), reverse=True)
        self._due = None

    def set_moments(
        self, chunks: Sequence[Chunk], due: dict[int, Hashable | None], payloads: dict[Any, list[int]]
    ) -> None:
        """Reduce each chunk at the start of the moment ``due`` names (None: at the end of backward), in the order
        the trace has them complete ([Note: when a chunk reduces]); make the gradient payloads at the moments
        ``payloads`` names ([Note: gradients some ranks lack])."""
        self._payload_due = payloads
        trainable = [c.chunk_id for c in chunks if c.trainable]
        rank = {key: i for i, key in enumerate(dict.fromkeys(k for k in due.values() if k is not None))}
        self._order = sorted(trainable, key=lambda c: (rank.get(due.get(c), len(rank)), -c))
        self._due = {}
        for cid in self._order:
            key = due.get(cid)
            if key is not None:
                self._due.setdefault(key, []).append(cid)

    def set_order(self, chunks: Sequence[Chunk], completion: Sequence[int]) -> None:
        """Reduce chunks in the order backward completes them (``completion``, from the trace, the same on
        every rank); chunks it does not name follow, highest id first.

        [Note: reduce order] Every rank must launch the reduce-scatters in one order, and a chunk
        waits for all chunks before it in that order. The default, highest id first, is right
        when each chunk holds consecutive layers; but a chunk of one param group's norms and
        biases spans the whole model and completes only at the end of backward, so with it
        first in line every other gradient payload stayed alive until then: the whole model's
        gradient, unsharded (4 bytes a parameter in fp32) at the peak. The warm-up's backward has
        no trace yet; it takes the reverse of its forward's first use of each chunk (``ChunkHooks``),
        because "highest id first" in the registration-order layout of a model registered in
        another order than it runs (head before embedding) put the chunk backward completes
        *last* first in line: every gradient payload stayed alive, and under a limit the first
        step failed.
        """
        trainable = {c.chunk_id for c in chunks if c.trainable}
        named = [cid for cid in dict.fromkeys(completion) if cid in trainable]
        self._order = named + sorted(trainable - set(named), reverse=True)
        self._due = None

    # ============================================================== gradients
    @property
    def traced(self) -> bool:
        """This backward follows the trace's moments."""
        return self._traced

    def expect(self, chunk: Chunk, make_room: MakeRoom) -> None:
        """``chunk``'s gradients may come from now on: its gradient payload is made now, on every rank, whether or
        not this rank's gradients come ([Note: gradients some ranks lack])."""
        if chunk.chunk_id not in self._launched or not self.sync:
            self._ensure_payload(chunk, make_room)

    def expect_at(self, key: Hashable, make_room: MakeRoom) -> None:
        """The payloads of the chunks whose first gradient the trace saw arrive after moment ``key``."""
        for cid in self._payload_due.get(key, ()):
            self.expect(self.manager.chunks[cid], make_room)

    def payloads_to_come(self) -> list[Chunk]:
        """The chunks whose gradient payload this backward may still make: trainable, without one now, and not
        reduced yet."""
        return [
            c
            for c in self.manager.chunks
            if c.trainable and c.grad_payload is None and c.chunk_id not in self._launched
        ]

    def drop_unwritten(self) -> None:
        """A backward that delivered no gradient ended: the payloads it made and nothing wrote go."""
        for chunk in self.manager.chunks:
            if chunk.grad_payload is not None and not self._filled.get(chunk.chunk_id):
                self._filled.pop(chunk.chunk_id, None)
                self._free_payload(chunk)

    def refuse_late(self, chunk: Chunk) -> None:
        """Refuse a gradient for a chunk already reduced in this backward, before anything is changed."""
        if self.sync and chunk.chunk_id in self._launched:
            raise ChunkError(
                f"a gradient for chunk {chunk.chunk_id} (parameters {', '.join(t.name for t in chunk.tensors[:4])}"
                f"{' ...' if len(chunk.tensors) > 4 else ''}) arrived after the chunk was reduced in this backward: "
                "the warm-up traced every gradient of the chunk earlier in backward. A parameter used at another "
                "point of the step than in the warm-up (data-dependent control flow) must be in a module the step "
                "runs at the same point; name the module that reads it in leaf_modules, or report this."
            )

    def add(self, chunk: Chunk, offset: int, grad: torch.Tensor, make_room: MakeRoom) -> None:
        """Put one parameter's gradient into the chunk's gradient payload (allocated on first use, not zeroed).

        [Note: filling the gradient payload in one pass] The payload is ``torch.empty``: a range is written
        by the first gradient it gets, and at ``reduce`` only the ranges that got none (and the padding) are
        zeroed. In the micro-batch that reduces (``sync``), the first gradient is scaled by 1/world_size as it
        is copied, ``torch.mul(grad, 1/w, out=range)``, which is what DDP's reducer does when it copies a
        gradient into its bucket. Zeroing the whole payload, adding into it and scaling it in a pass of its
        own wrote the payload three times and read it twice; this writes it once. Inside ``no_sync`` the
        ranges hold raw sums, scaled once when the reducing micro-batch adds its gradient (or at ``reduce``
        for a range that got none then): (g1 + g2) / w, as DDP computes it. A second gradient for a range
        already scaled in the same micro-batch (reentrant checkpointing can deliver two) adds g / w."""
        self.refuse_late(chunk)
        self._ensure_payload(chunk, make_room)
        flat = grad.reshape(-1)
        dst = chunk.grad_payload[offset : offset + flat.numel()]  # type: ignore[index]
        filled = self._filled.setdefault(chunk.chunk_id, {})
        state = filled.get(offset, _EMPTY)
        scale = 1.0 / self.manager.comm.all_size  # DDP's mean over every rank
        if state is _EMPTY:
            if self.sync and flat.dtype == dst.dtype:
                torch.mul(flat, scale, out=dst)
            else:
                dst.copy_(flat)
                if self.sync:
                    dst.mul_(scale)
        elif state is _RAW:
            dst.add_(flat)
            if self.sync:
                dst.mul_(scale)
        else:
            dst.add_(flat, alpha=scale)
        filled[offset] = _SCALED if self.sync else _RAW

    def _ensure_payload(self, chunk: Chunk, make_room: MakeRoom) -> None:
        if chunk.grad_payload is not None:
            return
        mgr = self.manager
        what = f"chunk {chunk.chunk_id}'s gradient payload"
        if not self.sync:  # inside no_sync: every chunk's payload stays until the micro-batch that steps
            what += (
                " (accumulating with sharded_accumulation=False: each chunk's whole gradient stays on the device "
                "from the first micro-batch to the step; sharded_accumulation=True keeps only this rank's "
                "shard, or raise device_memory_limit)"
            )
        mgr.grads.room_for(chunk, what, make_room)
        with mgr.ledger.tracked(chunk):
            chunk.grad_payload = mgr.pool.tensor(chunk.capacity_numel, chunk.grad_payload_dtype)
        self._filled[chunk.chunk_id] = {}
        live = sum(tensor_nbytes(c.grad_payload) for c in mgr.chunks)
        self.payload_peak = max(self.payload_peak, live)

    def _finish_payload(self, chunk: Chunk) -> None:
        """Before the reduce-scatter: zero what no gradient wrote (padding, ranges without a gradient on this
        rank) and scale the raw sums that ``no_sync`` micro-batches left."""
        payload = chunk.grad_payload
        assert payload is not None
        filled = self._filled.pop(chunk.chunk_id, {})
        scale = 1.0 / self.manager.comm.all_size  # DDP's mean over every rank
        end = 0
        for t in sorted(chunk.tensors, key=lambda t: t.offset):
            state = filled.get(t.offset, _EMPTY)
            if t.offset > end:
                payload[end : t.offset].zero_()
            if state is _EMPTY:
                payload[t.offset : t.offset + t.numel].zero_()
            elif state is _RAW:
                payload[t.offset : t.offset + t.numel].mul_(scale)
            end = max(end, t.offset + t.numel)
        if end < payload.numel():
            payload[end:].zero_()

    # [Note: when a chunk reduces]
    # Every rank must issue its chunk collectives in one sequence: NCCL pairs them by position on one communicator
    # ([Note: gloo as NCCL] in group.py). A rank once launched a chunk's reduce-scatter when its gradients
    # were complete *on that rank*; a parameter that got a gradient on some ranks and not others (a module's own
    # parameter used only when the batch has images) made one rank launch it in the middle of backward and the
    # other only at the end, between different all-gathers: a deadlock, or two chunks' data mixed. So with several
    # ranks a reduce-scatter is launched only at the start of a moment (a module hook, the same sequence on every
    # rank, checked at each backward's end) or at the end of backward, and which chunks go is decided the same way
    # on every rank:
    # - in a traced backward, by the trace: the warm-up records after which moment each parameter's gradient
    #   arrived, the ranks agree on the latest (the all-reduce that agrees on activations carries it), and a chunk
    #   reduces at the start of the moment after all of its parameters' gradients; a rank that got no gradient for
    #   one contributes zeros, as DDP does for an unused parameter. A chunk with a parameter no rank's warm-up gave
    #   a gradient reduces at the end. The moment is named by its kind, module and occurrence in the step
    #   (``MomentKey``), not its position, so a step that skips a module (a branch taken every third batch) still
    #   reduces the rest on time; a chunk whose moment does not come reduces at the end. A gradient that arrives
    #   after its chunk was reduced is refused with an error, never dropped.
    # - in the warm-up (and a re-traced micro-batch), by agreement: at each moment of backward the ranks all-reduce
    #   (min) which waiting chunks are complete, and those reduce. One small collective a moment, in these steps
    #   only. A chunk incomplete on one rank holds back only itself, not the chunks after it.
    # The vote after backward (``agree_on_grads``) still decides which parameters have a gradient at all.
    #
    # [Note: gradients some ranks lack]
    # A gradient lands on one rank and not on another (DDP's find_unused_parameters case), but ranks plan evictions
    # from their device bytes and tensor states, so nothing those hold may follow one rank's gradients. With a
    # gate's row packed beside its module's weights (a chunk whose parameters one rank may all lack gradients for),
    # under a limit, two ranks parted three ways in the first traced step and hung: the rank with the gradient made
    # the chunk's gradient payload when it arrived, the other only at the reduce; the gradient's tensor waited to
    # reduce on one rank and stayed in use to the end of backward on the other (its module's backward took it into
    # use; no gradient took it out), so after the reduce one rank could evict the chunk and the other not; and
    # stepping in backward, one rank stepped the chunk as it landed while the other waited for the vote, keeping its
    # gradient shard. So, with several ranks:
    # - every rank makes a chunk's gradient payload at one moment, before any gradient comes: the moment after which
    #   the trace saw its first gradient arrive on any rank (``expect_at``); in the warm-up, the backward of a module
    #   owning its trainable parameters (``expect``; not the root's, whose backward spans the whole backward, nor in
    #   a backward that builds a graph), and at each moment every rank makes those another rank made on a gradient's
    #   arrival (the root's), in the agreement on which chunks are complete. A backward that delivered no gradient
    #   gives back what nothing wrote (``drop_unwritten``); in a traced step a gradient the trace did not foresee
    #   gets its payload when it arrives, as before;
    # - the reduce, at a moment every rank agrees on, lets go of the chunk's trainable tensors still in use, as the
    #   ranks whose gradients arrived let go of theirs (``Chunk.reduced(agreed=True)``);
    # - stepping in backward under a device limit, the reduce of a chunk whose shard lives on the device carries a
    #   vote on its parameters (a few bytes all-reduced on the host beside the reduce-scatter, on NCCL over its
    #   gloo twin, so that no stream waits; read when the chunk lands): it steps as it lands on every rank or on
    #   none (and gives its gradient shard back), and a parameter another rank got a gradient for steps here too,
    #   as after the vote that follows backward. Elsewhere a chunk decides by this rank's gradients: exact either
    #   way, and nothing plans from the bytes that differ (host shards; no limit, where no plan reads the device
    #   bytes). The vote costs: a step of 27 device chunks on two CPU ranks took 10% longer with it;
    # - the last resort that releases the payloads of chunks waiting to reduce takes only those that wait on every
    #   rank (``MomentClock.release_waiting``).

    def begin_backward(self, *, traced: bool) -> None:
        """A backward starts: it follows the trace's reduce moments, or agrees at each moment."""
        self._traced = traced and self._due is not None

    def at_moment(self, key: Hashable, make_room: MakeRoom) -> None:
        """A moment of backward begins ([Note: when a chunk reduces]): reduce the chunks whose turn has come, by the
        trace (``key`` names the moment) or by every rank's gradients."""
        if not self.sync:
            return
        chunks = self.manager.chunks
        if self._traced:
            assert self._due is not None
            for cid in self._due.get(key, ()):
                if cid not in self._launched:
                    self.reduce(chunks[cid], make_room)
            return
        waiting = [cid for cid in self._order if cid not in self._launched]
        if not waiting:
            return
        comm = self.manager.comm
        # one all-reduce (max): which chunks some rank has not completed, and which have a gradient payload on some
        # rank (made where a gradient came first: every rank makes it now, [Note: gradients some ranks lack])
        flags = [int(not chunks[cid].grads_complete()) for cid in waiting]
        flags += [int(chunks[cid].grad_payload is not None) for cid in waiting]
        t = torch.tensor(flags, dtype=torch.int32, device=comm.tensor_device())
        agreed = comm.all_reduce(t, "max", what="the agreement on which chunks' gradients are complete").tolist()
        n = len(waiting)
        for cid, made in zip(waiting, agreed[n:], strict=True):
            if made:
                self.expect(chunks[cid], make_room)
        for cid, incomplete in zip(waiting, agreed[:n], strict=True):
            if not incomplete:
                self.reduce(chunks[cid], make_room)

    def reduce(self, chunk: Chunk, make_room: MakeRoom) -> None:
        """Launch the reduce-scatter of the chunk's gradient payload (scaled by 1/world_size, as DDP does,
        [Note: filling the gradient payload in one pass]) and go on with backward; the result lands in the
        shard in ``land``."""
        mgr = self.manager
        self._launched.add(chunk.chunk_id)
        if self.sync:
            self._ensure_payload(chunk, make_room)  # this rank got no gradient for the chunk: contribute zeros
            with mgr.ledger.tracked(chunk):
                self._finish_payload(chunk)
                # in place: this rank's slice of the payload is the output (NCCL and gloo both take
                # ``out == full[rank * n : (rank + 1) * n]``), so no unaccounted buffer is allocated
                lo, hi = chunk.shard_range
                assert chunk.grad_payload is not None
                pending = mgr.comm.reduce_scatter(
                    chunk.grad_payload[lo:hi],
                    chunk.grad_payload,
                    chunk=chunk.chunk_id,
                    async_op=True,
                )
            votes = None
            if self.vote and chunk.shard_tier is Tier.DEVICE and mgr.limit is not None:
                flags = torch.tensor([t.has_grad for t in chunk.tensors], dtype=torch.uint8)
                what = f"the vote on chunk {chunk.chunk_id}'s gradients"
                votes = mgr.comm.all_reduce_async(flags, "max", what=what, on_host=True)
            self._inflight.append((chunk, pending, votes))
            if len(self._inflight) > self.in_flight:
                self.land(keep=self.in_flight)
        chunk.reduced(agreed=self.sync)

    def land(self, keep: int = 0) -> None:
        """Land the oldest reduce-scatters until ``keep`` are in flight: their output goes into the gradient shard
        (a side-stream copy for a host shard on CUDA, which keeps the payload until it is done)."""
        mgr = self.manager
        while len(self._inflight) > keep:
            chunk, pending, votes = self._inflight.pop(0)
            out = pending.wait()
            assert chunk.grad is not None
            mgr.grads.restore(chunk)
            target = mgr.tiers.grad_target(chunk)  # before the flag flips: it says whether to read what is there
            add, chunk.grad_written = chunk.grad_written, True
            add = self.replicas.land(chunk, out, target, add)  # [Note: replicas summed once a step]
            if votes is not None:
                self.voted[chunk.chunk_id] = take_vote(chunk, votes.wait().tolist())
            if chunk.shard_tier is not Tier.DEVICE:
                mgr.transfers.d2h_bytes += out.numel() * out.element_size()
            with mgr.clock.measure("tier_copy"):
                self.offload.copy(
                    target, out, add=add, on_done=functools.partial(self._free_payload, chunk), key=chunk.chunk_id
                )
            if chunk.shard_tier is Tier.DISK:
                self.offload.drain()  # landed: a disk shard's buffer is final
            self.offload.drain(keep=2)  # bound the payloads still being copied
            if self.on_final is not None:  # it decides whether this backward steps (not when gradients stay local)
                self.on_final(chunk)
            mgr.tiers.grads_done(chunk)  # a disk shard's to its file, unless the chunk stepped from it just now

    def land_all(self) -> None:
        """Finish the reduce-scatters and gradient copies in flight: their gradient payloads go and their chunks
        (held in READY_FOR_REDUCE until reduced) become evictable. What a device limit needs before it evicts."""
        self.land()
        self.offload.drain()

    def _free_payload(self, chunk: Chunk) -> None:
        with self.manager.ledger.tracked(chunk):
            assert chunk.grad_payload is not None
            self.manager.pool.empty(chunk.grad_payload.untyped_storage())  # a view still held sees no bytes
            chunk.grad_payload = None

    def end_backward(self, make_room: MakeRoom) -> None:
        """Reduce what is left (chunks with tensors that got no gradient on this rank) and land everything."""
        if self.sync:
            chunks = self.manager.chunks
            for cid in self._order:
                if cid not in self._launched:
                    self.reduce(chunks[cid], make_room)
            self.land()
        self._launched.clear()
        self.offload.drain()  # the optimizer and the next step read finished gradient shards


def agree_on_grads(mgr: Any) -> None:
    """Several ranks: a parameter has a gradient if it got one on any rank (DDP's rule for unused parameters)."""
    if mgr.comm.world_size == 1:
        return
    flags = torch.tensor(
        [t.has_grad for c in mgr.chunks for t in c.tensors], dtype=torch.uint8, device=mgr.comm.tensor_device()
    )
    voted = mgr.comm.all_reduce(flags, op="max", what="the vote on which parameters got gradients").tolist()
    at = 0
    for chunk in mgr.chunks:  # the same order on every rank
        take_vote(chunk, voted[at : at + len(chunk.tensors)])
        at += len(chunk.tensors)


def take_vote(chunk: Chunk, voted: Sequence[int]) -> bool:
    """Each of the chunk's parameters has a gradient where some rank got one (``voted``, in the chunk's order);
    True when every trainable one has."""
    for t, f in zip(chunk.tensors, voted, strict=True):
        # a rank keeps the flag only where it holds a piece: elsewhere the flag served the vote alone, and
        # zero_grad() (seen through this rank's views) could never clear it before the next vote
        a, b = piece_range(chunk, t.offset, t.numel)
        t.has_grad = bool(f) and a < b
    return all(f for t, f in zip(chunk.tensors, voted, strict=True) if t.requires_grad)
