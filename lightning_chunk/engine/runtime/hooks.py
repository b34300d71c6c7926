"""Runtime hooks: where module execution meets the chunk manager.

[Note: hooks and autograd with freed storage]
- A forward pre-hook on every module that owns parameters ticks the clock and
  asks for its chunks: the placement plan evicts and prefetches, the manager
  gathers, the module's tensors go to COMPUTE.
- The forward post-hook moves them to HOLD_AFTER_FWD (HOLD without grad mode)
  and puts a hook on each output tensor that requires grad. That tensor hook
  fires when the gradient for the output is ready, i.e. right *before* the
  module's backward: it re-gathers the chunks (pre-backward).
- Autograd saved the parameters themselves (views of the payload). Releasing a
  payload resizes its storage to 0 without touching the views; re-gathering
  resizes it back and copies in place, so saved tensors see valid data again.
  Parameter version counters are not bumped by the copy (``param.data`` has its
  own counter), so autograd's saved-tensor checks stay quiet.
- A post-accumulate-grad hook on each trainable parameter moves ``param.grad``
  into the chunk's gradient shard and clears it, so gradients never pile up on
  the module. The last hook of a chunk (or the end of backward, for parameters
  that got none) reduces the chunk.
- The end of backward is a callback queued on the autograd engine by the first
  backward hook; ``end_backward`` is idempotent so callers may call it again.

[Note: recomputation]
Activation checkpointing (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable()``) runs a
block's forward again inside backward, so the forward hooks fire while autograd runs a backward
(``_in_backward``). Each recomputed module gathers its chunks as in any forward, and its post-forward lets them
go as usual, with one exception: tensors that a backward had in use (COMPUTE) when the recomputation of their
module began stay in use. With ``use_reentrant=False`` the recomputation runs inside the backward node of the
block's last module, whose pre-backward hook has already gathered its chunks: demoting them after the
recomputed forward let host placement release that payload, and the node then read its saved weight from freed
storage. At each recomputation moment the warm-up trace records the parameters the backward keeps in use
(``Moment.pinned_params``: the module whose backward asked for the recomputation), so the chunk size and the
limit check count them beside the recomputed module's; before the trace the automatic chunk size leaves room for
two modules' chunks for the same reason.

[Note: frozen parameters in backward]
A trainable parameter leaves COMPUTE when its gradient lands. A frozen one (LoRA's base weights, a frozen
encoder in the middle of a model) never gets a gradient, so it used to stay in use from its module's
pre-backward to the end of backward: every frozen chunk pinned at once, and under a device limit the first
backward failed. So a module owning frozen parameters hooks its inputs that require grad (all of them at once,
``register_multi_grad_hook``): when their gradients are computed its backward is done, and its frozen
parameters go to HOLD_AFTER_BWD, free to be evicted. A count per module covers a module called several
times; a non-reentrant recomputation (whose inputs never get gradients) does not add to it.

[Note: hooks under torch.compile]
A compiled module (``torch.compile(model)`` of a submodule, or of the LightningModule's ``forward``) still runs
these hooks, each as it would run eagerly: every hook is ``torch.compiler.disable``d, so dynamo breaks its graph
at each module that owns parameters and calls the hook between the compiled pieces (FSDP2 does the same with its
hooks). Traced instead, a hook's storage resizes and collectives would become graph operations replayed on
whatever storage the parameter had at trace time. Between the hooks the graphs see ordinary parameters, whose
storage the hook has just filled. The warm-up's saved-tensor hooks (``tracer.py``) are disabled the same way:
they must count the real storages autograd keeps, not run as a compiled frame of their own.

The root module's own parameters (a LightningModule that holds parameters
directly) are gathered for the whole step by ``step_scope``, which also treats
the step's outputs as the root's outputs for backward.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from ..chunks.chunk import Role, Tier
from ..chunks.chunk import nbytes as tensor_nbytes
from ..chunks.states import TensorState
from ..comm.sequence import GRADIENTS, ModuleSequence
from ..config import format_bytes
from ..errors import ChunkError, DeviceMemoryLimitError
from ..memory.full_params import state_dict_hooks
from ..memory.grad_graph import GradGraphKeeper
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
from .leaves import LeafModules
from .reads import ReleasedReads, reading, unwatch, unwatched, watch
from .reads import __file__ as reads_file

S = TensorState
_eager = torch.compiler.disable  # see [Note: hooks under torch.compile]
_log = logging.getLogger(__name__)
# frames that hold a module as ``self`` without being its code: attribute look-ups, iteration, the read itself
_NOT_READERS = frozenset({torch.nn.modules.module.__file__, __file__, reads_file})
_DYNAMO = f"{os.sep}torch{os.sep}_dynamo{os.sep}"


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread: a forward then is a recomputation."""
    return torch._C._current_graph_task_id() != -1


