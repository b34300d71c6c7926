"""The engine's clock and what runs at each tick: the placement plan's evictions and prefetches, the gathers a
module needs, and the diagnosis when they do not fit.

A *moment* is one tick at a module hook ([Note: hooks and autograd with freed storage] in ``hooks.py``). The hooks
say which module and which kind of moment; ``MomentClock.tick`` advances the clock and records the moment (for the
warm-up trace, the ranks' sequence check and the reducer), and ``plan_and_run`` asks the policy what to do there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..chunks.chunk import STAMPS, Tier
from ..chunks.chunk import nbytes as tensor_nbytes
from ..chunks.states import TensorState
from ..comm.sequence import ModuleSequence
from ..config import format_bytes
from ..errors import PLUS_ACTIVATIONS, DeviceMemoryLimitError
from ..memory.manager import ChunkManager
from ..schedule.placement import PlacementPolicy, activation_room, untraced_budget
from ..schedule.tracer import (
    BACKWARD,
    FORWARD,
    POST_FORWARD,
    ROOT,
    MemoryTracer,
    MomentEvent,
    MomentKey,
    MomentKind,
    Trace,
)
from .owners import ModuleOwners

S = TensorState
# disk chunks whose master files a CPU gather reads ahead of use ([Note: the gathers' reads ahead of use] in
# disk_storage.py)
READ_AHEAD_CHUNKS = 4


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a forward then is a recomputation."""
    return torch._C._current_graph_task_id() != -1


