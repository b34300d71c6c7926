"""A chunk's gradients, from backward to the optimizer: taken into the shard (one rank) or the gradient payload
(several, reduced by ``GradReducer`` in ``comm/reduce.py``), made final at the end of backward, cleared as
``zero_grad`` says, and sliced per parameter for the optimizer. Every byte moves under the manager's ledger."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..chunks.chunk import Chunk, Role, TensorInfo, Tier
from ..chunks.repack import piece_range
from ..chunks.states import TensorState, check_transition
from ..comm.reduce import MakeRoom
from ..config import format_bytes
from ..errors import DeviceMemoryLimitError
from ..schedule.placement import shards_note
from ..tiers.pool import BlockPool
from .low_grads import LowGrads

if TYPE_CHECKING:  # the manager builds it
    from .manager import ChunkManager

S = TensorState
IN_FLIGHT = 4  # gradient shards a step holds at once stepping in backward, at most (``phases.py`` counts them)
_WAITING = (S.READY_FOR_REDUCE, S.READY_FOR_REDUCE_FREE)


class ChunkGrads:
    """The gradient side of the manager (``manager.grads``)."""

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        # host gradient shards given back while stepping in backward ([Note: gradient shards pinned to the byte]),
        # kept apart from the payloads' even on a CPU device: a payload never takes a pinned block, nor a gradient shard
        # a pageable one. Without storage swaps a pageable one keeps its bytes, advised free, where no host memory limit
        # bounds the resident set ([Note: gradient buffers the kernel may take] in system/host_heap.py)
        lazy = manager.config.host_memory_limit is None
        self.host_pool = BlockPool(torch.device("cpu"), per_size=IN_FLIGHT, lazy=lazy)
        self.low = LowGrads(self)  # [Note: gradients in bf16 until the step]
        # stepping in backward: a packed chunk's shard without gradients is given back at once, its host memory made
        # only for the views ([Note: gradient shards made for their views] in tiers/tier_set.py)
        self.given_back_when_packed = False

    def _pool(self, chunk: Chunk) -> BlockPool:
        return self.manager.pool if chunk.shard_tier is Tier.DEVICE else self.host_pool

    def restore(self, chunk: Chunk) -> None:
        """Memory for a gradient shard given back, before a gradient is written into it: a block its tier's pool
        kept, else new memory: a host shard's of the host tier's kind (page-locked as the host shards are), a
        device shard's from its storage's allocator."""
        mgr = self.manager
        dtype = chunk.grad.dtype if chunk.grad is not None else chunk.master_dtype

        def make() -> torch.UntypedStorage:
            return mgr.tiers.alloc(chunk, Role.GRAD, dtype).untyped_storage()

        with mgr.ledger.tracked(chunk):
            chunk.restore_grad(self._pool(chunk), make if chunk.shard_tier is Tier.HOST else None)

    def release(self, chunk: Chunk, *, to_pool: bool = True, keep_pinned: bool = False) -> None:
        """Give a gradient shard back: to its tier's pool (in backward) or to the allocator (``to_pool=False``); with
        ``keep_pinned`` a host one pinned to the byte keeps its bytes instead.

        [Note: gradient shards pinned to the byte]
        On a GPU the host shards are page-locked. torch's pinned blocks resize, but one page-locked to the byte
        (``pin_memory="exact"``, [Note: exact pinned memory]) does not, so a host gradient shard stepped in backward
        kept its bytes: 4 bytes a parameter of every host shard for the whole run, which for Llama shapes on one 80 GB
        GPU with 128 GiB of host memory capped the largest model ``plan`` fits at 44 layers (9.2B), where given back it
        fits 53 (11.0B). Now, given back in backward, its memory moves out of the storage into a host pool of its own
        (never the payloads' on a CPU device, so a payload never takes a pinned block, nor a gradient shard a pageable
        one) and back in at the chunk's next gradient, or into the next chunk's. The pool keeps at most ``IN_FLIGHT``
        blocks of a size, what a step holds at once (those landing and those waiting for the step thread); one beyond
        (where more were alive at once: an engine whose optimizer steps by its own ``step()`` keeps every shard from the
        warm-up on) goes to its allocator, for an exact one unregistered and unmapped. So nothing is registered in a
        steady step. Given back after backward it goes to its allocator: the warm-up steps after backward, and kept
        there its bytes stood beside the optimizer state the step makes, which ``phases.py`` does not count (torch's
        pinned blocks go to its cache, which the engine empties after that first step). But where a fit speculates
        ([Note: speculating past the norm and the overflow]: every shard is held until ``optimizer.step()`` anyway, and
        a clipped guess steps again after backward) an exact one keeps its bytes (``keep_pinned``): registering it again
        at every backward would cost more. Moving memory between storages needs torch 2.12 ([Note: torch versions] in
        ``system/torch_features.py``): before, an exact one keeps its bytes, and ``plan`` counts them, and a pageable
        one keeps its bytes with its pages advised free ([Note: gradient buffers the kernel may take] in
        ``system/host_heap.py``), else goes to its allocator."""
        mgr = self.manager
        self.low.release(chunk)
        storage = chunk.grad.untyped_storage() if chunk.grad is not None else None
        with mgr.ledger.tracked(chunk):
            if to_pool:
                chunk.release_grad(self._pool(chunk))
            elif keep_pinned and storage is not None and not storage.resizable() and chunk.shard_tier is Tier.HOST:
                chunk.grad_released = True  # kept bytes: ``restore`` finds them there
            else:
                chunk.release_grad(None)

    def room_for(self, chunk: Chunk, what: str, make_room: MakeRoom = None) -> None:
        """Room on the device tier for ``chunk``'s gradient payload: land the reduce-scatters and copies in flight
        (their buffers go), then have ``make_room`` evict by the policy; raise when it still does not fit."""
        mgr = self.manager
        nbytes = chunk.grad_payload_bytes
        if not mgr.ledger.fits(nbytes):
            mgr.reducer.land_all()
            if not mgr.ledger.fits(nbytes) and make_room is not None:
                make_room(nbytes)
        try:
            mgr.ledger.reserve(nbytes, what)
        except DeviceMemoryLimitError as e:
            if make_room is None:
                raise
            need = mgr.ledger[Tier.DEVICE] + nbytes
            shards = sum(mgr.device_shard_bytes(c) for c in mgr.chunks if c.shard_tier is Tier.DEVICE)
            on_device, remedy = shards_note(mgr.config.placement, shards, (c.shard_tier for c in mgr.chunks))
            raise DeviceMemoryLimitError(
                f"{e} Nothing else could be evicted: the chunks in use, the gradients waiting to reduce"
                + (f", {on_device}" if on_device else "")
                + f" and this payload need {format_bytes(need)} at this moment, beside its activations; raise "
                "device_memory_limit above that (the warm-up then measures the activations)"
                + (", or lower chunk_numel" if mgr.config.chunk_numel is not None else "")
                + (f", {remedy}" if remedy else "")
                + "."
                + self._untraced_bound(chunk, need),
                mgr.device,
            ) from None

    def _untraced_bound(self, chunk: Chunk, need: int) -> str:
        """Several ranks, in a backward without a trace: how much the payloads still to come may add.

        [Note: gradient payloads before the trace]
        With several ranks a chunk's gradient payload stays until every rank has all of that chunk's gradients
        ([Note: when a chunk reduces] in comm/reduce.py). Before the trace orders the chunks by first use, the
        warm-up's chunks follow registration: a chunk may span layers, the biases and norms of a group share one,
        a tied embedding completes only at the end. So the warm-up's backward may hold most payloads at once, and
        a refusal there named one chunk more each time: transformers' CTRL on two ranks was refused at 3.7, 4.6,
        6.0 and 7.0 MB, each asking 1 MiB more, and trained at 7.5 (on one rank, whose gradients go to the shard
        as they come, the warm-up named 5.4 MB at once, which trained). The refusal now also names the limit with
        room for every payload still to come beside what is held: that one passes the warm-up, whose check then
        names the smallest limit that works where it is not enough."""
        mgr = self.manager
        if mgr.comm.world_size == 1 or mgr.reducer.traced:
            return ""
        rest = [c for c in mgr.reducer.payloads_to_come() if c is not chunk]
        more = sum(c.grad_payload_bytes for c in rest)
        return (
            f" This backward follows no trace yet (the warm-up's, or one traced again), so each chunk's gradient "
            f"payload stays until every rank has all that chunk's gradients: with the payloads of {len(rest)} more "
            f"chunk(s) still to come, a limit of {format_bytes(need + more)} has room for them all at once."
        )

    def set_reduce_order(self, completion: Sequence[int]) -> None:
        """Several ranks: reduce chunks in the order backward completes them ([Note: reduce order] in reduce.py)."""
        mgr = self.manager
        mgr.reducer.set_order(mgr.chunks, completion)

    def follow_trace(self, trace: Any) -> None:
        """Several ranks: reduce each chunk at the moment after the trace's gradients say it is complete, or in the
        order of its last use where the trace recorded no gradients ([Note: when a chunk reduces] in reduce.py)."""
        mgr = self.manager
        index_of = mgr.index_of
        params = {c.chunk_id: [index_of[id(t.param)] for t in c.tensors if t.requires_grad] for c in mgr.chunks}
        due = trace.reduce_moments(params)
        if due:
            mgr.reducer.set_moments(mgr.chunks, due, trace.payload_moments(params))
        else:
            mgr.reducer.set_order(mgr.chunks, trace.backward_completion_order())

    def to_move(self, c: Chunk) -> bool:
        """The chunk's gradient shard holds gradients of this step that a repack must carry."""
        mgr = self.manager
        written = c.grad_written if mgr.comm.world_size > 1 else any(t.has_grad for t in c.tensors)
        return c.grad is not None and written and not c.grad_released

    @property
    def sync(self) -> bool:
        return self.manager.reducer.sync

    @sync.setter
    def sync(self, value: bool) -> None:
        self.manager.reducer.sync = value

    def accumulate(self, param: torch.Tensor, grad: torch.Tensor, make_room: MakeRoom = None) -> Chunk:
        """Take one parameter's gradient: into the shard (one rank) or the chunk's gradient payload (several).
        ``make_room``: evicts by the placement policy when a gradient payload needs device bytes."""
        mgr = self.manager
        chunk, info = mgr.lookup(param)
        assert chunk.grad is not None, f"chunk {chunk.chunk_id} holds no trainable parameters"
        if mgr.comm.world_size > 1:
            mgr.reducer.refuse_late(chunk)  # the clearer error, before the state's
        piece = info.state in _WAITING and info.grads_due > 1  # a later piece ([Note: gradients in pieces])
        if not piece:
            check_transition(
                info.state, S.READY_FOR_REDUCE, param_name=info.name, chunk_id=chunk.chunk_id, rank=chunk.rank
            )  # before touching data: a refused gradient leaves nothing half-added
        if mgr.comm.world_size == 1:
            # the first gradient of a step overwrites what the last step left; later ones (accumulation) add.
            # Into a host shard on CUDA the copy runs on a side stream ([Note: gradient offload] in offload.py)
            # a disk shard's gradients gather in a host buffer, written to its file at ``reduce``
            low = self.low.target(chunk, info)  # [Note: gradients in bf16 until the step]
            if low is None and chunk.grad_released:
                self.restore(chunk)
            target = mgr.tiers.grad_target(chunk) if low is None else low
            mgr.reducer.offload.copy(
                target[info.offset : info.offset + info.numel],
                grad,
                add=low is None and info.has_grad,
                key=chunk.chunk_id,
            )
            if chunk.shard_tier is not Tier.DEVICE:
                mgr.transfers.d2h_bytes += grad.numel() * grad.element_size()
        else:
            mgr.reducer.add(chunk, info.offset, grad, make_room)
        info.has_grad = True
        if not piece:
            chunk.set_state(info, S.READY_FOR_REDUCE)
        if chunk.grads_complete() and mgr.comm.world_size == 1:
            self.reduce(chunk)  # several ranks reduce at moments ([Note: when a chunk reduces] in reduce.py)
        mgr.changed()
        return chunk

    def expect(self, indices: Iterable[int], make_room: MakeRoom = None) -> None:
        """Several ranks: the module owning parameters ``indices`` begins its backward; their chunks' gradient
        payloads are made now on every rank ([Note: gradients some ranks lack] in reduce.py)."""
        mgr = self.manager
        if mgr.comm.world_size == 1:
            return
        params = [mgr.params[i] for i in indices]
        for cid in dict.fromkeys(mgr.lookup(p)[0].chunk_id for p in params if p.requires_grad):
            mgr.reducer.expect(mgr.chunks[cid], make_room)

    def reduce(self, chunk: Chunk, make_room: MakeRoom = None) -> None:
        """The chunk's gradients are final for this backward: READY_FOR_REDUCE -> HOLD_AFTER_BWD. With one rank the
        shard already holds them; several ranks launch the reduce-scatter ([Note: reduce order] in reduce.py)."""
        mgr = self.manager
        if mgr.comm.world_size > 1:
            mgr.reducer.reduce(chunk, make_room)
        else:
            if chunk.shard_tier is Tier.DISK:
                mgr.reducer.offload.drain()  # the copies land before the buffer is used or written to the file
            chunk.reduced()
            if mgr.reducer.on_final is not None:  # before the write: a chunk stepped now needs no gradient file
                mgr.reducer.on_final(chunk)
            if chunk.shard_tier is Tier.DISK:
                mgr.tiers.grads_done(chunk)

    def land_in_flight(self) -> None:
        """Land the reduce-scatters and gradient copies in flight (what a device limit needs before it evicts)."""
        self.manager.reducer.land_all()

    @property
    def payload_peak(self) -> int:
        return self.manager.reducer.payload_peak

    def end_backward(self, make_room: MakeRoom = None, *, grads_arrived: bool = True) -> None:
        """Reduce what is left (tensors that got no gradient); everything used becomes HOLD_AFTER_BWD. A backward
        that delivered no gradient reduces nothing ([Note: a backward that delivers no gradient] in hooks.py)."""
        mgr = self.manager
        if grads_arrived and mgr.comm.world_size > 1:
            mgr.reducer.end_backward(make_room)
        elif mgr.comm.world_size > 1:
            mgr.reducer.drop_unwritten()
        elif grads_arrived:
            mgr.reducer.offload.drain()  # the optimizer and the next step read finished gradient shards
        for c in mgr.chunks:
            if grads_arrived:
                mgr.tiers.grads_done(c)
                if c.has_waiting_grads():
                    if mgr.comm.world_size == 1:
                        self.reduce(c)
                    else:  # inside no_sync(): the gradients stay in the gradient payload for the next micro-batch
                        c.reduced()
            c.transition_all(S.HOLD_AFTER_BWD, only_from=frozenset({S.COMPUTE, S.HOLD_AFTER_FWD}))
        if mgr.ledger[Tier.DISK]:  # [Note: gradient write-backs off the step] in disk_grads.py
            mgr.tiers.settle_grads()
        mgr.changed()

    def clear(self, indices: Iterable[int] | None = None) -> None:
        """Forget the gradients of the parameters ``indices`` (all when ``None``): the next gradient a
        parameter gets overwrites its range instead of adding to it. The buffers stay allocated."""
        mgr = self.manager
        if indices is None:
            for c in mgr.chunks:
                c.grad_written = False
                for t in c.tensors:
                    t.has_grad = False
            return
        cleared: dict[int, list[TensorInfo]] = {}
        for i in indices:
            chunk, info = mgr.lookup(mgr.params[i])
            info.has_grad = False
            cleared.setdefault(chunk.chunk_id, []).append(info)
        for cid, infos in cleared.items():
            chunk = mgr.chunks[cid]
            if not any(t.has_grad for t in chunk.tensors):
                chunk.grad_written = False
            elif (
                chunk.grad_written and chunk.grad is not None and not chunk.grad_released
            ):  # several ranks, some kept: the rest restart at 0
                lo, _ = chunk.shard_range
                with mgr.tiers.writing(chunk, (Role.GRAD,)):
                    for t in infos:
                        a, b = piece_range(chunk, t.offset, t.numel)
                        if a < b:
                            chunk.grad[a - lo : b - lo].zero_()

    def slice(self, param_index: int) -> torch.Tensor | None:
        """This rank's piece of one parameter's gradient shard, flat, whether or not it holds a gradient now."""
        mgr = self.manager
        chunk, info = mgr.lookup(mgr.params[param_index])
        if chunk.grad is None:
            return None
        lo, _ = chunk.shard_range
        a, b = piece_range(chunk, info.offset, info.numel)
        return chunk.grad[a - lo : b - lo] if a < b else None

    def view(self, param_index: int) -> torch.Tensor | None:
        """``slice`` when the parameter got a gradient since it was last cleared, else ``None``."""
        mgr = self.manager
        return self.slice(param_index) if mgr.lookup(mgr.params[param_index])[1].has_grad else None
