"""The warm-up's phases, and the one re-plan every change of layout or placement after set-up goes through.

[Note: the warm-up's phases]
A fit starts ``UNTRACED``: the chunks are packed in registration order and placed without a trace. The first training
micro-batch with gradients is ``RECORDING``: the tracer records each moment's chunks and activations. When its backward
ends the ranks agree on the trace (``traced``) and it is ``TRACED``, and at the step that follows
(``ChunkEngine.prepare_step``, where every gradient is in its shard, so no gradient in flight has to move)
``replan(Replan.WARM_UP)`` chooses the chunk size, repacks in first-use order and places from the trace: ``PLANNED``.
Another micro-batch of the same step records again (``TRACED`` -> ``RECORDING``): the last one's trace is the one
planned from. Inputs that grow past what the trace saw, or a module that adopts a parameter it read, send a traced or
planned engine back to ``UNTRACED`` (``replan(Replan.INPUTS_GREW)`` / ``Replan.OWNERS_CHANGED``: the trace is dropped
and the tiers placed without one), and that micro-batch records a new trace. A change of ``requires_grad``
(``Replan.REQUIRES_GRAD``) repacks in any phase and leaves it as it was, as do parameters read with autocast off
(``Replan.OUTSIDE_AUTOCAST``) between steps before and after the warm-up (within it, its own repack moves them). The
table ``NEXT`` lists the legal moves; any other raises ``IllegalTransitionError``, as the chunks' own state table does.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import torch

from ..chunks.packing import keep_slots
from ..chunks.parked import engine_reads
from ..comm.collectives import CollectiveMismatchError, first_difference
from ..config import format_bytes
from ..errors import ChunkError, DeviceMemoryLimitError, IllegalTransitionError, LayoutError
from ..schedule.placement import device_shards, shards_note, smallest_working_limit
from ..schedule.tracer import Trace
from ..system.host_heap import release_freed_memory
from .added_groups import follow_added_groups

if TYPE_CHECKING:  # a type only: the planner serves the engine that owns it
    from .engine import ChunkEngine


class WarmUp(enum.Enum):
    UNTRACED = "untraced"  # no trace: chunks in registration order, placed without one
    RECORDING = "recording"  # a training micro-batch's moments are being traced
    TRACED = "traced"  # a trace is taken; the next optimizer step plans from it
    PLANNED = "planned"  # packed in first-use order and placed from the trace


class Replan(enum.Enum):
    WARM_UP = "the warm-up step's trace"
    INPUTS_GREW = "inputs larger than any the trace saw"
    OWNERS_CHANGED = "a module adopted a parameter it read"
    REQUIRES_GRAD = "requires_grad changed"
    PARAM_GROUPS = "param groups added"  # [Note: param groups added while training] in added_groups.py
    OUTSIDE_AUTOCAST = "parameters read with autocast off"  # [Note: parameters read outside autocast]


NEXT: dict[WarmUp, frozenset[WarmUp]] = {
    WarmUp.UNTRACED: frozenset({WarmUp.RECORDING}),
    WarmUp.RECORDING: frozenset({WarmUp.TRACED}),
    WarmUp.TRACED: frozenset({WarmUp.RECORDING, WarmUp.PLANNED, WarmUp.UNTRACED}),
    WarmUp.PLANNED: frozenset({WarmUp.UNTRACED}),
}


class WarmUpPlanner:
    """The engine's warm-up phase and its re-plans ([Note: the warm-up's phases]); it works on the engine's own
    parts (a friend of ``ChunkEngine``: its packing, placing and gradient attaching)."""

    def __init__(self, engine: ChunkEngine) -> None:
        self.engine = engine
        self.phase = WarmUp.UNTRACED

    def enter(self, phase: WarmUp) -> None:
        if phase is not self.phase and phase not in NEXT[self.phase]:
            raise IllegalTransitionError(f"the warm-up cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    def traced(self, trace: Trace) -> None:
        """The warm-up's trace is taken: every rank checks it ran the same modules and takes the agreed activations
        and gradient moments at once, not at the repack: the micro-batches between (accumulation) plan their
        evictions from it, and with each rank's own activations (a branch one rank takes) they evicted different
        chunks and hung in the next collective."""
        self._check_same_trace(trace)
        self.engine.hooks.moments.trace = self._agree_on_activations(trace)
        self.enter(WarmUp.TRACED)

    def replan(self, reason: Replan) -> None:
        """Pack and place the chunks again for ``reason``; see [Note: the warm-up's phases]."""
        eng = self.engine
        mgr = eng.manager
        assert mgr.layout is not None
        retrace = reason in (Replan.INPUTS_GREW, Replan.OWNERS_CHANGED)
        if reason is Replan.WARM_UP:
            eng.hooks.outside_autocast.take()  # moved with the rest ([Note: parameters read outside autocast])
            # the warm-up's gathers and gradient payloads left freed heap pages: not at the repack's peak
            release_freed_memory()
            trace: Trace | None = eng.hooks.moments.trace  # agreed by every rank when it was taken (``traced``)
            assert trace is not None
        else:
            trace = None if retrace else eng.hooks.moments.trace
        if retrace:
            layout = mgr.layout
        else:
            order = trace.first_use_order(len(mgr.params)) if trace is not None else list(mgr.layout.order)
            try:
                layout = eng.layouts.choose(order, trace, keep=mgr.layout.capacity_numel)
            except LayoutError as e:
                if reason is not Replan.WARM_UP:
                    raise
                raise DeviceMemoryLimitError(str(e), mgr.device) from None
            layout = keep_slots(layout, mgr.layout)  # [Note: a chunk's parameters in their old places]
            if trace is not None:
                trace = trace.remap({i: s.chunk_id for i, s in layout.slot_of().items()})
        views, tiers = eng.description.plan_tiers(layout, trace)
        if reason is Replan.WARM_UP and mgr.limit is not None:
            assert trace is not None
            shards_b, held = device_shards(views, tiers, mgr.comm.world_size)
            chunks_b, nonmodel_b = smallest_working_limit(views, trace, held)
            if shards_b + chunks_b + nonmodel_b > mgr.limit:
                on_device, remedy = shards_note(eng.config.placement, shards_b, tiers.values())
                raise DeviceMemoryLimitError(
                    f"{mgr.ledger.named_limit()} is too small: the warm-up step needs "
                    f"{format_bytes(chunks_b)} of chunks at once (the largest chunk is "
                    f"{max((v.payload_bytes for v in views), default=0)} bytes)"
                    + (f" beside {on_device}" if on_device else "")
                    + f" and traced {format_bytes(nonmodel_b)} of non-model memory (activations). The smallest "
                    f"limit that would work is {format_bytes(shards_b + chunks_b + nonmodel_b)}"
                    + (f"; or {remedy}" if remedy else "")
                    + ".",
                    mgr.device,
                )
        # same layout: chunk ids correspond, so the tiers compare position by position
        moved = layout != mgr.layout or [c.shard_tier for c in mgr.chunks] != [tiers[c.chunk_id] for c in layout.chunks]
        if reason in (Replan.REQUIRES_GRAD, Replan.PARAM_GROUPS, Replan.OUTSIDE_AUTOCAST):
            moved = True  # the chunks' keys changed: always a repack
        elif retrace and not eng._no_grads_held:
            moved = False  # gradients of this step are in the shards: the step's end places them
        if moved:
            eng._place(layout, views, tiers)
        if reason in (Replan.REQUIRES_GRAD, Replan.PARAM_GROUPS):
            eng.hooks.watch_grads()
        if trace is not None:
            mgr.grads.follow_trace(trace)
        eng.hooks.moments.trace = trace
        if moved and reason is not Replan.WARM_UP:
            # the last step's gradients moved along: attach them again, so that the zero_grad() before this
            # micro-batch's backward is seen to clear them ([Note: zero_grad on a rebound optimizer]); the warm-up's
            # step attaches them itself
            eng._backward_ends()
        if moved:
            release_freed_memory()  # the repack left freed heap pages
        if reason is Replan.WARM_UP:
            self.enter(WarmUp.PLANNED)
        elif retrace:
            self.enter(WarmUp.UNTRACED)

    def _agree_on_activations(self, trace: Trace) -> Trace:
        """Every rank plans from the largest activations any rank measured at each moment: ranks whose budgets
        differed would evict and gather different chunks, and so pair different collectives. In the same
        all-reduce, every rank takes the latest moment any rank saw each parameter's gradient arrive after
        ([Note: when a chunk reduces] in reduce.py), and the earliest its first gradient did ([Note: gradients some
        ranks lack])."""
        comm = self.engine.comm
        if comm.world_size == 1 or not trace.moments:
            return trace
        n, g = len(trace.moments), len(trace.grad_positions)
        never = 1 << 40  # a first gradient no rank saw: below every negated position
        t = torch.tensor(
            [m.nonmodel_bytes for m in trace.moments]
            + list(trace.grad_positions)
            + [-p if p >= 0 else -never for p in trace.first_grad_positions],  # the max of -p: the earliest
            dtype=torch.int64,
            device=comm.tensor_device(),
        )
        most = comm.all_reduce(t, "max", what="the agreement on traced activations").tolist()
        return Trace(
            tuple(dataclasses.replace(m, nonmodel_bytes=int(b)) for m, b in zip(trace.moments, most[:n], strict=True)),
            tuple(int(p) for p in most[n : n + g]),
            tuple(-int(p) if -p < never else -1 for p in most[n + g :]),
        )

    def _check_same_trace(self, trace: Trace) -> None:
        """Every rank must have used the same modules in the same order during the warm-up."""
        eng = self.engine
        comm = eng.comm
        if comm.world_size == 1:
            return
        mine = [(m.kind, m.module) for m in trace.moments]
        seqs = comm.all_gather_object(mine)
        if all(s == seqs[0] for s in seqs):
            return
        i = first_difference(seqs)

        def at(r: int) -> str:
            if i >= len(seqs[r]):
                return "nothing (its step ended)"
            kind, module = seqs[r][i]
            ids = eng.manager.chunk_ids_of([eng.manager.params[j] for j in eng.hooks.owners.owned.get(module, ())])
            return f"{kind} of module {module!r} (chunks {list(ids)})"

        detail = "; ".join(f"rank {r}: {at(r)}" for r in range(len(seqs)))
        raise CollectiveMismatchError(
            f"[rank {comm.all_rank}] the warm-up step used modules in different orders on different ranks; "
            f"first difference at moment {i}: {detail}. Every rank must run the same modules in the same order "
            "(no data-dependent skipping of modules that own parameters)."
        )

    def follow_keys(self, *, training: bool) -> None:
        """Repack for parameters whose chunk key changed since the last layout: ``requires_grad`` flipped (before a
        training micro-batch), or read with autocast off ([Note: parameters read outside autocast]; before any
        micro-batch that holds no gradients, outside the warm-up, whose own repack moves them)."""
        if training:
            added = follow_added_groups(self.engine)
            if self.follow_requires_grad() or added:  # one repack for both (a group added with its unfreezing)
                self.replan(Replan.REQUIRES_GRAD if not added else Replan.PARAM_GROUPS)
        marks = self.engine.hooks.outside_autocast
        if marks.pending and self.engine._no_grads_held and self.phase in (WarmUp.UNTRACED, WarmUp.PLANNED):
            marks.take()
            self.replan(Replan.OUTSIDE_AUTOCAST)

    @engine_reads
    def follow_requires_grad(self) -> bool:
        """The chunk keys of parameters frozen or unfrozen since the last layout, for a repack ([Note: requires_grad
        changed]); whether any changed.

        [Note: requires_grad changed]
        A chunk holds trainable or frozen parameters, never both: only trainable chunks have gradient buffers and
        gradient hooks. A parameter whose ``requires_grad`` a user flipped after packing (unfreezing a backbone at
        some epoch) was silently never trained. Before each training micro-batch the flags are compared with the
        layout's; on a change the model is repacked as at the end of the warm-up (the same chunk-size rule and
        trace, the values and optimizer state moved by piece), the optimizers rebound and the new trainable
        parameters' gradient hooks installed. A parameter in an optimizer's param groups steps from its first
        gradient on, as in PyTorch; one frozen after it stepped keeps its value and its optimizer state (the carrier
        moves state by parameter, whatever chunk it lands in), so unfrozen again it goes on where it stopped.
        Inside gradient accumulation a change is refused: the step's gradients so far are laid out by the old
        flags. Several ranks must change the same flags at the same micro-batch, as with any module they run."""
        eng = self.engine
        mgr = eng.manager
        changed = [s.name for p, s in zip(mgr.params, mgr.specs, strict=True) if p.requires_grad != s.key.requires_grad]
        if not changed:
            return False
        if not eng._no_grads_held:
            raise ChunkError(
                f"requires_grad of {', '.join(map(repr, changed[:5]))}{' ...' if len(changed) > 5 else ''} changed "
                "inside a step whose gradients are being accumulated; change it before a step's first micro-batch "
                "(in on_train_epoch_start, or in on_train_batch_start at an accumulation boundary)."
            )
        mgr.specs = [
            dataclasses.replace(s, key=dataclasses.replace(s.key, requires_grad=p.requires_grad))
            for p, s in zip(mgr.params, mgr.specs, strict=True)
        ]
        return True
