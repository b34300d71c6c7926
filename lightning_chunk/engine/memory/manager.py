"""The chunk manager: the mechanism that moves bytes, and the one owner of their accounting.

It packs parameters into chunks (``pack``), gathers and releases payloads, accumulates gradients into shards,
exposes the master shards to the optimizer, and keeps, per tier, a ledger of chunk bytes. Every operation that changes
a chunk's buffers runs inside ``ledger.tracked(chunk)``, which moves the ledger by what the chunk's buffers say
changed; ``check_accounting`` re-derives the sum from the chunks (tests call it after every operation). Device-tier
allocations are reserved against ``device_memory_limit`` *before* they happen, so chunk memory never exceeds it.

Policy lives elsewhere (``placement.py``): the manager executes plans.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..chunks.build import build_chunk
from ..chunks.chunk import Chunk, InFlight, Role, TensorInfo, Tier, free_storage
from ..chunks.packing import ChunkKey, Layout, ParamSpec
from ..chunks.repack import ExtraShards, FromModule, OldChunks
from ..chunks.states import TensorState
from ..comm.collectives import Collectives
from ..comm.reduce import GradReducer
from ..config import ChunkConfig, DtypePolicy, packed_codes
from ..schedule.costs import chunk_views, shard_cost
from ..schedule.placement import ChunkView
from ..system.threads import indexed
from ..system.timing import StepClock
from ..tiers.pool import BlockPool
from ..tiers.tier_set import TierSet
from .grads import ChunkGrads
from .ledger import Ledger
from .master_writes import copies_made
from .shard_readers import ShardReaders

S = TensorState
_HOST = torch.device("cpu")


@dataclass
class TransferStats:
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    evictions: int = 0
    gathers: int = 0
    waiting_releases: int = 0  # payloads released while their gradients waited to reduce (the last resort)
    masters_written: int = 0  # batches before which the compute copies were made again ([Note: the optimizer's ...])
    repacked_chunks: int = 0  # chunks built by repacks, and of those the ones that kept their old shard buffers
    kept_chunks: int = 0  # ([Note: a chunk that keeps its buffers] in ``chunks/kept.py``)


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
        limit_origin: str = "",
    ) -> None:
        """``own_dtype``: indices of the parameters whose payloads keep their dtype ([Note: normalisation in mixed
        precision] in ``config.py``); ``limit_origin``: where ``config.device_memory_limit`` came from when this
        rank did not set it (``Ledger.named_limit``)."""
        self.config = config
        self.dtypes = dtypes
        self.device = indexed(device)  # [Note: the engine's own threads]
        self.comm = collectives or Collectives.local()
        self.params = [p for _, p in named_params]
        self.names = [n for n, _ in named_params]
        for name, p in named_params:
            if p.is_complex():
                attr = name.rsplit(".", 1)[-1]
                raise TypeError(
                    f"parameter {name!r} is complex ({p.dtype}); chunks hold real numbers. Keep it as its real "
                    f"pair, nn.Parameter(torch.view_as_real(w)), and read torch.view_as_complex(self.{attr}.float()) "
                    "in forward (.float(): under mixed precision the pair computes in bf16, which has no complex "
                    "type): torch's optimizers step a complex parameter as that pair, so it trains the same."
                )
            if not p.is_floating_point() and packed_codes(p):  # [Note: quantized weights] in config.py
                raise TypeError(
                    f"parameter {name!r} is a 4-bit weight in a {p.dtype} container; chunks hold floating-point "
                    "values. Build it with quant_storage=torch.bfloat16 (Linear4bit(..., quant_storage=...), "
                    "BitsAndBytesConfig(bnb_4bit_quant_storage=torch.bfloat16)), as FSDP and DeepSpeed ZeRO-3 ask: "
                    "its codes are then packed, sharded and offloaded, never cast."
                )
            if not p.is_floating_point():
                raise TypeError(
                    f"parameter {name!r} has dtype {p.dtype}; only floating-point parameters can be chunked. A value "
                    f"that never trains is a buffer: register_buffer({name.rsplit('.', 1)[-1]!r}, ...) on its "
                    "module (buffers stay on the module, as under DDP)."
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
        self.all_aliased = False  # every payload is its shard (one rank, all shards on the device): nothing moves
        self.chunks: list[Chunk] = []
        self.layout: Layout | None = None
        self._where: dict[int, tuple[Chunk, TensorInfo]] = {}
        self.ledger = Ledger(self.limit, self.comm.all_rank, self.device, limit_origin)  # chunk bytes a tier
        self.transfers = TransferStats()
        self.clock = StepClock()  # [Note: where a step's time goes]; the collectives charge their waits to it
        self.comm.clock = self.clock
        self._retiring: list[Chunk] = []  # old chunks still holding bytes during a streaming repack
        pin = config.pin_memory if self.device.type == "cuda" else False
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.tiers = TierSet(
            self.device,
            pinned=pin,
            disk_dir=config.disk_dir,
            rank=self.comm.all_rank,  # replicas on one host keep scratch files of their own
            disk_io=config.disk_io,
            ranks_here=self.comm.ranks_on_this_host(),
            host_limit=config.host_memory_limit,
        )
        self.pool = BlockPool(self.device)  # [Note: a pool of payload blocks]
        self.reducer = GradReducer(self, pinned=bool(pin), exact=self.tiers.host.exact)  # when gradients reduce
        self.grads = ChunkGrads(self)  # from backward to the optimizer
        self.optim_state_made = False  # an optimizer stepped: its state exists
        self.readers = ShardReaders()  # a save written beside training ([Note: training beside a save])
        self.on_change: Callable[[], None] | None = None  # test hook: called after every operation

    # ================================================================ accounting
    def check_accounting(self) -> None:
        self.ledger.check([*self.chunks, *self._retiring])

    def changed(self) -> None:
        if self.config.check_invariants:
            self.check_accounting()
        if self.on_change is not None:
            self.on_change()

    # ==================================================================== lookup
    def lookup(self, param: torch.Tensor) -> tuple[Chunk, TensorInfo]:
        return self._where[id(param)]

    def is_payload_view(self, t: torch.Tensor) -> bool:
        """``t`` is a view of a chunk's payload (the tracer leaves it out of non-model memory)."""
        ptr = t.untyped_storage().data_ptr()
        return any(c.payload is not None and c.payload.untyped_storage().data_ptr() == ptr for c in self.chunks)

    def find(self, param: torch.Tensor) -> tuple[Chunk, TensorInfo] | None:
        """``lookup``, or ``None`` for a parameter in no chunk (not packed, or not yet)."""
        return self._where.get(id(param))

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
            values = OldChunks(self, self.chunks, tiers, extras=extras, eager=eager)
            self._retiring, self.chunks, self._where = self.chunks, [], {}
        self.layout = layout
        for spec in values.build_order(layout):
            chunk = build_chunk(
                self, spec, tiers.get(spec.chunk_id, Tier.HOST), values, broadcast=first and self.comm.world_size > 1
            )
            self.chunks.append(chunk)
            if optim_bytes is not None:  # before the state is carried in: a disk shard takes it into its file
                self.reserve_optimizer_state(optim_bytes, [chunk])
            values.placed(chunk)
            self.tiers.page_out(chunk)  # what the build and the carried state wrote leaves the process
            copies_made(chunk)
            self.changed()
        self.chunks.sort(key=lambda c: c.chunk_id)
        assert values.done()
        if not first:
            self.transfers.repacked_chunks += len(self.chunks)
            self.transfers.kept_chunks += values.kept
        self._retiring = []
        self.all_aliased = bool(self.chunks) and all(c.aliased for c in self.chunks)
        self.reducer.reset_order(self.chunks)

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

    def drop(self, c: Chunk) -> None:
        """Free every buffer of ``c`` (a chunk of a layout being replaced, or all of them at the end). After a
        failed collective only the chunk's references go: collectives queued behind it may still use the buffers
        ([Note: memory a failed collective may still use] in ``waits.py``)."""
        self.tiers.free(c)
        with self.ledger.tracked(c):
            if not self.comm.broken:
                for t in (t for t in (c.master, c.low, c.grad, c.grad_low) if t is not None):  # optimizers view them
                    free_storage(t)
                if c.payload is not None:
                    c.payload.untyped_storage().resize_(0)
            c.master = c.low = c.grad = c.grad_low = None
            c.optim_state_bytes = 0

    # ============================================================ gather/release
    def gather(self, chunk: Chunk, *, prefetch: bool = False, module: int = -1) -> None:
        """Make the payload resident (FREE -> HOLD): host-to-device copy, or all-gather of the shards.

        [Note: streams and prefetch]
        On CUDA a prefetch runs on a side stream: the copy of a host shard to the device (with one rank, the whole
        "gather"; with several, into this rank's slice of the payload) and the all-gather's issue, which NCCL orders
        after that copy. An event recorded there and, with several ranks, the all-gather's work go in
        ``chunk.pending``; the compute stream waits on both before the chunk is first used (``wait_ready``) and
        before its payload is released, so the caching allocator never hands the block out while a copy into it is
        in flight. The payload is allocated on the compute stream, and the side stream first waits for the compute
        stream, so the copy never overtakes earlier frees. A host shard's copy to the device thus overlaps compute
        with any number of ranks; on the compute stream it held back every kernel queued after it.
        Demand gathers run on the compute stream: the module needs the data at once anyway.
        With several ranks on CPU a prefetch is an asynchronous all-gather whose ``Pending`` (buffer and work handle
        together) is kept in ``chunk.pending`` until first use; gloo runs it on its own thread, so it overlaps with
        compute there too. On CPU one-rank copies are synchronous and events are not used. A disk shard is read
        (paged in) here, on the calling thread, and paged out once the copy has read it.
        """
        if chunk.is_resident:
            return
        assert chunk.payload is not None
        side = self._copy_stream if prefetch else None
        with self.ledger.tracked(chunk):
            self.ledger.reserve(chunk.payload_bytes, f"gathering chunk {chunk.chunk_id}")
            self.pool.fill(chunk.payload.untyped_storage(), chunk.payload_bytes)
            if side is not None:
                side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                src = self._stage(chunk)
                pending = self.comm.all_gather(
                    chunk.payload, src, chunk=chunk.chunk_id, module=module, async_op=prefetch
                )
                event = torch.cuda.Event() if side is not None else None
                if event is not None:
                    event.record(side)
            if event is not None or (prefetch and pending.work is not None):
                # the source must live until the gather lands
                chunk.pending = InFlight(work=pending if pending.work is not None else None, source=src, event=event)
        self.transfers.gathers += 1
        chunk.gathered()
        self.changed()

    def _stage(self, chunk: Chunk) -> torch.Tensor:
        """What this rank gives the gather of ``chunk``: its shard where it lies, or staged in this rank's slice of
        the payload when the collective cannot read it there, on the current stream. Collectives need device
        tensors: a host shard is staged in place, as FSDP2 does, so no unaccounted buffer is made. A disk shard is
        staged too: on a CPU device its file is read straight into the slice ([Note: staged optimizer steps] in
        disk_staging.py); else its pages go out once this copy has read them."""
        assert chunk.payload is not None
        from_file = chunk.shard_tier is Tier.DISK and chunk.low is None  # an fp32 disk shard: read the master's file
        with self.tiers.reading(chunk, (Role.MASTER,) if from_file and self.device.type != "cpu" else ()):
            src = chunk.low_tensor()
            if chunk.shard_tier is Tier.DEVICE:
                return src
            self.transfers.h2d_bytes += src.numel() * src.element_size()
            if not (
                (self.comm.world_size > 1 and src.device != self.comm.tensor_device()) or chunk.shard_tier is Tier.DISK
            ):
                return src
            lo, hi = chunk.shard_range
            staged = chunk.payload[lo:hi]
            with self.clock.measure("tier_copy"):
                if not (from_file and self.device.type == "cpu" and self.tiers.read_master_into(chunk, staged)):
                    staged.copy_(src, non_blocking=not from_file)  # a mapped file's pages go at the end
            return staged

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
        with self.ledger.tracked(chunk):
            assert chunk.payload is not None
            self.pool.empty(chunk.payload.untyped_storage())
        chunk.released()
        if eviction:
            self.transfers.evictions += 1
        self.changed()

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

    # ================================================================ optimizer
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

    def reserve_optimizer_state(self, bytes_per_element: Mapping[int, int], chunks: Iterable[Chunk] = ()) -> None:
        """Account the optimizer state each trainable chunk's shard will hold (group index -> bytes per element);
        of ``chunks`` only, when given (a chunk just built, before the state is carried in)."""
        for c in chunks or self.chunks:
            want = c.shard_numel * bytes_per_element.get(c.spec.key.group, 0) if c.trainable else 0
            if want != c.optim_state_bytes:
                if c.shard_tier is Tier.DEVICE:
                    self.ledger.reserve(want - c.optim_state_bytes, f"chunk {c.chunk_id}'s optimizer state")
                self.tiers.reserve_state(c, want)
                with self.ledger.tracked(c):
                    c.optim_state_bytes = want
        self.changed()

    def write_back(
        self,
        groups: Iterable[int] | None = None,
        *,
        fresh: Collection[int] = (),
        chunks: Collection[Chunk] | None = None,
        waiting_grads: bool = False,
    ) -> None:
        """After a step: refresh the compute-dtype copies from the masters of the chunks of param groups
        ``groups`` (those of the optimizer that stepped; every chunk when ``None``) but the chunks in ``fresh``
        (ids: the step wrote their copies itself); drop their stale payloads. ``chunks``: these, frozen or not.
        ``waiting_grads``: a payload whose gradients wait to reduce goes too (between accumulated micro-batches)."""
        stepped = None if groups is None else set(groups)
        for c in self.chunks if chunks is None else chunks:
            if chunks is None and (not c.trainable or (stepped is not None and c.spec.key.group not in stepped)):
                continue
            copies_made(c)  # [Note: the optimizer's views written outside its step] in master_writes.py
            if c.aliased:
                if not c.master_is_payload():
                    lo, hi = c.shard_range
                    assert c.payload is not None and c.master is not None
                    c.payload[lo:hi].copy_(c.master)
                    for t in c.tensors:  # [Note: writes through .data] in full_params.py
                        t.looked = None
                continue
            if c.low is not None and c.chunk_id not in fresh:
                assert c.master is not None
                with self.tiers.reading(c, (Role.MASTER,)):
                    c.low.copy_(c.master)
            if c.is_resident:
                self.release(c, eviction=False, waiting_grads=waiting_grads)
        self.changed()

    def forget_layout(self) -> None:
        """No chunks any more: every one was dropped (``consolidate.unpack``), nothing is accounted."""
        self.chunks = []
        self._where = {}
        self.layout = None
        self.all_aliased = False
        self.pool.clear()
        self.grads.host_pool.clear()
        self.changed()

    def close(self) -> None:
        """The end of the run: the disk tier's scratch files go, the pools' blocks, the collectives' groups."""
        self.pool.clear()
        self.grads.host_pool.clear()
        self.tiers.close()
        self.comm.close()

    # ==================================================================== stats
    def stats(self) -> dict[str, float]:
        return {
            "device_chunk_bytes": self.ledger[Tier.DEVICE],
            "device_memory_limit": self.limit or 0,  # 0: unbounded
            "device_chunk_bytes_peak": self.ledger.peak,
            "grad_payload_bytes_peak": self.reducer.payload_peak,
            "host_chunk_bytes": self.ledger[Tier.HOST],
            "disk_chunk_bytes": self.ledger[Tier.DISK],
            "disk_shards": sum(c.shard_tier is Tier.DISK for c in self.chunks),
            **self.tiers.disk.stats(),
            **self.pool.stats(),
            "host_grad_pool_bytes_peak": self.grads.host_pool.pooled_peak,  # [Note: gradient shards pinned to the byte]
            **({"host_grads_kept_lazily": self.grads.host_pool.kept_lazily} if self.grads.host_pool.lazy else {}),
            **asdict(self.transfers),  # bytes copied each way, evictions, gathers, waiting releases
            **self.reducer.offload.stats(),  # of those bytes, copied on the side stream (CUDA); the worker's part
            # host bytes page-locked to the byte now (``pin_memory="exact"``): the host shards, a save's copies
            "exact_pinned_bytes": self.tiers.host.exact.live_bytes if self.tiers.host.exact is not None else 0,
            "chunks": len(self.chunks),
            "chunk_numel": self.layout.capacity_numel if self.layout else 0,
            "device_shards": sum(c.shard_tier is Tier.DEVICE for c in self.chunks),
            "param_numel": sum(t.numel for c in self.chunks for t in c.tensors),
            "shard_numel": sum(c.shard_numel for c in self.chunks),  # this rank's: ~param_numel / world_size
            "padding_numel": self.layout.padding_numel if self.layout else 0,
            "shard_bytes": sum(c.bytes_on(c.shard_tier) - (c.payload_bytes if c.aliased else 0) for c in self.chunks),
        }
