"""``ChunkEngine``: one object that runs a module's training on chunks, with plain torch.

It owns the manager, the placement policy, the hooks and the optimizer bindings, and says when each runs:

1. ``__init__``: pack in registration order (no trace yet), place shards as the policy says before a trace exists,
   bind the optimizers, install hooks, and refuse a limit that cannot hold even one module's chunks.
2. the first training micro-batch is the warm-up: the tracer records moments.
3. ``warm_up.replan(Replan.WARM_UP)`` (at the first optimizer step): check the limit against the traced working set
   and activations, choose the chunk size, repack in first-use order, place shards from the trace, rebind the
   optimizers (state moves along by parameter); [Note: the warm-up's phases] in ``warmup.py`` for the phases and
   the other re-plans.
4. each step: ``prepare_step`` (gradients onto the master views), unscale / clip, the optimizer's own ``step()``,
   ``finish_step`` (write the low-precision copies back, free gradients).
5. ``teardown``: parameters get their full trained values back.

No ``lightning`` import here or below.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..chunks.chunk import Tier
from ..chunks.materialize import DeferredInit
from ..chunks.packing import Layout
from ..chunks.repack import FromModule
from ..comm.buffers import BufferSync
from ..comm.collectives import Collectives
from ..comm.reduce import agree_on_grads
from ..config import ChunkConfig, DtypePolicy, format_bytes
from ..files.weights import ModuleWeights
from ..memory.consolidate import load_module_state_dict, module_state_dict, unpack, whole_model_fits
from ..memory.full_params import check_stray_writes, stray_write
from ..optim.binding import OptimizerBinding, OptimizerStateCarrier
from ..optim.early_step import EarlyStep
from ..optim.ema import Extras, ShardedEMA
from ..optim.gradients import clip_grad_norm, unscale_and_check
from ..optim.kept_state import KeptOptimizerState, unbind_after_fit
from ..optim.scaler import DynamicLossScaler
from ..schedule.growth import InputGrowth
from ..schedule.placement import ChunkView
from ..state.load import PendingOptimizerState
from ..system import host_heap
from ..system.host_heap import keep_freed_heap, map_large_blocks, release_freed_memory, release_pinned_cache
from ..system.page_cache import page_cache_room
from .description import EngineDescription
from .raised import end_raised_backward
from .recompute import apply_activation_checkpointing
from .state_offload import StateOffload
from .warmup import Replan, WarmUp, WarmUpPlanner

_log = logging.getLogger(__name__)


class ChunkEngine:
    def __init__(
        self,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        *,
        config: ChunkConfig | None = None,
        dtypes: DtypePolicy | None = None,
        device: torch.device | None = None,
        collectives: Collectives | None = None,
        deferred: DeferredInit | None = None,
        weights: ModuleWeights | None = None,
    ) -> None:
        """``deferred``: a meta-device model initialised chunk by chunk as packed ([Note: deferred initialisation]);
        ``weights``: values read as the chunks are built ([Note: streamed weight loading]): no rank holds it whole."""
        apply_activation_checkpointing(module, (config or ChunkConfig()).activation_checkpointing)  # before the hooks
        desc = self.description = EngineDescription.of(
            module, optimizers, config=config, dtypes=dtypes, device=device, collectives=collectives
        )
        self.config, self.module, self.manager, self.policy = desc.config, module, desc.manager, desc.policy
        self.hooks, self.bindings, self.layouts = desc.hooks, desc.bindings, desc.layouts
        self._optim_bytes = desc.optim_bytes
        self._heap_in_backward: Callable[[bool], None] = host_heap.no_switch  # called with ``running``
        if self.config.host_memory_limit is not None:  # the user bounded host memory: chunk-sized blocks off the heap
            map_large_blocks()
        elif self.config.keep_freed_heap and self.manager.device.type == "cpu":  # [Note: the heap between steps]
            keep_freed_heap()
            self._heap_in_backward = host_heap.switch_in_backward(self.manager.params)
        self.hooks.on_trace_done = lambda trace: self.warm_up.traced(trace)
        self.hooks.on_backward_start = self._backward_starts
        self.hooks.on_backward_end = self._backward_ends
        # [Note: stepping in backward]: with no optimizer (evaluation only) there is nothing to step
        self.early = EarlyStep(self.manager, self.bindings) if self.config.step_in_backward and self.bindings else None
        self.manager.grads.given_back_when_packed = self.early is not None  # in ``_place``
        self.scaler: DynamicLossScaler | None = None
        self.ema: ShardedEMA | None = None  # an average of the weights, when asked for ([Note: a sharded EMA])
        grow = self.config.replan_when_inputs_grow and self.manager.limit is not None
        self.growth = InputGrowth(self.comm, enabled=grow)
        self.buffers = BufferSync(self.module, self.comm)  # enabled by the strategy while fitting
        self._no_grads_held = True  # before the first micro-batch, and after each optimizer step
        self.warm_up: WarmUpPlanner = WarmUpPlanner(self)  # [Note: the warm-up's phases] in warmup.py
        self.offload = StateOffload(self)  # [Note: offloading states between phases] in state_offload.py
        self._agreed = False  # the ranks voted on which parameters got gradients since the last backward began
        self._accumulating = False  # inside ``accumulating()``: this micro-batch's backward is not followed by a step
        self.last_grad_norm: float | None = None
        self.kept_optimizer_states: dict[int, KeptOptimizerState] = {}  # [Note: optimizer state after fit]
        self.pending_state: PendingOptimizerState | None = None  # [Note: optimizer state read after the warm-up]
        try:
            device = self.manager.device
            layout = self.layouts.choose(list(range(len(self.manager.params))), trace=None)
            views, tiers = self.description.plan_tiers(layout, trace=None)
            self.hooks.install()
            self.layouts.check_limit_before_trace(layout, views, tiers)
            source = FromModule(self.manager.params, deferred=deferred, weights=weights)
            self._place(layout, views, tiers, source=source)  # several ranks: parameters start from rank 0's values
            source.finish(buffer_device=device)
            # several ranks: every buffer starts from rank 0's value, as DDP (and FSDP's ``sync_module_states``) do
            self.buffers.broadcast()
        except BaseException:
            self.hooks.remove()
            self.manager.close()  # a disk tier's scratch files go now, not at exit
            raise

    # ================================================================= layout
    @property
    def comm(self) -> Collectives:
        return self.manager.comm

    def _place(
        self, layout: Layout, views: list[ChunkView], tiers: dict[int, Tier], *, source: FromModule | None = None
    ) -> None:
        self.manager.readers.settle()  # a save in flight reads the chunks a repack replaces
        self.layouts.check_placement(views, tiers)
        on_disk = sum(v.disk_bytes for v in views if tiers[v.chunk_id] is Tier.DISK)
        if on_disk:  # before anything is written: the directory must be usable and hold the shards
            self.manager.tiers.disk.check_room(
                on_disk,
                f"{sum(t is Tier.DISK for t in tiers.values())} of {len(views)} "
                "chunks' masters, gradient shards and optimizer state",
            )
        if self.manager.limit is not None:
            # a repack reads the old chunks' shards, never their payloads: those the last step left resident would
            # only crowd the new chunks, each built with its payload, under the limit
            for c in self.manager.chunks:
                if c.is_resident and c.is_evictable and not c.aliased:
                    self.manager.release(c)
        carrier = OptimizerStateCarrier(self.manager, self.bindings) if self.manager.chunks else None
        extras = Extras(carrier, self.ema) if carrier is not None and self.ema is not None else carrier
        self.manager.pack(layout, tiers, extras=extras, source=source, optim_bytes=self._optim_bytes)
        if self.ema is not None:
            self.ema.after_repack()
        self.manager.reserve_optimizer_state(self._optim_bytes)
        for k, b in enumerate(self.bindings):
            b.bind(carrier.state_for(k) if carrier is not None else None)
        if self.early is not None:  # a chunk that stepped in backward had given its gradient shard back: still so
            for b in self.bindings:
                b.slots.all()  # the views of the gradient shards, made while they have memory
            for c in self.manager.chunks:
                if c.trainable and not any(t.has_grad for t in c.tensors):
                    with self.manager.ledger.tracked(c):
                        c.release_grad(None)
        release_pinned_cache()  # [Note: pinned blocks a repack leaves behind] in host_heap.py

    # ================================================================ warm-up
    @property
    def warmed_up(self) -> bool:
        """Whether the chunks are packed and placed from a warm-up trace."""
        return self.warm_up.phase is WarmUp.PLANNED

    # ================================================================ steps
    @contextlib.contextmanager
    def micro_batch(self, *, training: bool, input_bytes: int | None = None) -> Iterator[Any]:
        """Wrap one training micro-batch or evaluation step. Yields ``outputs(obj)`` for the step's outputs.

        The warm-up is finalized at the first optimizer step (``prepare_step``), where every gradient has been
        reduced into the shards, so a repack never has to move gradients still in flight. ``input_bytes``: the size
        of what the step was handed; under a device limit a micro-batch larger than any the trace saw is traced
        again ([Note: inputs that grow after the warm-up] in ``growth.py``)."""
        end_raised_backward(self)  # [Note: a backward that raised] in raised.py: a loop that drove the engine itself
        if self.hooks.tracer.recording:  # a warm-up forward with no backward: take what it saw
            self.hooks.end_backward()
        check_stray_writes(self.manager)  # [Note: parameters outside a step]
        self.offload.reload()
        self.warm_up.follow_keys(training=training and torch.is_grad_enabled())
        phase = self.warm_up.phase
        record = training and phase is not WarmUp.PLANNED and torch.is_grad_enabled()
        if training and torch.is_grad_enabled():
            grew = self.growth.must_retrace(input_bytes, recording=record)
            # a module adopted a parameter it read ([Note: parameters read outside their owner] in reads.py)
            adopted = self.hooks.owners_changed and phase in (WarmUp.TRACED, WarmUp.PLANNED)
            self.hooks.owners_changed = False
            if grew or adopted:
                self.warm_up.replan(Replan.INPUTS_GREW if grew else Replan.OWNERS_CHANGED)
                record = True
            self._no_grads_held = False
        if record:
            self.warm_up.enter(WarmUp.RECORDING)
        self.buffers.before_forward(accumulating=self._accumulating)  # [Note: buffers as DDP syncs them]
        with self.hooks.step_scope(training=training, record=record) as outputs:
            yield outputs

    def after_backward(self) -> None:
        """Safety net for a backward in which no hook fired, or that raised ([Note: a backward that raised] in
        ``raised.py``: the exception leaving ``backward``, or a user's ``backward`` hook that caught it). Idempotent."""
        self._heap_in_backward(False)  # a backward that delivered no gradient, or raised, did not say it ended
        end_raised_backward(self)
        if self.hooks.tracer.recording:
            self.hooks.end_backward()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches that do not step: gradients stay in each rank's gradient payloads, unreduced."""
        self.manager.grads.sync = False
        try:
            with self.accumulating():
                yield
        finally:
            self.manager.grads.sync = True

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Micro-batches not followed by a step: no chunk steps in their backward ([Note: stepping in backward])."""
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def _bindings(self, optimizer: torch.optim.Optimizer | None) -> list[OptimizerBinding]:
        """The binding of ``optimizer`` (the one being stepped), or every binding when ``None``."""
        if optimizer is None:
            return self.bindings
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        for b in self.bindings:
            if b.optimizer is optimizer:
                return [b]
        raise ValueError(
            f"{type(optimizer).__name__} is not one of the optimizers this engine was built with "
            "(chunk_offload can only step optimizers returned by configure_optimizers)."
        )

    def _backward_starts(self) -> None:
        """A backward starts: gradients that ``zero_grad()`` cleared since they were attached are forgotten
        ([Note: zero_grad on a rebound optimizer] in ``optim/grad_slots.py``); the ranks will vote again."""
        for b in self.bindings:
            b.slots.sync_zero_grad()
        self._agreed = False
        self._heap_in_backward(True)  # [Note: the heap between steps] in system/host_heap.py
        # not in the warm-up, nor in a micro-batch traced again: the repack after its backward rebinds the optimizer
        planned = self.warm_up.phase is WarmUp.PLANNED
        self.manager.reducer.replicas.defer = planned and self._accumulating  # [Note: replicas summed once a step]
        if self.early is not None:
            self.early.active = planned and not self._accumulating
            if self.early.active:
                self.manager.readers.before_change()  # chunks step from here on
            self.early.begin()

    def _backward_ends(self) -> None:
        """As in PyTorch, after backward every view holds its gradient (this rank's, until the vote)."""
        self._heap_in_backward(False)
        if self.early is not None:
            self.early.backward_ended()
            self.manager.grads.low.widen_all()  # the chunks not stepped in it: [Note: gradients in bf16 until ...]
        for b in self.bindings:
            b.slots.attach()

    def prepare_step(self) -> None:
        """Before an optimizer is stepped or gradients are read: forget what ``zero_grad()`` cleared, finish the
        warm-up (a repack rebinds every optimizer), agree across ranks on which parameters got gradients, and
        attach them to the views of every optimizer. Idempotent until the next backward: clipping in a manual
        ``training_step`` before ``opt.step()``, the step itself and a second optimizer's step may all ask."""
        for b in self.bindings:
            b.slots.sync_zero_grad()
        if self.warm_up.phase is WarmUp.TRACED:
            self.warm_up.replan(Replan.WARM_UP)
            self._backward_ends()
        self.settle_state()
        if not self._agreed:
            self._agreed = True
            if self.comm.world_size > 1:  # the vote can add gradients other ranks got: attach again
                agree_on_grads(self.manager)
                self._backward_ends()
            if self.config.host_memory_limit is not None:  # [Note: a fixed mmap threshold] in host_heap.py
                release_freed_memory()  # backward freed the activations: give the heap's holes back before the step
            if self.manager.readers.drop_done():  # [Note: pinned blocks a repack leaves behind]
                release_pinned_cache()

    def settle_state(self) -> None:
        """Read a resumed optimizer state left for the first step ([Note: optimizer state read after the warm-up])."""
        pending, self.pending_state = self.pending_state, None
        if pending is not None:
            pending.load(self)

    def grads_ready(self, what: str, *, norm_clip: bool = False) -> None:
        """Before gradients are read or written outside the step: agreed on, attached, and not stepped away. While
        chunks step on a guess only the norm clip may touch them: it checks the guess ([Note: speculating past the
        norm and the overflow]); a change made elsewhere would miss the chunks stepped already."""
        if self.early is not None and not (norm_clip and self.early.speculation is not None):
            raise ValueError(
                f"{what} is not possible with step_in_backward=True: each chunk steps during backward and "
                "its gradients are gone after it ([Note: stepping in backward]). Turn the one or the "
                "other off (for Lightning's clipping: gradient_clip_val=None; with host_memory_limit set, "
                "step_in_backward=None turns it on: set step_in_backward=False)."
            )
        self.prepare_step()

    def grads(self, optimizer: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
        self.grads_ready("reading the gradients after backward")
        return [g for b in self._bindings(optimizer) for g in b.slots.grads()]

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, optimizer: torch.optim.Optimizer | None = None
    ) -> torch.Tensor:
        """Clip ``optimizer``'s gradients by their global norm over every shard of every rank; returns that norm
        (``gradients.clip_grad_norm``: bit-exact with ``torch.nn.utils.clip_grad_norm_`` on one rank)."""
        self.grads_ready("clipping gradients by norm", norm_clip=True)
        total, coef = clip_grad_norm(
            [p for b in self._bindings(optimizer) for p in b.slots.grad_chunks()], max_norm, norm_type, self.manager
        )
        if self.early is not None and self.early.speculation is not None:
            self.early.speculation.clipped(coef)  # [Note: speculating past the norm and the overflow]
        self.last_grad_norm = float(total)
        return total

    def clip_grad_value_(self, clip_value: float, optimizer: torch.optim.Optimizer | None = None) -> None:
        if self.early is not None and self.early.clip_value == clip_value:
            return  # each chunk clipped as it stepped, in backward or after it ([Note: clipping by value in backward])
        for g in self.grads(optimizer):
            g.clamp_(min=-clip_value, max=clip_value)

    def unscale_and_check(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """fp16: unscale ``optimizer``'s gradients; True when some rank overflowed (every rank then skips)."""
        assert self.scaler is not None
        self.prepare_step()
        spec = self.early.speculation if self.early is not None else None
        done = spec.unscaled if spec is not None else set()  # [Note: speculating past the norm and the overflow]
        pairs = [p for b in self._bindings(optimizer) for p in b.slots.grad_chunks() if p[0].chunk_id not in done]
        found = unscale_and_check(pairs, self.scaler, self.manager, found=spec is not None and spec.overflowed)
        if found and self.early is not None:
            self.early.roll_back()
        return found

    def step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)``, disk-tier chunks one at a time.

        [Note: stepping disk shards] in ``optim/disk_stepper.py``."""
        # nothing a disagreement computed is kept ([Note: checking once a micro-batch])
        self.manager.comm.verify_issued()
        self.manager.reducer.replicas.refuse_owed()
        self.manager.readers.before_change()  # [Note: training beside a save] in state/background_save.py
        with self.manager.clock.measure("optimizer"):
            if self.early is not None:
                return self.early.step_rest(**kwargs)
            return self._bindings(optimizer)[0].step(**kwargs)

    def finish_step(self, *, stepped: bool, optimizer: torch.optim.Optimizer | None = None) -> None:
        """After ``optimizer`` stepped (or skipped): write its chunks' compute-dtype copies back. Gradients stay
        until ``zero_grad()``, as in plain PyTorch."""
        bindings = self._bindings(optimizer)
        self._no_grads_held = True
        if self.early is not None:
            self.early.finish()
        fresh = {c for b in bindings for c in b.fresh_low}
        for b in bindings:  # [Note: group state in partial steps] in optim/partial_steps.py
            b.fresh_low = set()
            b.partial.ended() if stepped else b.partial.undone()
        if stepped and self.early is not None and not self.manager.optim_state_made:
            release_pinned_cache()  # what this first step gave back ([Note: gradient shards pinned to the byte])
        if stepped:
            self.manager.optim_state_made = True
            with self.manager.clock.measure("optimizer"):  # the compute-dtype copies are part of the step's cost
                self.manager.write_back(
                    None if optimizer is None else [g for b in bindings for g in b.chunk_groups()], fresh=fresh
                )

    # ================================================================ results
    def memory_stats(self) -> dict[str, float]:
        out = self.manager.stats()
        out["nonmodel_peak_bytes"] = self.hooks.moments.trace.nonmodel_peak_bytes if self.hooks.moments.trace else 0
        if self.scaler is not None:
            out["loss_scale"] = self.scaler.scale
        if self.early is not None:
            out.update(self.early.stats())
        if self.ema is not None:
            out.update(self.ema.stats())  # this rank's share of the average ([Note: a sharded EMA])
        if self.last_grad_norm is not None:
            out["grad_norm"] = self.last_grad_norm  # the global norm the last norm clipping saw
        if self.growth.enabled:
            out["replans"] = self.growth.replans  # traced again because the inputs grew
        out.update(self.comm.moved)  # bytes of chunk collectives since set-up, by kind
        out.update(self.manager.clock.stats())  # seconds by cause since set-up ([Note: where a step's time goes])
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's ``state_dict`` with every parameter's full trained value (host tensors); a collective."""
        return module_state_dict(self.manager, self.module)

    def load_full_state_dict(self, state_dict: Mapping[str, Any], *, strict: bool = True) -> None:
        """A plain ``state_dict`` (full tensors) into the masters and the buffers (``load_module_state_dict``)."""
        load_module_state_dict(self.manager, self.module, state_dict, strict=strict)

    def teardown(
        self,
        *,
        materialize: bool | None = True,
        optimizer_state: bool | None = None,
        device: torch.device | None = None,
    ) -> None:
        """Remove hooks and give the parameters their full values back (empty when ``materialize`` is off), on
        ``device`` (the host by default), chunk by chunk; the optimizers their state as ``optimizer_state`` (default:
        the config's) says ([Note: optimizer state after fit]). Without ``materialize`` nothing here is a collective,
        so it is safe after another rank failed."""
        self.hooks.between.disarm()  # first: nothing below may leave the check in the thread's modes
        self._heap_in_backward(False)
        if self.early is not None:
            self.early.close()
        save_failed: BaseException | None = None
        try:
            self.manager.readers.settle()  # a save in flight reads the chunks unpacked here
        except BaseException as e:  # noqa: BLE001 - raised once the parameters are back
            save_failed = e
        if optimizer_state is None:
            optimizer_state = self.config.materialize_optimizer_state
        if optimizer_state is None:  # where it is the state the rank held: [Note: optimizer state after fit]
            optimizer_state = self.comm.world_size == 1
        if materialize is None:  # [Note: the model after fit] in consolidate.py
            materialize, need, share = whole_model_fits(
                self.manager, optimizer_state=optimizer_state, room=page_cache_room()
            )
            if not materialize and self.comm.all_rank == 0:
                warnings.warn(
                    f"the trained parameters were left empty at the end of fit: the whole model ("
                    f"{format_bytes(need)}) does not fit in a rank's share of the host memory available "
                    f"({format_bytes(share or 0)}). The weights are in the "
                    "checkpoints (`lightning-chunk consolidate` writes one file); materialize_on_teardown=True builds "
                    "them anyway. [Note: the model after fit]",
                    stacklevel=2,
                )
        lost = stray_write(self.manager, "after the last step") if materialize else None  # raised once torn down
        if materialize:  # a resumed state no step read yet goes back with the model (no collective without it)
            self.settle_state()
        self.hooks.remove()
        for b in self.bindings:
            b.slots.detach()
            kept = unbind_after_fit(self.manager, b, materialize=materialize, whole_state=optimizer_state)
            if kept is not None:
                self.kept_optimizer_states[id(b.optimizer)] = kept
        unpack(self.manager, materialize=materialize, device=device)
        self.manager.close()
        release_pinned_cache()
        if save_failed is not None or lost is not None:
            raise save_failed or lost  # type: ignore[misc]