_USABLE = frozenset({S.HOLD, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD, S.COMPUTE})
# disk chunks whose master files a CPU gather reads ahead of use ([Note: the gathers' reads ahead of use] in
# disk_storage.py)
READ_AHEAD_CHUNKS = 4


class ChunkHooks:
    def __init__(self, module: torch.nn.Module, manager: ChunkManager, policy: PlacementPolicy) -> None:
        self.module = module
        self.manager = manager
        self.policy = policy
        self.trace: Trace | None = None
        self.tracer = MemoryTracer(self._is_model_storage, manager.device, manager.allocated_device_bytes)
        self.position = -1  # moment within the current micro-batch
        self._occurrences: dict[tuple[str, str], int] = {}  # moments of each kind and module so far this step
        self._this_moment: tuple[str, str] = ("", "")  # (kind, module key) of the moment at ``position``
        self._previous_moment: tuple[str, str] = ("", "")  # and of the one before it
        self._freed_room = False  # the last plan released payloads for memory ([Note: moments with nothing to release])
        self._current_module = -1
        self.clock = 0  # moments since creation (for LRU)
        self.training = False
        self._handles: list[Any] = []
        self._grads_watched: set[int] = set()  # parameters whose gradient hook is installed
        self._backward_queued = False
        self._grads_arrived = False  # a parameter's gradient landed in the backward running now
        self.on_trace_done: Callable[[Trace], None] | None = None
        self.on_backward_start: Callable[[], None] | None = None  # before the first gradient of a backward lands
        self.on_backward_end: Callable[[], None] | None = None  # every gradient of the backward is in its shard
        # instrumentation is injected, never global: a callable that receives a MomentEvent per moment
        self.recorder: Callable[[MomentEvent], None] | None = None
        # module key -> indices of the parameters it owns directly; -> its chunk ids (per layout)
        self._owned: dict[str, tuple[int, ...]] = {}
        self._chunks_of: dict[str, tuple[int, ...]] = {}
        self._layout_seen: object = None
        self._key_index: dict[str, int] = {}
        self._sequence = ModuleSequence()  # the modules this micro-batch ran, compared across ranks
        self._pre_backward: dict[str, Callable[[torch.Tensor], None]] = {}  # module key -> its output tensors' hook
        self._post_backward: dict[str, Callable[[Any], None]] = {}  # module key -> its inputs' hook
        # module key -> calls with frozen parameters whose backward has not finished ([Note: frozen parameters ...])
        self._open_backward: dict[str, int] = {}
        # module key -> its parameters a backward had in use when a recomputation of the module began
        self._pinned_by_backward: dict[str, frozenset[int]] = {}
        # why no forward may run now ([Note: parameters outside a step] in full_params.py), or None
        self.closed: str | None = None
        # parameters a backward with create_graph=True used, kept for the graph it built ([Note: double backward])
        self.grad_graph = GradGraphKeeper(manager)
        self._modules: dict[str, torch.nn.Module] = {}  # module key -> module (not those inside a leaf)
        self._key_of: dict[int, str] = {}  # id(module) -> its key; inside a leaf, the leaf's
        self.owners_changed = False  # a module adopted a parameter it read: the trace must be taken again
        self._held: set[int] = set()  # parameters read by iteration in this micro-batch, in use to its backward's end
        self._evaluated = False  # an evaluation step ran (the first is checked for reads of released parameters)
        self._learn_owners()

    # ============================================================ installation
    def _learn_owners(self) -> None:
        """Which parameters each module owns directly (a leaf module: its whole subtree's, [Note: leaf modules]).
        Known from construction on, not from ``install``: the first layout's chunk size is chosen before the hooks
        go in, and it sizes each module's chunks from this (with it empty, the automatic chunk size saw no module's
        chunks and took a size whose first step failed)."""
        index_of = self.manager.index_of
        is_leaf = LeafModules(self.policy.config.leaf_modules)
        inside_leaf: set[int] = set()
        for name, mod in self.module.named_modules():
            if id(mod) in inside_leaf:
                continue  # a leaf above gathers its parameters
            key = name or ROOT
            self._modules[key] = mod
            self._key_of[id(mod)] = key
            leaf = is_leaf(mod)  # the root too: it then owns every parameter, gathered for the whole step
            if leaf:
                inside_leaf.update(id(m) for m in mod.modules() if m is not mod)
                self._key_of.update((id(m), key) for m in mod.modules())
            own = tuple(dict.fromkeys(index_of[id(p)] for p in mod.parameters(recurse=leaf) if id(p) in index_of))
            if not own:
                continue
            self._owned[key] = own
            self._key_index[key] = len(self._key_index)
            self._pre_backward[key] = self._make_pre_backward(key)  # the root's too: step_scope hooks its outputs
            self._post_backward[key] = self._make_post_backward(key)
        unmatched = is_leaf.unmatched()
        if unmatched:
            classes = sorted({type(m).__name__ for m in self.module.modules()})
            raise ValueError(
                f"leaf_modules={list(is_leaf.extra)!r}: {unmatched!r} names no module of this model; give "
                "a module class, its name or an importable path (pkg.module.Class). The model's module "
                f"classes: {', '.join(classes)}."
            )

    @property
    def owned(self) -> dict[str, tuple[int, ...]]:
        """Module key -> indices of the parameters it owns directly."""
        return self._owned

    def install(self) -> None:
        for key in self._owned:
            self._hook_forward(key)
        self._handles += state_dict_hooks(self.module, self.manager, lambda: self.closed is not None)
        watch(self.module)  # [Note: parameters read outside their owner] in reads.py
        self.watch_grads()
        keys = list(self._key_index)

        def name(chunk: int, module: int) -> str:
            """A collective's chunk and the module it was issued for; without one (a reduce-scatter, launched when
            backward completes the chunk) the modules whose parameters the chunk holds."""
            if 0 <= module < len(keys):
                return f"chunk {chunk} (module {keys[module]!r})"
            owners = [k for k, ids in self._chunks_of.items() if chunk in ids]
            more = f" and {len(owners) - 3} more" if len(owners) > 3 else ""
            return f"chunk {chunk}" + (f" (parameters of {', '.join(map(repr, owners[:3]))}{more})" if owners else "")

        self.manager.comm.names = name

    def _hook_forward(self, key: str) -> None:
        mod = self._modules[key]
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
        self._freed_room = True
        for cid in plan.evict:
            mgr.release(mgr.chunks[cid])
        self._release_waiting(nbytes, keep=())

    def _release_waiting(self, nbytes: int, keep: Iterable[int]) -> None:
        """The last resort when ``nbytes`` more do not fit under the limit: release the payloads of chunks that are
        pinned only by gradients waiting to reduce, the farthest next use first ([Note: a gradient waits without
        its payload] in ``states.py``)."""
        mgr = self.manager
        if mgr.limit is None or mgr.ledger[Tier.DEVICE] + nbytes <= mgr.limit:
            return
        trace = self.trace if self.training else None
        keep = set(keep)
        waiting = [c for c in mgr.chunks if c.chunk_id not in keep and c.waits_only_to_reduce]
        waiting.sort(
            key=lambda c: (trace.next_use(c.chunk_id, self.position) if trace is not None else 0.0, -c.last_used),
            reverse=True,
        )
        for c in waiting:
            if mgr.ledger[Tier.DEVICE] + nbytes <= mgr.limit:
                break
            mgr.release(c, waiting_grads=True)

    def remove(self) -> None:
        unwatch(self.module)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._grads_watched.clear()

    def _is_model_storage(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        return any(c.payload is not None and c.payload.untyped_storage().data_ptr() == ptr for c in self.manager.chunks)

    # ================================================================= moments
    def _tick(self, kind: MomentKind, key: str) -> tuple[int, ...]:
        """Advance the clock by one moment; return the chunks the module owns."""
        self._previous_moment = self._this_moment
        self._this_moment = (kind, key)
        self.position += 1
        self.clock += 1
        if self._layout_seen is not self.manager.layout:  # a (re)pack changed the chunk ids
            self._layout_seen = self.manager.layout
            params = self.manager.params
            self._chunks_of = {k: self.manager.chunk_ids_of([params[i] for i in own]) for k, own in self._owned.items()}
        chunk_ids = self._chunks_of.get(key, ())
        if self.tracer.recording and kind == FORWARD and _in_backward():  # only the warm-up asks what is pinned
            self.tracer.record(kind, key, chunk_ids, self._owned.get(key, ()), self._pinned)
        else:
            self.tracer.record(kind, key, chunk_ids, self._owned.get(key, ()))
        if self.manager.comm.world_size > 1:
            self._sequence.add(kind, key)
            n = self._occurrences.get((kind, key), 0)
            self._occurrences[(kind, key)] = n + 1
            if self._backward_queued and self.training:  # [Note: when a chunk reduces] in reduce.py
                self.manager.reducer.at_moment(MomentKey(kind, key, n), self.make_room)
        return chunk_ids

    def _pinned(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
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

    def _plan_and_run(self, needed: tuple[int, ...]) -> None:
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
        ) or self._plan_is_empty(all_resident, trace, budget):
            self._freed_room = False
        else:
            self._plan(needed, include, trace, budget)
        for cid in needed:
            mgr.wait_ready(mgr.chunks[cid])  # a prefetch on the side stream must land before use
            mgr.chunks[cid].last_used = self.clock
        if mgr.pool.pooled_bytes:  # [Note: the pool under a limit] in placement.py
            room = self.policy.pool_room(mgr.limit, trace, self.position, mgr.ledger[Tier.DEVICE])
            if room is not None:
                mgr.pool.trim(room)
        # a gather to a CUDA device reads an fp32 disk shard through the mapping: fault the next ones in ahead; on a
        # CPU device the gather reads the file itself ([Note: staged optimizer steps] in disk_storage.py): the kernel
        # starts reading it ahead ([Note: the gathers' reads ahead of use] in disk_storage.py)
        if trace is not None and mgr.disk_chunks:
            on_cpu = mgr.device.type == "cpu"
            for cid in (
                trace.chunks_ahead(self.position, READ_AHEAD_CHUNKS) if on_cpu else trace.next_chunks(self.position)
            ):
                c = mgr.chunks[cid]
                if c.shard_tier is Tier.DISK and not c.is_resident and c.low is None:
                    if on_cpu:
                        mgr.disk.read_ahead_master(c)
                    else:
                        mgr.disk.prefetch(c, (Role.MASTER,))

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
        self._freed_room = plan.for_room
        for cid in plan.evict:
            mgr.release(mgr.chunks[cid])
        for cid in needed:
            self._gather_or_explain(cid, needed)
        for cid in plan.prefetch:
            c = mgr.chunks[cid]
            try:
                mgr.gather(c, prefetch=True, module=self._module_of_next(cid))
            except DeviceMemoryLimitError:
                break  # a prefetch is only a hint

    def _gather_or_explain(self, cid: int, needed: tuple[int, ...]) -> None:
        mgr = self.manager
        chunk = mgr.chunks[cid]
        if chunk.is_resident:
            return
        try:
            mgr.gather(chunk, module=self._current_module)
            return
        except DeviceMemoryLimitError:
            pass
        mgr.land_in_flight()  # the plan was too optimistic: land the reduces in flight, free what may go, retry
        self._freed_room = True
        for other in mgr.chunks:
            if other.chunk_id not in needed and other.is_evictable:
                mgr.release(other)
        self._release_waiting(chunk.payload_bytes, keep=needed)
        try:
            mgr.gather(chunk, module=self._current_module)
        except DeviceMemoryLimitError as e:
            views = mgr.views()
            shards = sum(v.device_shard_bytes for v in views if v.shard_tier is Tier.DEVICE)
            in_use = [v.chunk_id for v in views if v.resident and not v.evictable and v.shard_tier is not Tier.DEVICE]
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
                + ("" if self.trace is not None else " plus the activations, which the warm-up step measures")
                + ("; or lower chunk_numel." if self.policy.config.chunk_numel is not None else ".")
            ) from None

    def _module_of_next(self, chunk_id: int) -> int:
        """The module index the trace says uses ``chunk_id`` next (for collective tags)."""
        if self.trace is None:
            return -1
        for m in self.trace.moments[self.position + 1 :]:
            if chunk_id in m.chunk_ids and m.kind != POST_FORWARD:
                return self._key_index.get(m.module, -1)
        return -1

    def _use(self, key: str, kind: MomentKind) -> None:
        if self.closed is not None:
            raise ChunkError(self.closed)
        self._current_module = self._key_index.get(key, -1)
        before = self._resident() if self.recorder else None
        needed = self._tick(kind, key)
        self._plan_and_run(needed)
        recompute = kind == FORWARD and _in_backward()
        if kind == BACKWARD and torch.is_grad_enabled():  # create_graph=True: [Note: double backward]
            self.grad_graph.used(self._owned.get(key, ()))
        in_use = []
        for i in self._owned.get(key, ()):
            chunk, info = self.manager.lookup(self.manager.params[i])
            if recompute and info.state is S.COMPUTE:
                in_use.append(i)  # pinned by the backward that runs this recomputation: [Note: recomputation]
            if info.state in _USABLE:
                chunk.set_state(info, S.COMPUTE)
        if recompute:
            self._pinned_by_backward[key] = frozenset(in_use)
        if before is not None:
            self._record(kind, key, needed, before)

    def _done_forward(self, key: str) -> None:
        before = self._resident() if self.recorder else None
        self._tick(POST_FORWARD, key)
        new = S.HOLD_AFTER_FWD if torch.is_grad_enabled() else S.HOLD
        keep = self._pinned_by_backward.pop(key, frozenset())
        held = self._held
        for i in self._owned.get(key, ()):
            chunk, info = self.manager.lookup(self.manager.params[i])
            if info.state is S.COMPUTE and i not in keep and i not in held:
                chunk.set_state(info, new)
        if self.policy.evict_after_use:
            self._plan_and_run(())
        if before is not None:
            self._record(POST_FORWARD, key, (), before)

    def _read(self, param: torch.Tensor, by_attribute: bool) -> None:
        """A parameter was read during a step's forward: one no module has in use is adopted by the innermost
        running module (read by attribute) or held to the end of this micro-batch's backward (read by iteration)
        ([Note: parameters read outside their owner] in reads.py)."""
        mgr = self.manager
        i = mgr.index_of.get(id(param))
        if i is None:
            return
        chunk, info = mgr.lookup(param)
        if info.state is S.COMPUTE or not (info.state in _USABLE or info.state is S.FREE):
            return
        with unwatched(), mgr.clock.measure("hooks"):
            key = self._reader()
            if key is None:
                return
            if by_attribute:
                self._adopt(key, i)
            else:
                self._held.add(i)
            if chunk.is_resident:
                mgr.wait_ready(chunk)
            else:
                self._gather_or_explain(chunk.chunk_id, (*self._chunks_of.get(key, ()), chunk.chunk_id))
            chunk.set_state(info, S.COMPUTE)

    def _param_name(self, t: torch.Tensor) -> str | None:
        """The name of the parameter ``t`` is, or is a view of (``w.T``)."""
        for candidate in (t, t._base):
            if candidate is not None and id(candidate) in self.manager.index_of:
                return self.manager.lookup(candidate)[1].name
        return None

    def _let_go_of_held(self) -> None:
        """Parameters held by an iteration in the last micro-batch that are still in use (an evaluation step's,
        whose backward never came) are free to go."""
        self.manager.let_go(self._held, S.HOLD)
        self._held.clear()

    def _reader(self) -> str | None:
        """The key of the innermost module of the model whose code runs now (the root outside every other); ``None``
        while dynamo traces the code (it reads every parameter to make them graph inputs)."""
        f: Any = sys._getframe(2)
        while f is not None:
            if _DYNAMO in f.f_code.co_filename:
                return None
            if f.f_code.co_filename not in _NOT_READERS:
                key = self._key_of.get(id(f.f_locals.get("self")))
                if key is not None:
                    return key
            f = f.f_back
        return ROOT

    def _adopt(self, key: str, index: int) -> None:
        """``key``'s module owns parameter ``index`` from now on, beside the module that holds it."""
        mgr = self.manager
        if key not in self._owned:  # hooked from its next call on; this call keeps the parameter in use to its end
            self._key_index[key] = len(self._key_index)
            self._pre_backward[key] = self._make_pre_backward(key)
            self._post_backward[key] = self._make_post_backward(key)
            self._hook_forward(key)
        own = self._owned[key] = (*self._owned.get(key, ()), index)
        self._chunks_of[key] = mgr.chunk_ids_of([mgr.params[j] for j in own])
        self.owners_changed = True
        _log.info(
            "parameter %r is read by %s outside the module that holds it: gathered with it from now on",
            mgr.lookup(mgr.params[index])[1].name,
            "the root module" if key == ROOT else f"module {key!r}",
        )

    def _plan_is_empty(self, all_resident: bool, trace: Trace | None, budget: int | None) -> bool:
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
        Never at a backward moment, where the module that just ran can leave its chunks evictable for the next
        plan, nor at a forward start inside backward (a recomputation); a recomputed module's end right after its
        start is skipped as in forward, its chunks pinned by the backward that runs it as before. Tested by
        recording every moment of runs with and without the skip (tests/integration/test_parity.py).
        On that model 89 of the 265 plans a step are skipped; what they cost is small (the plans' time 148 -> 134 ms
        a step, 2.0-2.3 s steps), because the plans left are the ones that gather, and launching a gloo all-gather
        beside the compute is most of the hooks' time (docs/benchmarks.md, 2026-11-27). On an accelerator, whose
        steps are shorter, the same Python is a larger part of the step."""
        kind, key = self._this_moment
        if trace is None or self.manager.disk_chunks or self._freed_room:
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
            return all(c in window or later and trace.used_later(c, at) for c in self._chunks_of.get(key, ()))
        return kind == FORWARD and self._previous_moment[0] == POST_FORWARD and all_resident and not _in_backward()

    def _resident(self) -> frozenset[int]:
        return frozenset(c.chunk_id for c in self.manager.chunks if c.is_resident)

    def _record(self, kind: MomentKind, key: str, needed: tuple[int, ...], before: frozenset[int]) -> None:
        assert self.recorder is not None
        after = self._resident()
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

    # =================================================================== hooks
    def _make_pre_forward(self, key: str, owner: torch.nn.Module) -> Callable[..., None]:
        @_eager
        def hook(module: torch.nn.Module, args: Any) -> None:
            if module is not owner:
                return  # a deep copy of the module, which kept the hook: its parameters are plain tensors
            with self.manager.clock.measure("hooks"):
                self._use(key, FORWARD)

        return hook

    def _make_post_forward(self, key: str, owner: torch.nn.Module) -> Callable[..., None]:
        @_eager
        def hook(module: torch.nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            if module is not owner:
                return
            with self.manager.clock.measure("hooks"):
                self._done_forward(key)
                self._hook_outputs(key, output)
                self._hook_inputs(key, (args, kwargs))

        return hook

    def _hook_inputs(self, key: str, inputs: Any) -> None:
        """A module that owns frozen parameters: let them go when its backward is done ([Note: frozen parameters
        in backward])."""
        if not torch.is_grad_enabled():
            return
        params = self.manager.params
        if all(params[i].requires_grad for i in self._owned.get(key, ())):
            return
        if _in_backward() and self._open_backward.get(key, 0):
            return  # a recomputation whose backward never runs: the first forward's hook is the one that fires
        leaves = [t for t in tree_flatten(inputs)[0] if torch.is_tensor(t) and t.requires_grad]
        if not leaves:
            return  # no backward reaches its inputs: its frozen parameters are never pinned by one
        self._open_backward[key] = self._open_backward.get(key, 0) + 1
        torch.autograd.graph.register_multi_grad_hook(leaves, self._post_backward[key], mode="all")

    def _make_post_backward(self, key: str) -> Callable[[Any], None]:
        @_eager
        def hook(grads: Any) -> None:
            with self.manager.clock.measure("hooks"):
                left = self._open_backward.get(key, 0) - 1
                self._open_backward[key] = max(left, 0)
                if left > 0:
                    return  # another call of the module still has its backward ahead
                params = self.manager.params
                for i in self._owned.get(key, ()):
                    if not params[i].requires_grad and i not in self._held:
                        chunk, info = self.manager.lookup(params[i])
                        if info.state is S.COMPUTE:
                            chunk.set_state(info, S.HOLD_AFTER_BWD)

        return hook

    def _hook_outputs(self, key: str, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        leaves, _ = tree_flatten(output)
        for t in leaves:
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(self._pre_backward[key])

    def _make_pre_backward(self, key: str) -> Callable[[torch.Tensor], None]:
        # made once per module at ``install``: wrapping a new closure with torch.compiler.disable at every forward
        # cost about 60 us a module output (a tenth of the hooks' time on one rank)
        @_eager
        def hook(grad: torch.Tensor) -> None:
            with self.manager.clock.measure("hooks"):
                self._queue_end_of_backward()
                self._use(key, BACKWARD)

        return hook

    def _on_grad(self, param: torch.Tensor) -> None:
        with self.manager.clock.measure("hooks"):
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
            with self.manager.clock.measure("grad_copy"):
                self.manager.accumulate_grad(param, grad, self.make_room)
            param.grad = None
            if self.tracer.recording:
                self.tracer.grad_arrived(self.manager.index_of[id(param)])

    def _queue_end_of_backward(self) -> None:
        if not self._backward_queued:
            self._backward_queued = True
            if self.tracer.recording:
                # the warm-up's backward: no trace yet, but this forward's moments (the same on every rank)
                # say the order backward will complete the chunks in, near enough: reverse first use
                # ([Note: reduce order] in reduce.py)
                self.manager.set_reduce_order(self.tracer.forward_first_use()[::-1])
            self.manager.reducer.begin_backward(traced=self.trace is not None and not self.tracer.recording)
            if self.on_backward_start is not None:
                self.on_backward_start()
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """All gradients of this backward are in: reduce the rest, finish the warm-up trace."""
        with self.manager.clock.measure("hooks"):
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
        self._backward_queued = False
        self._open_backward.clear()
        self._pinned_by_backward.clear()
        # [Note: a backward that delivers no gradient]
        arrived, self._grads_arrived = self._grads_arrived, False
        self._sequence.add(GRADIENTS, "delivered" if arrived else "none delivered")
        # reduce first: a chunk whose gradients this rank did not all get reduces here, and the other ranks may be
        # waiting for that reduce-scatter, not yet in the check's collective
        self.manager.end_backward(self.make_room, grads_arrived=arrived)
        self._sequence.check(self.manager.comm, lambda key: self._chunks_of.get(key, ()))
        self.grad_graph.backward_ended()
        if arrived and self.on_backward_end is not None:
            self.on_backward_end()
        if self.tracer.recording:
            self.trace = self.tracer.finish(len(self.manager.params))
            if self.on_trace_done is not None:
                self.on_trace_done(self.trace)
        if self.policy.evict_after_use:
            self._plan_and_run(())

    # ============================================================== step scope
    @contextlib.contextmanager
    def step_scope(self, *, training: bool, record: bool = False) -> Iterator[Callable[[Any], None]]:
        """One micro-batch (training) or one evaluation step. Yields ``outputs(obj)`` to register the step's outputs."""
        self.grad_graph.reset()  # a graph built by a backward with create_graph=True that no backward consumed
        self._let_go_of_held()
        self.manager.reset_states()
        self._sequence.clear()
        self._open_backward.clear()
        self._pinned_by_backward.clear()
        self.position = -1
        self._occurrences = {}
        self._this_moment = self._previous_moment = ("", "")
        self.training = training
        counting: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if record:
            self.tracer.start()
            counting = self.tracer.counter.counting()
        if ROOT in self._owned:
            self._use(ROOT, FORWARD)
        registered = []

        def outputs(out: Any) -> None:
            registered.append(True)
            if ROOT in self._owned:
                self._hook_outputs(ROOT, out)

        # the warm-up (and the first evaluation step) also checks every op for released parameters the watch
        # cannot see ([Note: parameters read outside their owner] in reads.py)
        check = record or (not training and not self._evaluated)
        self._evaluated = self._evaluated or not training
        with counting, reading(self._read), ReleasedReads(self._param_name) if check else contextlib.nullcontext():
            yield outputs
        if ROOT in self._owned:
            if training and torch.is_grad_enabled() and not registered:
                # backward would find the root's payload released after this step's forward, and read freed memory
                # (a segmentation fault, not an error) where its parameters are used
                params = self.manager.params
                names = [self.manager.lookup(params[i])[1].name for i in self._owned[ROOT]]
                raise ChunkError(
                    f"the root module owns parameters directly ({', '.join(names)}), so a training step must register "
                    "its outputs before backward: `with engine.micro_batch(training=True) as outputs: loss = ...; "
                    "outputs(loss)` (ChunkOffloadStrategy does this for training_step's result)."
                )
            self._done_forward(ROOT)
        if not training:  # an evaluation step's outputs leave with it ([Note: checking once a micro-batch])
            self.manager.comm.verify_issued()
