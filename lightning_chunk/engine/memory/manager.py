"""The chunk manager: the mechanism that moves bytes, and the one owner of their accounting.

It packs parameters into chunks (``pack``), gathers and releases payloads,
accumulates gradients into shards, exposes the master shards to the optimizer,
and keeps, per tier, a ledger of chunk bytes. Every operation that changes a
chunk's buffers runs inside ``_tracked(chunk)``, which moves the ledger by what
the chunk's buffers say changed; ``check_accounting`` re-derives the sum from
the chunks (tests call it after every operation). Device-tier allocations are
reserved against ``device_memory_limit`` *before* they happen, so chunk memory
never exceeds it.

Policy lives elsewhere (``placement.py``): the manager executes plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..chunks.chunk import Chunk, InFlight, Role, TensorInfo, Tier, free_storage
from ..chunks.packing import ChunkKey, Layout, ParamSpec
from ..chunks.repack import ExtraShards, FromModule, OldChunks, build_chunk, piece_range
from ..chunks.states import TensorState, check_transition
from ..comm.collectives import Collectives
from ..comm.reduce import GradReducer, MakeRoom
from ..config import ChunkConfig, DtypePolicy, format_bytes
from ..errors import DeviceMemoryLimitError
from ..schedule.costs import chunk_views, shard_cost
from ..schedule.placement import ChunkView
from ..system.timing import StepClock
from ..tiers.pool import BlockPool
from ..tiers.tier_set import TierSet

S = TensorState
_HOST = torch.device("cpu")


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    evictions: int = 0
    gathers: int = 0
    waiting_releases: int = 0  # payloads released while their gradients waited to reduce (the last resort)


class ChunkManager:
    def __init__(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        group_of: Mapping[int, int],
        *,
        config: ChunkConfig,
        dtypes: DtypePolicy,
        device: torch.device,
        collectives: Collectives | None = None,
        own_dtype: Collection[int] = (),
    ) -> None:
        """``own_dtype``: indices of the parameters whose payloads keep their dtype ([Note: normalisation in mixed
        precision] in ``config.py``)."""
        self.config = config
        self.dtypes = dtypes
        self.device = torch.device(device)
        self.comm = collectives or Collectives.local()
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        for name, p in named_params:
            if not p.is_floating_point():
                raise TypeError(
                    f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be chunked."
                )
        self.specs = [
            ParamSpec(
                index=i,
                name=n,
                numel=p.numel(),
                key=ChunkKey(group_of.get(i, -1), p.requires_grad, p.dtype, i in own_dtype),
            )
            for i, (n, p) in enumerate(named_params)
        ]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.limit = config.device_memory_limit
        self._all_aliased = False
        self.chunks: list[Chunk] = []
        self.layout: Layout | None = None
        self._where: dict[int, tuple[Chunk, TensorInfo]] = {}
        self.ledger = {t: 0 for t in Tier}
        self.device_peak = 0
        self.transfers = TransferStats()
        self.clock = StepClock()  # [Note: where a step's time goes]; the collectives charge their waits to it
        self.comm.clock = self.clock
        self._retiring: list[Chunk] = []  # old chunks still holding bytes during a streaming repack
        pin = config.pin_memory and self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.tiers = TierSet(
            self.device,
            pinned=pin,
            disk_dir=config.disk_dir,
            rank=self.comm.rank,
            disk_io=config.disk_io,
            ranks_here=self.comm.ranks_on_this_host(),
            host_limit=config.host_memory_limit,
        )
        self.pool = BlockPool(self.device)  # [Note: a pool of payload blocks]
        self.reducer = GradReducer(self, pinned=pin)  # several ranks: when each chunk's gradients reduce
        self.optim_state_made = False  # an optimizer stepped: its state exists
        # ([Note: optimizer state the warm-up does not see])
        self.on_change: Callable[[], None] | None = None  # test hook: called after every operation

    # ================================================================ accounting
    def tier_device(self, tier: Tier) -> torch.device:
        return self.device if tier is Tier.DEVICE else _HOST

    @property
    def disk_chunks(self) -> bool:
        return self.ledger[Tier.DISK] > 0

    @contextlib.contextmanager
    def tracked(self, chunk: Chunk) -> Iterator[None]:
        before = {t: chunk.bytes_on(t) for t in Tier}
        try:
            yield
        finally:
            for t in Tier:
                self.ledger[t] += chunk.bytes_on(t) - before[t]
            self.device_peak = max(self.device_peak, self.ledger[Tier.DEVICE])

    def reserve_device(self, nbytes: int, what: str) -> None:
        if self.limit is not None and self.ledger[Tier.DEVICE] + nbytes > self.limit:
            raise DeviceMemoryLimitError(
                f"[rank {self.comm.rank}] {what} needs {nbytes} more bytes on the device tier, which already holds "
                f"{format_bytes(self.ledger[Tier.DEVICE])} of chunk memory; "
                f"device_memory_limit={format_bytes(self.limit)} would be exceeded."
            )

    def room_for(self, nbytes: int, what: str, make_room: MakeRoom = None) -> None:
        """Room on the device tier for ``nbytes`` more (a gradient payload): land the reduce-scatters and copies in
        flight (their buffers go), then have ``make_room`` evict by the policy; raise when it still does not fit."""
        if self.limit is not None and self.ledger[Tier.DEVICE] + nbytes > self.limit:
            self.reducer.land_all()
            if self.ledger[Tier.DEVICE] + nbytes > self.limit and make_room is not None:
                make_room(nbytes)
        self.reserve_device(nbytes, what)

    def check_accounting(self) -> None:
        for t in Tier:
            derived = sum(c.bytes_on(t) for c in [*self.chunks, *self._retiring])
            if derived != self.ledger[t]:
                raise AssertionError(f"{t.value} ledger says {self.ledger[t]} bytes, chunks hold {derived}")
        if self.limit is not None and self.ledger[Tier.DEVICE] > self.limit:
            raise AssertionError(f"device chunk bytes {self.ledger[Tier.DEVICE]} exceed the limit {self.limit}")

    def _changed(self) -> None:
        if self.config.check_invariants:
            self.check_accounting()
        if self.on_change is not None:
            self.on_change()

    # ==================================================================== lookup
    def lookup(self, param: torch.Tensor) -> tuple[Chunk, TensorInfo]:
        return self._where[id(param)]

    @property
    def all_aliased(self) -> bool:
        """Every payload is its shard (one rank, all shards on the device): nothing ever moves."""
        return self._all_aliased

    def chunk_ids_of(self, params: Sequence[torch.Tensor]) -> tuple[int, ...]:
        return tuple(sorted({self._where[id(p)][0].chunk_id for p in params if id(p) in self._where}))

    def views(self, include: Iterable[int] | None = None, *, resident: bool = True) -> list[ChunkView]:
        return chunk_views(self.chunks, include, resident=resident)

    def device_shard_bytes(self, c: Chunk) -> int:
        """Bytes the chunk's shard holds when it lives on the device tier (payload too, when that aliases it)."""
        return shard_cost(
            c.capacity_numel, self.comm.world_size, c.compute_dtype, c.master_dtype, c.trainable, c.optim_state_bytes
        )

    # ==================================================================== packing
    def pack(
        self,
        layout: Layout,
        tiers: Mapping[int, Tier],
        *,
        extras: ExtraShards | None = None,
        source: FromModule | None = None,
        optim_bytes: Mapping[int, int] | None = None,
    ) -> None:
        """Build chunks for ``layout`` with shards on ``tiers``; parameters become views into payloads.

        Values come from the current chunks when there are some (a repack after the warm-up), else
        from ``source`` (the parameters themselves by default; a weights file; deferred init). Gradients so
        far, the "got a gradient" flags and ``extras`` (the optimizers' per-element state) move along
        ([Note: optimizer state through a repack] in ``repack.py``).
        """
        first = not self.chunks  # values come from the module itself
        self.pool.clear()  # the old layout's block sizes
        values: Any
        if first:
            values = source or FromModule(self.params)
        else:
            on_device = any(c.shard_tier is Tier.DEVICE for c in self.chunks) or Tier.DEVICE in tiers.values()
            eager = self.limit is not None and on_device  # old and new device shards must not overlap
            values = OldChunks(self, self.chunks, extras=extras, eager=eager)
            self._retiring, self.chunks, self._where = self.chunks, [], {}
        self.layout = layout
        for spec in values.build_order(layout):
            chunk = build_chunk(
                self, spec, tiers.get(spec.chunk_id, Tier.HOST), values, broadcast=first and self.comm.world_size > 1
            )
            self.chunks.append(chunk)
            if optim_bytes is not None:  # before the state is carried in: a disk shard takes it into its file
                self._reserve_state(chunk, optim_bytes)
            values.placed(chunk)
            self.tiers.page_out(chunk)  # what the build and the carried state wrote leaves the process
            self._changed()
        self.chunks.sort(key=lambda c: c.chunk_id)
        assert values.done()
        self._retiring = []
        self._all_aliased = bool(self.chunks) and all(c.aliased for c in self.chunks)
        self.reducer.reset_order(self.chunks)

    def set_reduce_order(self, completion: Sequence[int]) -> None:
        """Several ranks: reduce chunks in the order backward completes them ([Note: reduce order] in reduce.py)."""
        self.reducer.set_order(self.chunks, completion)

    def follow_trace(self, trace: Any) -> None:
        """Several ranks: reduce each chunk at the moment after the trace's gradients say it is complete, or in the
        order of its last use where the trace recorded no gradients ([Note: when a chunk reduces] in reduce.py)."""
        index_of = self.index_of
        due = trace.reduce_moments(
            {c.chunk_id: [index_of[id(t.param)] for t in c.tensors if t.requires_grad] for c in self.chunks}
        )
        if due:
            self.reducer.set_moments(self.chunks, due)
        else:
            self.reducer.set_order(self.chunks, trace.backward_completion_order())

    def grads_to_move(self, c: Chunk) -> bool:
        """The chunk's gradient shard holds gradients of this step that a repack must carry."""
        written = c.grad_written if self.comm.world_size > 1 else any(t.has_grad for t in c.tensors)
        return c.grad is not None and written and not c.grad_released

    def gather_shard(self, c: Chunk, shard: torch.Tensor) -> torch.Tensor:
        """The whole chunk's worth of a per-rank shard buffer, on the host (used off the hot path)."""
        if self.comm.world_size == 1:
            with self.tiers.reading(c):
                return shard.to(_HOST, copy=True)
        with self.tiers.reading(c):
            src = shard.to(self.comm.tensor_device(), copy=True)
        out = torch.empty(c.capacity_numel, dtype=shard.dtype, device=src.device)
        self.comm.all_gather(out, src, chunk=c.chunk_id).wait()
        self.comm.verify_issued()  # it leaves the engine ([Note: checking once a micro-batch])
        return out.to(_HOST)

    def place_param(self, p: torch.Tensor, chunk: Chunk, info: TensorInfo) -> None:
        """``p`` is now a view into ``chunk``'s payload, described by ``info``."""
        self._where[id(p)] = (chunk, info)

    def alloc_shard(self, chunk: Chunk, role: Role, dtype: torch.dtype) -> torch.Tensor:
        """Allocate one of the chunk's shard buffers on its tier. Device bytes must have been reserved by the caller."""
        return self.tiers.alloc(chunk, role, dtype)

    def drop(self, c: Chunk) -> None:
        """Free every buffer of ``c`` (a chunk of a layout being replaced, or all of them at the end). After a
        failed collective only the chunk's references go: collectives queued behind it may still use the buffers
        ([Note: memory a failed collective may still use] in ``collectives.py``)."""
        self.tiers.free(c)
        with self.tracked(c):
            if not self.comm.broken:
                for t in (t for t in (c.master, c.low, c.grad) if t is not None):  # optimizers still view them
                    free_storage(t)
                if c.payload is not None:
                    c.payload.untyped_storage().resize_(0)
            c.master = c.low = c.grad = None
            c.optim_state_bytes = 0

    def _drop_all(self) -> None:
        for c in self.chunks:
            self.drop(c)
        self.chunks = []
        self._where = {}

    # ============================================================ gather/release
    def gather(self, chunk: Chunk, *, prefetch: bool = False, module: int = -1) -> None:
        """Make the payload resident (FREE -> HOLD): host-to-device copy, or all-gather of the shards.

        [Note: streams and prefetch]
        On CUDA a prefetch copies on a side stream and records an event in ``chunk.pending``;
        the compute stream waits on that event before the chunk is first used (``wait_ready``) and
        before its payload is released, so the caching allocator never hands the block out while a
        copy into it is in flight. The payload is allocated on the compute stream, and the side
        stream first waits for the compute stream, so the copy never overtakes earlier frees.
        Demand gathers run on the compute stream: the module needs the data at once anyway.
        With several ranks a prefetch is an asynchronous all-gather whose ``Pending`` (buffer and
        work handle together) is kept in ``chunk.pending`` until first use; gloo runs it on its
        own thread, so it overlaps with compute on CPU too.
        On CPU one-rank copies are synchronous and events are not used. A disk shard is read
        (paged in) here, on the calling thread, and paged out once the copy has read it.
        """
        if chunk.is_resident:
            return
        assert chunk.payload is not None
        side = self._copy_stream if prefetch and self.comm.world_size == 1 else None
        from_file = chunk.shard_tier is Tier.DISK and chunk.low is None  # an fp32 disk shard: read the master's file
        with (
            self.tracked(chunk),
            self.tiers.reading(chunk, (Role.MASTER,) if from_file and self.device.type != "cpu" else ()),
        ):
            self.reserve_device(chunk.payload_bytes, f"gathering chunk {chunk.chunk_id}")
            self.pool.fill(chunk.payload.untyped_storage(), chunk.payload_bytes)
            src = chunk.low_tensor()
            if chunk.shard_tier is not Tier.DEVICE:
                self.transfers.h2d_bytes += src.numel() * src.element_size()
                if (
                    self.comm.world_size > 1 and src.device != self.comm.tensor_device()
                ) or chunk.shard_tier is Tier.DISK:
                    # collectives need device tensors: stage the host shard in this rank's slice of the
                    # payload and all-gather in place (as FSDP2 does), so no unaccounted buffer is made.
                    # A disk shard is staged too: on a CPU device its file is read straight into the slice
                    # ([Note: staged optimizer steps] in disk_staging.py); else its pages go out when this block ends
                    lo, hi = chunk.shard_range
                    staged = chunk.payload[lo:hi]
                    with self.clock.measure("tier_copy"):
                        if not (from_file and self.device.type == "cpu" and self.tiers.read_master_into(chunk, staged)):
                            staged.copy_(src, non_blocking=chunk.shard_tier is not Tier.DISK)
                    src = staged
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self.comm.all_gather(chunk.payload, src)
                    event = torch.cuda.Event()
                    event.record(side)
                chunk.pending = InFlight(event=event)
            else:
                pending = self.comm.all_gather(
                    chunk.payload, src, chunk=chunk.chunk_id, module=module, async_op=prefetch
                )
                if prefetch and pending.work is not None:
                    chunk.pending = InFlight(work=pending, source=src)  # the source must live until the gather lands
        self.transfers.gathers += 1
        chunk.gathered()
        self._changed()

    def wait_ready(self, chunk: Chunk) -> None:
        """Wait for a prefetch into ``chunk``: its all-gather, or (CUDA) make the compute stream wait for its copy."""
        pending, chunk.pending = chunk.pending, None
        if pending is not None:
            pending.wait(self.device)

    def release(self, chunk: Chunk, *, eviction: bool = True, waiting_grads: bool = False) -> None:
        """Free the payload (-> FREE); nothing is copied back. ``waiting_grads``: a chunk whose gradients wait to
        reduce may go too ([Note: a gradient waits without its payload] in ``states.py``)."""
        if not chunk.is_resident or chunk.aliased:
            return
        waiting = not chunk.is_evictable
        if waiting and not (waiting_grads and chunk.waits_only_to_reduce):
            raise AssertionError(f"chunk {chunk.chunk_id} is in use and cannot be released: {chunk.states()}")
        self.transfers.waiting_releases += waiting
        self.wait_ready(chunk)
        with self.tracked(chunk):
            assert chunk.payload is not None
            self.pool.empty(chunk.payload.untyped_storage())
        chunk.released()
        if eviction:
            self.transfers.evictions += 1
        self._changed()

    # ================================================================ gradients
    @property
    def sync_grads(self) -> bool:
        return self.reducer.sync

    @sync_grads.setter
    def sync_grads(self, value: bool) -> None:
        self.reducer.sync = value

    def accumulate_grad(self, param: torch.Tensor, grad: torch.Tensor, make_room: MakeRoom = None) -> Chunk:
        """Take one parameter's gradient: into the shard (one rank) or the chunk's gradient payload (several).
        ``make_room``: evicts by the placement policy when a gradient payload needs device bytes."""
        chunk, info = self.lookup(param)
        assert chunk.grad is not None, f"chunk {chunk.chunk_id} holds no trainable parameters"
        check_transition(
            info.state, S.READY_FOR_REDUCE, param_name=info.name, chunk_id=chunk.chunk_id, rank=chunk.rank
        )  # before touching data: a refused gradient leaves nothing half-added
        if self.comm.world_size == 1:
            # the first gradient of a step overwrites what the last step left; later ones (accumulation) add.
            # Into a host shard on CUDA the copy runs on a side stream ([Note: gradient offload] in offload.py)
            # a disk shard's gradients gather in a host buffer, written to its file at ``reduce``
            if chunk.grad_released:
                with self.tracked(chunk):
                    chunk.restore_grad(self.pool)
            target = self.tiers.grad_target(chunk)
            self.reducer.offload.copy(target[info.offset : info.offset + info.numel], grad, add=info.has_grad)
            if chunk.shard_tier is not Tier.DEVICE:
                self.transfers.d2h_bytes += grad.numel() * grad.element_size()
        else:
            self.reducer.add(chunk, info.offset, grad, make_room)
        info.has_grad = True
        chunk.set_state(info, S.READY_FOR_REDUCE)
        if chunk.grads_complete() and self.comm.world_size == 1:
            self.reduce(chunk)  # several ranks reduce at moments ([Note: when a chunk reduces] in reduce.py)
        self._changed()
        return chunk

    def reduce(self, chunk: Chunk, make_room: MakeRoom = None) -> None:
        """The chunk's gradients are final for this backward: READY_FOR_REDUCE -> HOLD_AFTER_BWD. With one rank the
        shard already holds them; several ranks launch the reduce-scatter ([Note: reduce order] in reduce.py)."""
        if self.comm.world_size > 1:
            self.reducer.reduce(chunk, make_room)
        else:
            if chunk.shard_tier is Tier.DISK:
                self.reducer.offload.drain()  # the copies land before the buffer is used or written to the file
            chunk.reduced()
            if self.reducer.on_final is not None:  # before the write: a chunk stepped now needs no gradient file
                self.reducer.on_final(chunk)
            if chunk.shard_tier is Tier.DISK:
                self.tiers.grads_done(chunk)

    def land_in_flight(self) -> None:
        """Land the reduce-scatters and gradient copies in flight (what a device limit needs before it evicts)."""
        self.reducer.land_all()

    @property
    def grad_payload_peak(self) -> int:
        return self.reducer.payload_peak

    def end_backward(self, make_room: MakeRoom = None, *, grads_arrived: bool = True) -> None:
        """Reduce what is left (tensors that got no gradient); everything used becomes HOLD_AFTER_BWD. A backward
        that delivered no gradient reduces nothing ([Note: a backward that delivers no gradient] in hooks.py)."""
        if grads_arrived and self.comm.world_size > 1:
            self.reducer.end_backward(make_room)
        elif grads_arrived:
            self.reducer.offload.drain()  # the optimizer and the next step read finished gradient shards
        for c in self.chunks:
            if grads_arrived:
                self.tiers.grads_done(c)
                if c.has_waiting_grads():
                    if self.comm.world_size == 1:
                        self.reduce(c)
                    else:  # inside no_sync(): the gradients stay in the gradient payload for the next micro-batch
                        c.reduced()
            c.transition_all(S.HOLD_AFTER_BWD, only_from=frozenset({S.COMPUTE, S.HOLD_AFTER_FWD}))
        if self.disk_chunks:  # [Note: gradient write-backs off the step] in disk_grads.py
            self.tiers.settle_grads()
        self._changed()

    def let_go(self, indices: Iterable[int], new: TensorState) -> None:
        """The parameters ``indices`` still in use (COMPUTE) go to ``new``."""
        for i in indices:
            chunk, info = self.lookup(self.params[i])
            if info.state is S.COMPUTE:
                chunk.set_state(info, new)

    def reset_states(self) -> None:
        """Between micro-batches every resident tensor is plainly HOLD."""
        for c in self.chunks:
            c.transition_all(S.HOLD, only_from=frozenset({S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD}))

    def clear_grads(self, indices: Iterable[int] | None = None) -> None:
        """Forget the gradients of the parameters ``indices`` (all when ``None``): the next gradient a
        parameter gets overwrites its range instead of adding to it. The buffers stay allocated."""
        if indices is None:
            for c in self.chunks:
                c.grad_written = False
                for t in c.tensors:
                    t.has_grad = False
            return
        cleared: dict[int, list[TensorInfo]] = {}
        for i in indices:
            chunk, info = self._where[id(self.params[i])]
            info.has_grad = False
            cleared.setdefault(chunk.chunk_id, []).append(info)
        for cid, infos in cleared.items():
            chunk = self.chunks[cid]
            if not any(t.has_grad for t in chunk.tensors):
                chunk.grad_written = False
            elif (
                chunk.grad_written and chunk.grad is not None and not chunk.grad_released
            ):  # several ranks, some kept: the rest restart at 0
                lo, _ = chunk.shard_range
                with self.tiers.writing(chunk, (Role.GRAD,)):
                    for t in infos:
                        a, b = piece_range(chunk, t.offset, t.numel)
                        if a < b:
                            chunk.grad[a - lo : b - lo].zero_()

    # ================================================================ optimizer
    def master_view(self, param_index: int) -> torch.Tensor | None:
        """This rank's piece of one parameter's master, flat; ``None`` when another rank owns all of it."""
        chunk, info = self._where[id(self.params[param_index])]
        lo, _ = chunk.shard_range
        a, b = piece_range(chunk, info.offset, info.numel)
        return chunk.master_tensor_for_read()[a - lo : b - lo] if a < b else None

    def grad_slice(self, param_index: int) -> torch.Tensor | None:
        """This rank's piece of one parameter's gradient shard, flat, whether or not it holds a gradient now."""
        chunk, info = self._where[id(self.params[param_index])]
        if chunk.grad is None:
            return None
        lo, _ = chunk.shard_range
        a, b = piece_range(chunk, info.offset, info.numel)
        return chunk.grad[a - lo : b - lo] if a < b else None

    def grad_view(self, param_index: int) -> torch.Tensor | None:
        """``grad_slice`` when the parameter got a gradient since it was last cleared, else ``None``."""
        return self.grad_slice(param_index) if self._where[id(self.params[param_index])][1].has_grad else None

    def allocated_device_bytes(self) -> int:
        """The device tier's chunk bytes that exist now: the ledger less the optimizer state it reserves for device
        shards before the optimizer has made it (Adam makes its state at its first step, after the warm-up).

        [Note: optimizer state the warm-up does not see]
        The warm-up traces non-model memory on CUDA as allocated bytes less the chunk bytes, read from the ledger.
        The ledger reserves each device shard's optimizer state at set-up, so with shards on the device
        (``placement="device"``, ``"static"``) every traced activation came out low by that state (8 bytes an
        element for Adam: about 7 GB a rank for 7B on 8 ranks), down to the saved-tensor floor, which misses the
        transient peaks, and the plan kept that much more payload than fits. Until the first optimizer step the
        tracer subtracts only what is allocated."""
        ledger = self.ledger[Tier.DEVICE]
        if not self.optim_state_made:
            ledger -= sum(c.optim_state_bytes for c in self.chunks if c.shard_tier is Tier.DEVICE)
        return ledger

    def reserve_optimizer_state(self, bytes_per_element: Mapping[int, int]) -> None:
        """Account the optimizer state each trainable chunk's shard will hold (group index -> bytes per element)."""
        for c in self.chunks:
            self._reserve_state(c, bytes_per_element)
        self._changed()

    def _reserve_state(self, c: Chunk, bytes_per_element: Mapping[int, int]) -> None:
        want = c.shard_numel * bytes_per_element.get(c.spec.key.group, 0) if c.trainable else 0
        if want != c.optim_state_bytes:
            if c.shard_tier is Tier.DEVICE:
                self.reserve_device(want - c.optim_state_bytes, f"chunk {c.chunk_id}'s optimizer state")
            self.tiers.reserve_state(c, want)
            with self.tracked(c):
                c.optim_state_bytes = want

    def write_back(
        self,
        groups: Iterable[int] | None = None,
        *,
        fresh: Collection[int] = (),
        chunks: Collection[Chunk] | None = None,
    ) -> None:
        """After a step: refresh the compute-dtype copies from the masters of the chunks of param groups
        ``groups`` (those of the optimizer that stepped; every chunk when ``None``) but the chunks in ``fresh``
        (ids: the step wrote their copies itself); drop their stale payloads. ``chunks``: these, frozen or not."""
        stepped = None if groups is None else set(groups)
        for c in self.chunks if chunks is None else chunks:
            if chunks is None and (not c.trainable or (stepped is not None and c.spec.key.group not in stepped)):
                continue
            if c.aliased:
                if not c.master_is_payload():
                    lo, hi = c.shard_range
                    assert c.payload is not None and c.master is not None
                    c.payload[lo:hi].copy_(c.master)
                continue
            if c.low is not None and c.chunk_id not in fresh:
                assert c.master is not None
                with self.tiers.reading(c, (Role.MASTER,)):
                    c.low.copy_(c.master)
            if c.is_resident:
                self.release(c, eviction=False)
        self._changed()

    def forget_layout(self) -> None:
        """No chunks any more: every one was dropped (``consolidate.unpack``), nothing is accounted."""
        self.chunks = []
        self._where = {}
        self.layout = None
        self._all_aliased = False
        self.pool.clear()
        self._changed()

    def close(self) -> None:
        """The end of the run: the disk tier's scratch files go, and the pool's blocks."""
        self.pool.clear()
        self.tiers.close()

    # ==================================================================== stats
    def stats(self) -> dict[str, float]:
        return {
            "device_chunk_bytes": self.ledger[Tier.DEVICE],
            "device_memory_limit": self.limit or 0,  # 0: unbounded
            "device_chunk_bytes_peak": self.device_peak,
            "grad_payload_bytes_peak": self.grad_payload_peak,
            "host_chunk_bytes": self.ledger[Tier.HOST],
            "disk_chunk_bytes": self.ledger[Tier.DISK],
            "disk_shards": sum(c.shard_tier is Tier.DISK for c in self.chunks),
            **self.tiers.disk.stats(),
            **self.pool.stats(),
            **asdict(self.transfers),  # bytes copied each way, evictions, gathers, waiting releases
            "d2h_async_bytes": self.reducer.offload.async_bytes,  # of which copied on the side stream (CUDA)
            "chunks": len(self.chunks),
            "chunk_numel": self.layout.capacity_numel if self.layout else 0,
            "device_shards": sum(c.shard_tier is Tier.DEVICE for c in self.chunks),
            "param_numel": sum(t.numel for c in self.chunks for t in c.tensors),
            "shard_numel": sum(c.shard_numel for c in self.chunks),  # this rank's: ~param_numel / world_size
            "padding_numel": self.layout.padding_numel if self.layout else 0,
            "shard_bytes": sum(c.bytes_on(c.shard_tier) - (c.payload_bytes if c.aliased else 0) for c in self.chunks),
        }
