"""Runtime hooks: where module execution meets the chunk manager.

[Note: hooks and autograd with freed storage]
- A forward pre-hook on every module that owns parameters ticks the clock and asks for its chunks: the placement
  plan evicts and prefetches, the manager gathers, the module's tensors go to COMPUTE.
- The forward post-hook moves them to HOLD_AFTER_FWD (HOLD without grad mode) and puts a hook on each output tensor
  that requires grad. That tensor hook fires when the gradient for the output is ready, i.e. right *before* the
  module's backward: it re-gathers the chunks (pre-backward).
- Autograd saved the parameters themselves (views of the payload). Releasing a payload resizes its storage to 0
  without touching the views; re-gathering resizes it back and copies in place, so saved tensors see valid data
  again. Parameter version counters are not bumped by the copy (``param.data`` has its own counter), so autograd's
  saved-tensor checks stay quiet.
- A post-accumulate-grad hook on each trainable parameter moves ``param.grad`` into the chunk's gradient shard and
  clears it, so gradients never pile up on the module. The last hook of a chunk (or the end of backward, for
  parameters that got none) reduces the chunk.
- The end of backward is a callback queued on the autograd engine by the first backward hook; ``end_backward`` is
  idempotent so callers may call it again.

[Note: recomputation]
Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's ``activation_checkpointing_enable()``) runs a
block's forward again inside backward, so the forward hooks fire while autograd runs a backward
(``moments.in_backward``). Each recomputed module gathers its chunks as in any forward, and its post-forward lets them
go as usual, with one exception: tensors that a backward had in use (COMPUTE) when the recomputation of their
module began stay in use. With ``use_reentrant=False`` the recomputation runs inside the backward node of the
block's last module, whose pre-backward hook has already gathered its chunks: demoting them after the
recomputed forward let host placement release that payload, and the node then read its saved weight from freed
storage. At each recomputation moment the warm-up trace records the parameters the backward keeps in use
(``Moment.pinned_params``: the module whose backward asked for the recomputation), so the chunk size and the
limit check count them beside the recomputed module's; before the trace the automatic chunk size leaves room for
two modules' chunks for the same reason.

A module owning frozen parameters, or called more than once a step, lets them go as each call's backward ends
([Note: frozen parameters in backward] and [Note: a module called again before its backward] in
``module_backward.py``).

[Note: hooks under torch.compile]
A compiled module (``torch.compile(model)`` of a submodule, or of the LightningModule's ``forward``) still runs
these hooks, each as it would run eagerly: every hook is ``torch.compiler.disable``d, so dynamo breaks its graph
at each module that owns parameters and calls the hook between the compiled pieces (FSDP2 does the same with its
hooks). Traced instead, a hook's storage resizes and collectives would become graph operations replayed on
whatever storage the parameter had at trace time. Between the hooks the graphs see ordinary parameters, whose
storage the hook has just filled. The warm-up's saved-tensor hooks (``tracer.py``) are disabled the same way:
they must count the real storages autograd keeps, not run as a compiled frame of their own.

The root module's own parameters (a LightningModule that holds parameters directly) are gathered for the whole
step by ``step_scope``, which also treats the step's outputs as the root's outputs for backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..chunks.chunk import Chunk, TensorInfo
from ..chunks.states import TensorState
from ..comm.sequence import GRADIENTS
from ..errors import ChunkError
from ..memory.full_params import looked_at
from ..memory.grad_graph import GradGraphKeeper
from ..memory.manager import ChunkManager
from ..memory.master_writes import refresh_outside_a_step, refresh_where_written, refuse_written_in_a_step
from ..memory.module_state import state_dict_hooks
from ..schedule.placement import PlacementPolicy
from ..schedule.tracer import BACKWARD, FORWARD, POST_FORWARD, ROOT, MemoryTracer, MomentKind, Trace
from ..system.host_heap import ENGINE_BLOCKS
from . import fast_paths
from .batches import tensors_in
from .between_steps import BetweenSteps
from .module_backward import ModuleBackwards
from .moments import MomentClock, in_backward
from .outside_autocast import OutsideAutocast
from .owners import ModuleOwners, leaf_hint
from .pieces import GradPieces
from .reads import (
    ReleasedReads,
    current_reader,
    reading,
    refuse_clipping_without_gradients,
    unwatch,
    unwatched,
    watch,
)

S = TensorState
_eager = torch.compiler.disable  # see [Note: hooks under torch.compile]
# frames of this file hold a module as ``self`` without being its code ([Note: parameters read outside their owner])
_NOT_READERS = frozenset({__file__})
_USABLE = frozenset({S.HOLD, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD, S.COMPUTE})


class ChunkHooks:
    def __init__(self, module: torch.nn.Module, manager: ChunkManager, policy: PlacementPolicy) -> None:
        self.module = module
        self.manager = manager
        self.policy = policy
        self.tracer = MemoryTracer(manager.is_payload_view, manager.device, manager.allocated_device_bytes)
        self.owners = ModuleOwners(module, manager, policy.config.leaf_modules)
        self.moments = MomentClock(manager, policy, self.owners, self.tracer)
        self._handles: list[Any] = []
        self._grads_watched: set[int] = set()  # parameters whose gradient hook is installed
        self._grads_arrived = False  # a parameter's gradient landed in the backward running now
        self.on_trace_done: Callable[[Trace], None] | None = None
        self.on_backward_start: Callable[[], None] | None = None  # before the first gradient of a backward lands
        self.on_backward_end: Callable[[], None] | None = None  # every gradient of the backward is in its shard
        self._pre_backward: dict[str, Callable[[torch.Tensor], None]] = {}  # module key -> its output tensors' hook
        for key in self.owners.owned:
            self._pre_backward[key] = self._make_pre_backward(key)  # the root's too: step_scope hooks its outputs
        # module key -> its parameters a backward had in use when a recomputation of the module began
        self._pinned_by_backward: dict[str, frozenset[int]] = {}
        # why no forward may run now ([Note: parameters outside a step] in full_params.py), or None
        self.closed: str | None = None
        self.where: Callable[[], str | None] = lambda: None  # the caller's hook, for a forward outside a step
        self._rolled = False  # [Note: a forward outside a step] in group.py: this forward's roll call is done
        self._in_step = False  # inside ``step_scope``
        # parameters a backward with create_graph=True used, kept for the graph it built ([Note: double backward])
        self.grad_graph = GradGraphKeeper(manager)
        self.pieces = GradPieces(manager)  # [Note: gradients in pieces]
        self.owners_changed = False  # a module adopted a parameter it read: the trace must be taken again
        self._held: set[int] = set()  # parameters read by iteration in this micro-batch, in use to its backward's end
        self.backwards = ModuleBackwards(manager, self.owners, self._held)  # each call's backward end, where it matters
        self._evaluated = False  # an evaluation step ran (the first is checked for reads of released parameters)
        self.outside_autocast = OutsideAutocast(manager)  # [Note: parameters read outside autocast]
        parked = lambda: not self._in_step and any(c.params_parked for c in manager.chunks)  # noqa: E731
        self.between = BetweenSteps(self.owners.param_name, manager.index_of, parked, speaks=manager.comm.all_rank == 0)

    # ============================================================ installation
    def install(self) -> None:
        for key in self.owners.owned:
            self._hook_forward(key)
        self._handles += fast_paths.install(self.module)  # [Note: torch's fast paths in checked steps]
        self._handles += state_dict_hooks(
            self.module, self.manager, lambda: self.closed is not None, lambda: current_reader() == self._read
        )
        is_open = lambda: self.closed is not None  # noqa: E731
        watch(self.module, looked_at(self.manager, is_open, self.between.arm), self.owners.param_name)  # reads.py
        self.watch_grads()
        keys = list(self.owners.index)

        def name(chunk: int, module: int) -> str:
            """A collective's chunk and the module it was issued for; without one (a reduce-scatter, launched when
            backward completes the chunk) the modules whose parameters the chunk holds."""
            if 0 <= module < len(keys):
                return f"chunk {chunk} (module {keys[module]!r})"
            owners = self.owners.holders_of(chunk)
            more = f" and {len(owners) - 3} more" if len(owners) > 3 else ""
            return f"chunk {chunk}" + (f" (parameters of {', '.join(map(repr, owners[:3]))}{more})" if owners else "")

        self.manager.comm.names = name

    def _hook_forward(self, key: str) -> None:
        mod = self.owners.modules[key]
        if mod is self.module:
            return  # the root: step_scope is its forward
        self._handles.append(mod.register_forward_pre_hook(self._make_pre_forward(key, mod)))
        self._handles.append(
            mod.register_forward_hook(self._make_post_forward(key, mod), with_kwargs=True, always_call=True)
        )

    def watch_grads(self) -> None:
        """Hook every trainable parameter's gradient (once each): at install, and after parameters were unfrozen
        ([Note: requires_grad changed] in ``runtime/engine.py``)."""
        for i, p in enumerate(self.manager.params):
            if p.requires_grad and i not in self._grads_watched:
                self._grads_watched.add(i)
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def remove(self) -> None:
        self.between.disarm()
        unwatch(self.module)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._grads_watched.clear()

    # ================================================================= moments
    def _use(self, key: str, kind: MomentKind) -> None:
        if self.closed is not None:
            raise ChunkError(self.closed)
        outside = kind == FORWARD and not in_backward() and not self._in_step
        first = outside and not self._rolled
        if first:
            self._rolled = True
            self.manager.comm.roll_call(self.where())
            refresh_outside_a_step(self.manager)  # [Note: the optimizer's views written outside its step]
        elif outside and self.manager.comm.world_size == 1:  # no rank to agree with: this module's chunks
            refresh_where_written(self.manager, self.owners.chunks_of(key))
        moments = self.moments
        moments.current_module = self.owners.index.get(key, -1)
        before = moments.resident() if moments.recorder else None
        needed = moments.tick(kind, key)
        recompute = kind == FORWARD and in_backward()
        if kind == FORWARD and (moments.training or not self._in_step) and not recompute:  # [Note: the optimizer's ..
            refuse_written_in_a_step(self.manager, needed, key, in_step=self._in_step)
        moments.plan_and_run(needed)
        if kind == BACKWARD and torch.is_grad_enabled():  # create_graph=True: [Note: double backward]
            self.grad_graph.used(self.owners.owned.get(key, ()))
        in_use = []
        for i in self.owners.owned.get(key, ()):
            chunk, info = self.manager.lookup(self.manager.params[i])
            if recompute and info.state is S.COMPUTE:
                in_use.append(i)  # pinned by the backward that runs this recomputation: [Note: recomputation]
            if info.state in _USABLE:
                chunk.set_state(info, S.COMPUTE)
        if recompute:
            self._pinned_by_backward[key] = frozenset(in_use)
        if kind == FORWARD and not recompute and moments.training:
            self.pieces.forward(key, self.owners.owned.get(key, ()))
            if torch.is_grad_enabled():
                self.backwards.forward(key)
        # a module called again makes its gradient payloads as its gradients land ([Note: a module called again ...])
        moments.expect_gradients(kind, key, () if key in self.backwards.reused else self.owners.owned.get(key, ()))
        if before is not None:
            moments.record(kind, key, needed, before)

    def _done_forward(self, key: str) -> None:
        moments = self.moments
        before = moments.resident() if moments.recorder else None
        moments.tick(POST_FORWARD, key)
        if not in_backward():
            self.backwards.done_forward(key)
        new = S.HOLD_AFTER_FWD if torch.is_grad_enabled() else S.HOLD
        keep = self._pinned_by_backward.pop(key, frozenset())
        held = self._held
        for i in self.owners.owned.get(key, ()):
            chunk, info = self.manager.lookup(self.manager.params[i])
            if info.state is S.COMPUTE and i not in keep and i not in held:
                chunk.set_state(info, new)
        if self.policy.evict_after_use:
            moments.plan_and_run(())
        moments.expect_gradients(POST_FORWARD, key, ())
        if before is not None:
            moments.record(POST_FORWARD, key, (), before)

    def _read(self, param: torch.Tensor, by_attribute: bool) -> None:
        """A parameter was read during a step's forward: one no module has in use is adopted by the innermost
        running module (read by attribute) or held to the end of this micro-batch's backward (read by iteration)
        ([Note: parameters read outside their owner] in reads.py). Inside full_parameters() every one is whole."""
        mgr = self.manager
        if not by_attribute:  # torch's clip_grad_norm_ after a manual backward: its gradients are in the shards
            refuse_clipping_without_gradients(param, mgr.params)
        i = mgr.index_of.get(id(param))
        if i is None or self.closed is not None:
            return
        chunk, info = mgr.lookup(param)
        if info.state is S.COMPUTE or not (info.state in _USABLE or info.state is S.FREE):
            return
        key = self.owners.reader(_NOT_READERS)  # from the stack here: _take's has dynamo's frame of its disable
        if key is not None:
            self._take(key, chunk, info, i, by_attribute)

    @_eager  # a compiled forward's read gathers eagerly, as the hooks do ([Note: hooks under torch.compile])
    def _take(self, key: str, chunk: Chunk, info: TensorInfo, i: int, by_attribute: bool) -> None:
        mgr = self.manager
        with unwatched(), mgr.clock.measure("hooks"):
            if by_attribute:
                self._adopt(key, i)
            else:
                self._held.add(i)
            if chunk.is_resident:
                mgr.wait_ready(chunk)
            else:
                self.moments.gather_or_explain(chunk.chunk_id, (*self.owners.chunks_of(key), chunk.chunk_id))
            chunk.set_state(info, S.COMPUTE)

    def _adopt(self, key: str, index: int) -> None:
        """``key``'s module owns parameter ``index`` from now on; a module that owned none is hooked from its next call
        on (this call keeps the parameter in use to its end)."""
        if index in self.owners.owned.get(key, ()):  # read again after its co-owner let it go (a tied head): no change
            return
        if self.owners.adopt(key, index):
            self._pre_backward[key] = self._make_pre_backward(key)
            self.backwards.add(key)
            self._hook_forward(key)
        self.owners_changed = True

    # =================================================================== hooks
    def _make_pre_forward(self, key: str, owner: torch.nn.Module) -> Callable[..., None]:
        @_eager
        def hook(module: torch.nn.Module, args: Any) -> None:
            if module is not owner:
                return  # a deep copy of the module, which kept the hook: its parameters are plain tensors
            with self.manager.clock.measure("hooks"):
                self._use(key, FORWARD)
            if in_backward():  # [Note: parameters read outside autocast]
                self.outside_autocast.recomputing(True)

        return hook

    def _make_post_forward(self, key: str, owner: torch.nn.Module) -> Callable[..., None]:
        @_eager
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if module is not owner:
                return
            if in_backward():
                self.outside_autocast.recomputing(False)
            with self.manager.clock.measure("hooks"):
                self._done_forward(key)
                self._hook_outputs(key, output)
                self.backwards.hook_inputs(key, (args, kwargs))

        return hook

    def _hook_outputs(self, key: str, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for t in tensors_in(output):  # a dataclass or a UserDict too (batches.py)
            if t.requires_grad:
                t.register_hook(self._pre_backward[key])

    def _make_pre_backward(self, key: str) -> Callable[[torch.Tensor], None]:
        # made once per module at ``install``: wrapping a new closure with torch.compiler.disable at every forward
        # cost about 60 us a module output (a tenth of the hooks' time on one rank)
        @_eager
        def hook(grad: torch.Tensor) -> None:
            with self.manager.clock.measure("hooks"), ENGINE_BLOCKS:  # [Note: the heap between steps]
                self._queue_end_of_backward()
                self._use(key, BACKWARD)

        return hook

    def _on_grad(self, param: torch.Tensor) -> None:
        with self.manager.clock.measure("hooks"), ENGINE_BLOCKS:
            self._queue_end_of_backward()
            if param.grad is None:
                return
            self._grads_arrived = True
            grad = param.grad
            if grad.layout is not torch.strided:
                # nn.Embedding(sparse=True): the chunks' gradients are flat and dense, as FSDP's. The rows the
                # batch did not touch get zeros, which every dense-capable optimizer steps as plain PyTorch does
                # for a dense embedding (SparseAdam, which needs sparse gradients, is refused at set-up)
                grad = grad.to_dense()
            self.pieces.arrived(self.manager.lookup(param)[1])
            with self.manager.clock.measure("grad_copy"):
                self.manager.grads.accumulate(param, grad, self.moments.make_room)
            param.grad = None
            if self.tracer.recording:
                self.tracer.grad_arrived(self.manager.index_of[id(param)])

    def _queue_end_of_backward(self) -> None:
        if not self.moments.backward_queued:
            self.moments.backward_queued = True
            if self.tracer.recording:
                # the warm-up's backward has no trace, but this forward's moments (the same on every rank) say
                # the order backward completes the chunks in, near enough: reverse first use ([Note: reduce order])
                self.manager.grads.set_reduce_order(self.tracer.forward_first_use()[::-1])
            self.manager.reducer.begin_backward(traced=self.moments.trace is not None and not self.tracer.recording)
            self.between.disarm(remove=False)  # backward reads no placeholder (between_steps.py)
            self.between.grads_expected = True  # [Note: gradients read after the step]
            if self.on_backward_start is not None:
                self.on_backward_start()
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """All gradients of this backward are in: reduce the rest, finish the warm-up trace."""
        with self.manager.clock.measure("hooks"), ENGINE_BLOCKS:
            self._end_backward()

    def _end_backward(self) -> None:
        """[Note: a backward that delivers no gradient]
        ``torch.autograd.grad(out, inputs, create_graph=True)`` (a gradient penalty's first half) runs through the
        modules' backward hooks, so it queues a backward end like any other, but it accumulates no parameter
        gradient. Ending it as a gradient backward would close the micro-batch's gradients too early: with
        several ranks the forced drain reduced the gradients that earlier micro-batches had left in the gradient
        payloads (``sharded_accumulation=False``) apart from this micro-batch's, so the sum was rounded otherwise
        than DDP's; with ``step_in_backward=True`` the last micro-batch's chunks stepped there, before its own
        gradients (a wrong step, not a rounding). As with DDP, whose reducer waits for the gradient hooks, such a
        backward ends only its bookkeeping: states, the graph keeper, the rank check. Whether gradients arrived is
        part of the sequence the ranks compare, since one that reduces while another does not would pair
        collectives wrongly."""
        self.moments.backward_queued = False
        self.backwards.backward_ended()
        self._pinned_by_backward.clear()
        self.pieces.backward_ended()
        # [Note: a backward that delivers no gradient]
        arrived, self._grads_arrived = self._grads_arrived, False
        self.moments.sequence.add(GRADIENTS, "delivered" if arrived else "none delivered")
        # reduce first: a chunk whose gradients this rank did not all get reduces here, and the other ranks may be
        # waiting for that reduce-scatter, not yet in the check's collective
        self.manager.grads.end_backward(self.moments.make_room, grads_arrived=arrived)
        self.moments.sequence.check(self.manager.comm, self.owners.chunks_of, lambda keys: leaf_hint(self.module, keys))
        self.grad_graph.backward_ended()
        if arrived and self.on_backward_end is not None:
            self.on_backward_end()
        if self.tracer.recording:
            self.moments.trace = self.tracer.finish(len(self.manager.params))
            if self.on_trace_done is not None:
                self.on_trace_done(self.moments.trace)
        if self.policy.evict_after_use:
            self.moments.plan_and_run(())

    def held(self) -> frozenset[int]:
        """The parameters held by a read by iteration in this micro-batch ([Note: parameters read outside their
        owner] in reads.py)."""
        return frozenset(self._held)

    # ============================================================== step scope
    @contextlib.contextmanager
    def step_scope(self, *, training: bool, record: bool = False) -> Iterator[Callable[[Any], None]]:
        """One micro-batch (training) or one evaluation step. Yields ``outputs(obj)`` to register the step's outputs."""
        self.between.disarm()
        self.between.grads_expected &= training  # Lightning's zero_grad before validation: none in plain either
        self.grad_graph.reset()  # a graph built by a backward with create_graph=True that no backward consumed
        self._rolled = self._in_step = True  # in a step every rank runs the same forwards
        # parameters held by an iteration in the last micro-batch that are still in use (an evaluation step's, whose
        # backward never came) are free to go
        self.manager.let_go(self._held, S.HOLD)
        self._held.clear()
        self.manager.reset_states()
        self.pieces.reset()
        self.moments.new_step(training=training)
        self.backwards.reset()
        self._pinned_by_backward.clear()
        counting: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if record:
            self.tracer.start()
            counting = self.tracer.counter.counting()
        if ROOT in self.owners.owned:
            self._use(ROOT, FORWARD)
        registered = []

        def outputs(out: Any) -> None:
            registered.append(True)
            if ROOT in self.owners.owned:
                self._hook_outputs(ROOT, out)

        # the warm-up (and the first evaluation step) also checks every op for released parameters the watch
        # cannot see ([Note: parameters read outside their owner] in reads.py), and under mixed precision for
        # parameters read with autocast off ([Note: parameters read outside autocast])
        check = record or (not training and not self._evaluated)
        self._evaluated = self._evaluated or not training
        marks = self.outside_autocast if check and self.outside_autocast.active else None
        checks = ReleasedReads(self.owners.param_name, marks) if check else contextlib.nullcontext()
        with counting, reading(self._read), checks:
            yield outputs
        if marks is not None:
            marks.agree(self.manager.comm)
        self._rolled = self._in_step = False  # the next forward outside a step holds a roll call
        if ROOT in self.owners.owned:
            if training and torch.is_grad_enabled() and not registered:
                # backward would find the root's payload released after this step's forward, and read freed memory
                # (a segmentation fault, not an error) where its parameters are used
                params = self.manager.params
                names = [self.manager.lookup(params[i])[1].name for i in self.owners.owned[ROOT]]
                raise ChunkError(
                    f"the root module owns parameters directly ({', '.join(names)}), so a training step must register "
                    "its outputs before backward: `with engine.micro_batch(training=True) as outputs: loss = ...; "
                    "outputs(loss)` (ChunkOffloadStrategy does this for training_step's result)."
                )
            self._done_forward(ROOT)
        if not training:  # an evaluation step's outputs leave with it ([Note: checking once a micro-batch])
            self.manager.comm.verify_issued()