class MomentClock:
    """The clock of one fit's moments and the plan run at each: ``tick`` then ``plan_and_run``."""

    def __init__(
        self, manager: ChunkManager, policy: PlacementPolicy, owners: ModuleOwners, tracer: MemoryTracer
    ) -> None:
        self.manager = manager
        self.policy = policy
        self.owners = owners
        self.tracer = tracer
        self.trace: Trace | None = None
        self.training = False
        self.position = -1  # moment within the current micro-batch
        self.clock = 0  # moments since creation (for LRU)
        self.current_module = -1  # the number of the module whose moment this is (collective tags)
        self.backward_queued = False  # a backward of this micro-batch has begun
        self.freed_room = False  # the last plan released payloads for memory ([Note: moments with nothing to release])
        self.sequence = ModuleSequence()  # the modules this micro-batch ran, compared across ranks
        # instrumentation is injected, never global: a callable that receives a MomentEvent per moment
        self.recorder: Callable[[MomentEvent], None] | None = None
        self._occurrences: dict[tuple[str, str], int] = {}  # moments of each kind and module so far this step
        self._this_moment: tuple[str, str] = ("", "")  # (kind, module key) of the moment at ``position``
        self._previous_moment: tuple[str, str] = ("", "")  # and of the one before it
        self.key: MomentKey | None = None  # several ranks: the moment's name ([Note: when a chunk reduces])
        # when the last moment's plan was settled (a stamp, ``chunk.STAMPS``), and the chunks it needed: [Note:
        # backward moments with nothing to release]
        self._settled_at = 0
        self._settled_needed: tuple[int, ...] = ()

    def new_step(self, *, training: bool) -> None:
        """A micro-batch or an evaluation step begins: its moments count from the start."""
        self.sequence.clear()
        self.position = -1
        self._occurrences = {}
        self._this_moment = self._previous_moment = ("", "")
        self.training = training

    def make_room(self, nbytes: int) -> None:
        """Evict by the policy until ``nbytes`` more fit under the limit (for gradient payloads: the manager calls
        it through the argument its gradient methods take)."""
        mgr = self.manager
        trace = self.trace if self.training else None
        budget = self.policy.budget(mgr.limit, trace, self.position)
        plan = self.policy.plan(
            position=self.position,
            needed=frozenset(),
            chunks=mgr.views(include=self.policy.upcoming(self.position, trace)),
            trace=trace,
            budget_bytes=None if budget is None else budget - nbytes,
            device_bytes=mgr.ledger[Tier.DEVICE],
        )
        self.freed_room = True
        for cid in plan.evict:
            mgr.release(mgr.chunks[cid])
        self.release_waiting(nbytes, keep=())

    def release_waiting(self, nbytes: int, keep: Iterable[int]) -> None:
        """The last resort when ``nbytes`` more do not fit under the limit: release the payloads of chunks that are
        pinned only by gradients waiting to reduce, the farthest next use first ([Note: a gradient waits without
        its payload] in ``states.py``)."""
        mgr = self.manager
        if mgr.limit is None or mgr.ledger[Tier.DEVICE] + nbytes <= mgr.limit:
            return
        trace = self.trace if self.training else None
        keep = set(keep)
        flags = [c.chunk_id not in keep and c.waits_only_to_reduce for c in mgr.chunks]
        if mgr.comm.world_size > 1:  # a tensor waits on a rank that got its gradient, is in use on one that did not
            agreed = torch.tensor(flags, dtype=torch.uint8, device=mgr.comm.tensor_device())
            flags = [bool(f) for f in mgr.comm.all_reduce(agreed, "min", what="the agreement on what may go").tolist()]
        waiting = [c for c, f in zip(mgr.chunks, flags, strict=True) if f]
        waiting.sort(
            key=lambda c: (trace.next_use(c.chunk_id, self.position) if trace is not None else 0.0, -c.last_used),
            reverse=True,
        )
        for c in waiting:
            if mgr.ledger[Tier.DEVICE] + nbytes <= mgr.limit:
                break
            mgr.release(c, waiting_grads=True)

    def tick(self, kind: MomentKind, key: str) -> tuple[int, ...]:
        """Advance the clock by one moment; return the chunks the module owns."""
        self._previous_moment = self._this_moment
        self._this_moment = (kind, key)
        self.position += 1
        self.clock += 1
        chunk_ids = self.owners.chunks_of(key)
        if self.tracer.recording and kind == FORWARD and in_backward():  # only the warm-up asks what is pinned
            self.tracer.record(kind, key, chunk_ids, self.owners.owned.get(key, ()), self.pinned)
        else:
            self.tracer.record(kind, key, chunk_ids, self.owners.owned.get(key, ()))
        if self.manager.comm.world_size > 1:
            self.sequence.add(kind, key)
            n = self._occurrences.get((kind, key), 0)
            self._occurrences[(kind, key)] = n + 1
            self.key = MomentKey(kind, key, n)
            if self.backward_queued and self.training:  # [Note: when a chunk reduces] in reduce.py
                self.manager.reducer.at_moment(self.key, self.make_room)
        return chunk_ids

    def expect_gradients(self, kind: MomentKind, module: str, owned: Iterable[int]) -> None:
        """Once this moment's chunks are in use: make the gradient payloads whose gradients may come from here on, on
        every rank alike ([Note: gradients some ranks lack] in reduce.py). A traced backward makes those the trace
        saw a first gradient for after this moment. An untraced one (the warm-up), at a module's backward, those of
        the chunks holding the trainable parameters it owns (``owned``); not the root's, whose backward is the
        whole backward (a tied head read in the LightningModule's forward held its payload through all of it), and
        not in a backward that builds a graph (a gradient penalty's first half), which accumulates none."""
        if self.manager.comm.world_size == 1 or not (self.backward_queued and self.training):
            return
        reducer = self.manager.reducer
        if reducer.traced:
            reducer.expect_at(self.key, self.make_room)
        elif kind == BACKWARD and module != ROOT and not torch.is_grad_enabled():
            self.manager.grads.expect(owned, self.make_room)

    def pinned(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """For the warm-up's trace, at a recomputation's moment: the (parameters, chunks) a backward has in use
        ([Note: recomputation]). Elsewhere none is recorded: a module's backward ends as the next begins, and
        counting that overlap refused limits that work."""
        index_of = self.manager.index_of
        params, chunks = [], []
        for c in self.manager.chunks:
            mine = [index_of[id(t.param)] for t in c.tensors if t.state is S.COMPUTE]
            if mine:
                params.extend(mine)
                chunks.append(c.chunk_id)
        return tuple(sorted(params)), tuple(chunks)

    def plan_and_run(self, needed: tuple[int, ...]) -> None:
        mgr = self.manager
        if mgr.all_aliased:  # everything is resident for good: nothing to plan
            return
        trace = self.trace if self.training else None
        include = self.policy.upcoming(self.position, trace).union(needed)
        budget = self.policy.budget(mgr.limit, trace, self.position)
        if trace is None and budget is not None:
            budget = untraced_budget(budget, self.trace)
        all_resident = all(mgr.chunks[i].is_resident for i in include)
        if self.policy.idle(
            all_resident=all_resident, budget_bytes=budget, device_bytes=mgr.ledger[Tier.DEVICE]
        ) or self._plan_is_empty(all_resident, trace, budget, needed, include):
            self.freed_room = False
        else:
            self._plan(needed, include, trace, budget)
        self._settled_at, self._settled_needed = next(STAMPS), needed
        for cid in needed:
            mgr.wait_ready(mgr.chunks[cid])  # a prefetch on the side stream must land before use
            mgr.chunks[cid].last_used = self.clock
        if mgr.pool.pooled_bytes:  # [Note: the pool under a limit] in placement.py
            room = self.policy.pool_room(mgr.limit, trace, self.position, mgr.ledger[Tier.DEVICE])
            if room is not None:
                mgr.pool.trim(room)
        # a gather to a CUDA device reads an fp32 disk shard through the mapping: fault the next ones in ahead; on a
        # CPU device the gather reads the file itself ([Note: staged optimizer steps] in disk_staging.py): the kernel
        # starts reading it ahead ([Note: the gathers' reads ahead of use] in disk_storage.py)
        if trace is not None and mgr.ledger[Tier.DISK]:
            on_cpu = mgr.device.type == "cpu"
            for cid in (
                trace.chunks_ahead(self.position, READ_AHEAD_CHUNKS) if on_cpu else trace.next_chunks(self.position)
            ):
                c = mgr.chunks[cid]
                if c.shard_tier is Tier.DISK and not c.is_resident and c.low is None:
                    mgr.tiers.read_ahead_master(c)

    def _plan(self, needed: tuple[int, ...], include: frozenset[int], trace: Trace | None, budget: int | None) -> None:
        """Ask the policy what to evict and prefetch at this moment, and do it; then gather what is needed."""
        mgr = self.manager
        # a plan reads the resident chunks only to evict them: with no limit and no releasing, it evicts none
        # (everything resident on several ranks: 8% of the hooks' time went to views of every resident chunk)
        evicts = budget is not None or self.policy.evict_after_use
        plan = self.policy.plan(
            position=self.position,
            needed=frozenset(needed),
            chunks=mgr.views(include=include, resident=evicts),
            trace=trace,
            budget_bytes=budget,
            device_bytes=mgr.ledger[Tier.DEVICE],
        )
        self.freed_room = plan.for_room
        for cid in plan.evict:
            mgr.release(mgr.chunks[cid])
        for cid in needed:
            self.gather_or_explain(cid, needed)
        for cid in plan.prefetch:
            c = mgr.chunks[cid]
            try:
                mgr.gather(c, prefetch=True, module=self._module_of_next(cid))
            except DeviceMemoryLimitError:
                break  # a prefetch is only a hint

    def gather_or_explain(self, cid: int, needed: tuple[int, ...]) -> None:
        mgr = self.manager
        chunk = mgr.chunks[cid]
        if chunk.is_resident:
            return
        try:
            mgr.gather(chunk, module=self.current_module)
            return
        except DeviceMemoryLimitError:
            pass
        mgr.grads.land_in_flight()  # the plan was too optimistic: land the reduces in flight, free what may go, retry
        self.freed_room = True
        for other in mgr.chunks:
            if other.chunk_id not in needed and other.is_evictable:
                mgr.release(other)
        self.release_waiting(chunk.payload_bytes, keep=needed)
        try:
            mgr.gather(chunk, module=self.current_module)
        except DeviceMemoryLimitError as e:
            views = mgr.views()
            shards = sum(v.device_shard_bytes for v in views if v.shard_tier is Tier.DEVICE)
            # payloads beside the shards (one rank's device shard is its payload): in use, or needed now
            in_use = [
                v.chunk_id
                for v in views
                if v.resident and (not v.evictable or v.chunk_id in needed) and not mgr.chunks[v.chunk_id].aliased
            ]
            pinned = sum(mgr.chunks[c].payload_bytes for c in in_use)
            grads = sum(tensor_nbytes(c.grad_payload) for c in mgr.chunks)
            missing = sum(mgr.chunks[c].payload_bytes for c in needed if not mgr.chunks[c].is_resident)
            nonmodel = self.trace.nonmodel_at(self.position) if self.trace is not None else 0
            raise DeviceMemoryLimitError(
                f"{e} Chunks {list(needed)} are needed now and nothing else can be evicted: {shards} bytes of "
                f"shards stay on the device (placement={self.policy.name!r}), chunks {in_use} are in use "
                f"({pinned} bytes)"
                + (f", {grads} bytes of gradients wait to be reduced" if grads else "")
                + f" and {missing} more bytes must be gathered"
                + (f", next to {nonmodel} bytes of traced activations" if nonmodel else "")
                + ". The smallest limit that would work is "
                + format_bytes(shards + pinned + grads + missing + nonmodel)
                + ("" if self.trace is not None else PLUS_ACTIVATIONS)
                + ("; or lower chunk_numel." if self.policy.config.chunk_numel is not None else "."),
                mgr.device,
            ) from None

    def _module_of_next(self, chunk_id: int) -> int:
        """The module index the trace says uses ``chunk_id`` next (for collective tags)."""
        if self.trace is None:
            return -1
        for m in self.trace.moments[self.position + 1 :]:
            if chunk_id in m.chunk_ids and m.kind != POST_FORWARD:
                return self.owners.index.get(m.module, -1)
        return -1

    def _plan_is_empty(
        self,
        all_resident: bool,
        trace: Trace | None,
        budget: int | None,
        needed: tuple[int, ...],
        include: frozenset[int],
    ) -> bool:
        """Whether the plan at this moment would release nothing and gather nothing, known from the moment before.

        [Note: moments with nothing to release]
        Releasing after use plans at every module's start and end: on the 99.5M GPT with host placement 265 plans
        a step, each building views of the resident chunks and the sets of what to keep, where most find nothing
        to do: the modules of a transformer block run on the block's chunk. Two kinds of moment are known empty
        from the one before it, whose plan ran (or was known empty):
        - a module's end right after its own start (a leaf module: nothing ran in between but its forward). The
          clock moved past a post-forward moment, which the prefetch window and ``reused_before_gather`` skip,
          so both name what they named at its start (with the chunks gathered since counted resident, a
          superset): every payload that plan kept stays kept, and the only payloads this plan could release are
          the module's own, no longer in use. It keeps those the window holds (all but a block's last module
          run on the block's chunk, which the next module needs) and, keeping payloads for backward, those used
          again in the step ([Note: keeping payloads for backward] in placement.py).
        - a module's start in forward right after another module's end. Every payload resident now was kept by
          that plan, and the window only moved on by this module: what the old window held beyond this
          module's chunks is the first chunk used after them, which the new one holds too, and the payloads
          reused before the next gather are the same. If the window's chunks are all resident, nothing is
          gathered either.
        Either way, with no disk tier (whose gathers and read-aheads are timed per moment) and the device within
        the room the traced activations leave under the budget (or no budget), nothing is evicted for memory. And
        only after a plan that released nothing for memory: a payload released to make room, that the one before
        would have kept, can end the stretch ``reused_before_gather`` reads earlier, and the full plan then
        releases what was to be reused after it.
        Not at a backward moment, where the module that just ran can leave its chunks evictable for the next plan
        (the rule of [Note: backward moments with nothing to release] checks that), nor at a forward start inside
        backward (a recomputation); a recomputed module's end right after its start is skipped as in forward, its
        chunks pinned by the backward that runs it as before. Tested by
        recording every moment of runs with and without the skip (tests/integration/test_parity.py).
        On that model a third of the plans are skipped, a small part of a CPU step (the plans left are the ones
        that gather); on an accelerator, whose steps are shorter, the same Python is a larger part of the step."""
        kind, key = self._this_moment
        if trace is None or self.manager.ledger[Tier.DISK] or self.freed_room:
            return False
        room = activation_room(budget, trace, self.position)
        if room is not None and self.manager.ledger[Tier.DEVICE] > room:
            return False
        if kind == POST_FORWARD and self._previous_moment == (FORWARD, key):
            window, later, at = (
                self.policy.upcoming(self.position, trace),
                self.policy.keeps_for_backward,
                self.position,
            )
            return all(c in window or later and trace.used_later(c, at) for c in self.owners.chunks_of(key))
        if kind == BACKWARD:
            return self._backward_is_settled(all_resident, trace, needed, include)
        return kind == FORWARD and self._previous_moment[0] == POST_FORWARD and all_resident and not in_backward()

    def _backward_is_settled(
        self, all_resident: bool, trace: Trace, needed: tuple[int, ...], include: frozenset[int]
    ) -> bool:
        """[Note: backward moments with nothing to release]
        The rules above never skip a backward moment, yet in a block whose modules all run on the block's chunk most
        backward plans release and gather nothing. A backward moment right after another one finds nothing to do
        when
        - the window and the needed chunks are all resident (nothing to gather) and the trace's moment here uses the
          chunks this module owns (the window and the keep sets moved on by exactly this moment: what the last
          plan kept and this one would not is a chunk this moment uses, so needed now);
        - no chunk changed state since the last moment's plan was settled (every chunk's last change is stamped,
          ``Chunk.changed_at``), except the needed ones and those of the window, which no plan releases; the chunks
          the last moment needed count as changed (its module used them after its plan). A chunk whose state did
          not change is exactly as evictable as that plan left it, and what that plan could release it did;
        - the conditions of the rules above: no disk tier, no release for room in the plan before, the device
          within the room the traced activations leave.
        Several ranks reduce at moments (``reducer.at_moment``, before the plan): what a reduce frees changes its
        chunk's states, stamped, so the plan runs. Tested as the rules above, every moment recorded with and
        without the skip (tests/integration/test_parity.py). On a 20-block GPT (width 128) with a chunk a block, host
        placement, one CPU rank: 57 plans a step where 158 ran, the hooks' own time 17-18 ms a step where 19-20."""
        if not all_resident or self._previous_moment[0] != BACKWARD:
            return False
        if self.position >= len(trace.moments) or trace.moments[self.position].chunk_ids != needed:
            return False
        if not include.issuperset(self._settled_needed):
            return False
        mark = self._settled_at
        return all(c.changed_at < mark or c.chunk_id in include for c in self.manager.chunks)

    def resident(self) -> frozenset[int]:
        return frozenset(c.chunk_id for c in self.manager.chunks if c.is_resident)

    def record(self, kind: MomentKind, key: str, needed: tuple[int, ...], before: frozenset[int]) -> None:
        assert self.recorder is not None
        after = self.resident()
        mgr = self.manager
        self.recorder(
            MomentEvent(
                position=self.position,
                kind=kind,
                module=key,
                needed=needed,
                evicted=tuple(sorted(before - after)),
                fetched=tuple(sorted(after - before)),
                resident=tuple(sorted(after)),
                device_shards=tuple(c.chunk_id for c in mgr.chunks if c.shard_tier is Tier.DEVICE),
                disk_shards=tuple(c.chunk_id for c in mgr.chunks if c.shard_tier is Tier.DISK),
                device_bytes=mgr.ledger[Tier.DEVICE],
                nonmodel_bytes=self.trace.nonmodel_at(self.position) if self.trace is not None else 0,
            )
        )
