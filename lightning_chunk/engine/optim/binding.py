"""The hybrid optimizer: the user's own optimizer, stepping master shards where they live.

[Note: per-parameter views of the master shards]
The optimizer keeps its class, hyperparameters, param groups and object identity
(LR schedulers stay bound to it): only the tensors in ``param_groups`` change.
Each parameter is replaced by a flat *view* of its piece of this rank's master
shard, not by the whole shard. That costs nothing (fused and foreach kernels take
lists of tensors) and keeps plain-PyTorch semantics exact where a flat
chunk-wide step would not: a parameter that got no gradient this step has
``grad is None`` and is skipped, with its own ``step`` count, exactly as in
``torch.optim``; frozen parameters never decay; optimizer state stays keyed by
parameter, so checkpoints map one to one onto the plain format.

Adam-family steps run torch's fused kernels (``fused=True``), which group the
tensors by device: host shards go through the fused CPU kernel and device
shards through the fused device kernel in the same ``step()``: that is the
hybrid Adam. Optimizers whose update needs parameter shapes (LBFGS, ...) cannot step flat views and are refused;
torch's Muon and Adafactor are stepped by the engine ([Note: optimizers that need whole parameters] in ``whole.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from ..chunks.chunk import Chunk, storage_of
from ..chunks.repack import piece_range
from ..config import ChunkConfig
from ..errors import GROUPS_ADDED_HINT, ChunkError
from ..memory.consolidate import (
    gather_optimizer_state,
    local_optimizer_state,
    optimizer_state_parts,
    state_shard,
)
from ..memory.manager import ChunkManager
from ..system import torch_features
from .adafactor import AdafactorStep
from .closure import closure_for
from .disk_stepper import DiskStepper
from .grad_slots import GradSlot, GradSlots
from .host_adam import HostAdam
from .kernels import check_optimizer, flags_set, is_known, kernel_flags, state_bytes_per_element
from .partial_steps import PartialSteps, only
from .plain_keys import state_by_param
from .shard_state import keyed_by_parameters, keyed_by_shards
from .whole import WholeStep

__all__ = ["GradSlot", "OptimizerBinding", "OptimizerStateCarrier", "check_optimizer"]


# marks the step hooks the engine registers on an optimizer, to tell them from a user's
ENGINE_HOOK = "_lightning_chunk_engine_hook"


def whole_steppers() -> tuple[type[WholeStep], ...]:
    """The optimizers stepped on whole parameters ([Note: optimizers that need whole parameters] in whole.py): Muon
    where torch has it ([Note: torch versions] in ``system/torch_features.py``)."""
    if not torch_features.MUON:
        return (AdafactorStep,)
    from .muon import MuonStep  # torch.optim._muon is not there before torch 2.9

    return (MuonStep, AdafactorStep)


class OptimizerBinding:
    """Rebinds one optimizer's param groups to master-shard views and feeds them gradients."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, manager: ChunkManager, group_offset: int, config: ChunkConfig
    ) -> None:
        check_optimizer(optimizer, config, manager.comm.world_size)
        self.optimizer = optimizer
        self.manager = manager
        self.config = config
        self.group_params: list[list[int]] = [
            [manager.index_of[id(p)] for p in g["params"]] for g in optimizer.param_groups
        ]
        # each param group's number over every optimizer (a chunk's key): consecutive from ``group_offset`` at
        # set-up, then one past every number in use for a group added while training (``adopt_added_groups``)
        self.groups = list(range(group_offset, group_offset + len(self.group_params)))
        self._views: dict[int, torch.Tensor] = {}
        self.slots = GradSlots(manager, self.group_params)  # where each view's gradient is
        self.kernel_flags = kernel_flags(optimizer, config.optimizer_kernel)
        self.disk = DiskStepper(self, manager.tiers.disk)
        one_pass = {"auto": "auto", "one_pass": True}.get(config.optimizer_kernel, False)
        self.host_adam = HostAdam(optimizer, manager, one_pass, self.kernel_flags)
        self.fresh_low: set[int] = set()  # chunks whose compute copy the last step wrote ([Note: one pass ...])
        self.partial = PartialSteps(optimizer)  # [Note: group state in partial steps]
        # [Note: optimizers that need whole parameters] in whole.py
        stepper = next((s for s in whole_steppers() if isinstance(optimizer, s.optimizer_class)), None)
        self.whole: WholeStep | None = stepper(self) if stepper is not None else None
        self.whole_keys = stepper.state_keys if stepper is not None else frozenset()  # not cut into pieces
        closure = self.closure = closure_for(optimizer, is_known(optimizer) or self.whole is not None)

        # a step called on the optimizer itself, not through the engine, also lets a save in flight finish with the
        # shards first ([Note: training beside a save] in state/background_save.py)
        def before_step(*_: Any) -> None:
            manager.readers.before_change()
            if closure is not None:
                closure.reset()

        setattr(before_step, ENGINE_HOOK, True)  # not the user's (``backward_step.step_hooks``)
        self._before_step = optimizer.register_step_pre_hook(before_step)

    def kernel(self) -> contextlib.AbstractContextManager[None]:
        """The groups carry the chosen kernel's flags inside this block ([Note: the kernel and the user's param
        groups] in ``kernels.py``)."""
        if len(self.optimizer.param_groups) != len(self.group_params):
            error = ChunkError(
                f"{type(self.optimizer).__name__} has {len(self.optimizer.param_groups)} param groups at this step "
                f"but had {len(self.group_params)} when the step began: add param groups before a step's first "
                "micro-batch (in on_train_epoch_start, or in on_train_batch_start at an accumulation boundary), not "
                "between its backward and its optimizer step."
            )
            self.drop_unbound_groups()
            raise error
        return flags_set(self.optimizer, self.kernel_flags)

    def drop_unbound_groups(self) -> None:
        """Param groups added since the bind and refused leave the optimizer, as torch's ``add_param_group`` leaves
        it where it refuses a group: an optimizer with a group the engine never bound fails its teardown."""
        del self.optimizer.param_groups[len(self.group_params) :]

    def state_bytes(self) -> dict[int, int]:
        """Global group index -> optimizer-state bytes per element of the master shards."""
        out = {}
        for k, g in enumerate(self.optimizer.param_groups):
            idx = self.group_params[k]
            dtype = self.manager.dtypes.master_for(self.manager.params[idx[0]].dtype) if idx else torch.float32
            out[self.groups[k]] = state_bytes_per_element(self.optimizer, g, dtype)
        return out

    def bind(self, carried: dict[int, dict[str, Any]] | None = None) -> None:
        """Point every group at the current master views and give each view its optimizer state.

        ``carried``: this rank's pieces of the state, keyed by parameter index, as a repack carried them
        ([Note: optimizer state through a repack] in ``repack.py``). ``None`` at the first bind: state the
        optimizer already holds for the module parameters (Adagrad creates its ``sum`` in the constructor;
        a user may have stepped before) is whole, and each rank keeps its own piece of it."""
        new: dict[int, torch.Tensor] = {}
        for k, g in enumerate(self.optimizer.param_groups):
            views = []
            for i in self.group_params[k]:
                v = master_view(self.manager, i)
                if v is None:
                    continue
                new[i] = v
                views.append(v)
            g["params"] = views
        state = self.optimizer.state
        if carried is None:
            whole = {
                i: state.pop(self.manager.params[i])
                for g in self.group_params
                for i in g
                if self.manager.params[i] in state
            }
            carried = local_optimizer_state(self.manager, new, whole, self.whole_keys)
        for k in range(len(self.optimizer.param_groups)):
            step_on_device = self._steps_on_device(k)
            for i in self.group_params[k]:
                v = new.get(i)
                if v is not None and i in carried:
                    state[v] = {key: self._move(key, val, v, step_on_device) for key, val in carried[i].items()}
        keyed_by_shards(self.optimizer, self.manager)  # [Note: optimizer state keyed by shards]
        self._views = new
        self.slots.rebind(new)
        self.host_adam.reset()
        self.disk.keep_state()

    def step(self, **kwargs: Any) -> Any:
        """The optimizer's own ``step(**kwargs)``: large host chunks with a compute copy in one pass ([Note: one
        pass over a host shard] in ``host_adam.py``), disk chunks one at a time, the rest in one call."""
        kwargs = self._with_closure(kwargs)
        with self.kernel():
            if self.whole is not None:
                return self._step_whole(None, kwargs)
            stepped, self.fresh_low = self.host_adam.step_one_pass(self._views)
            if not stepped:
                return self._step_rest(**kwargs)
            with self.narrowed(lambda v: id(v) not in stepped):  # the optimizer still steps (its hooks, an LR
                return self._step_rest(**kwargs)  # scheduler's count), over the other views only

    def _step_whole(self, chunks: list[Chunk] | None, kwargs: dict[str, Any]) -> Any:
        """The engine's update of ``chunks`` (all: ``None``) for an optimizer stepped whole, then ``step()`` over no
        view, for its hooks ([Note: optimizers that need whole parameters] in ``whole.py``)."""
        assert self.whole is not None
        self.whole.step(self._views, chunks)
        with self.narrowed(lambda v: False):
            return self._step_rest(**kwargs)

    def _with_closure(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``kwargs`` with ``AlreadyRun`` as the closure, where this optimizer gets one ([Note: the closure of a step
        the engine runs] in ``closure.py``)."""
        return {**kwargs, "closure": self.closure} if self.closure is not None and "closure" not in kwargs else kwargs

    def narrowed(self, keep: Any) -> contextlib.AbstractContextManager[None]:
        """A ``step()`` call of this step over the views ``keep`` accepts ([Note: a group's own state in a step made
        of several calls] in ``partial_steps.py``)."""
        return only(self.optimizer, keep, self.partial)

    def _step_rest(self, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)`` over the views in ``param_groups``: one call, or with disk chunks among
        them the disk stepper's call a chunk ([Note: stepping disk shards] in ``disk_stepper.py``)."""
        disk = self.disk.chunks()
        return self.disk.step(disk, **kwargs) if disk else self.optimizer.step(**kwargs)

    def _steps_on_device(self, k: int) -> bool:
        """Whether group ``k``'s step counters live beside its views: the kernel's flags (``kernel_flags``) over the
        group's own, since a device view stepped by the fused kernel wants its ``step`` there (reading the group's
        own flag alone, a resume of host shards onto the device failed in torch's fused AdamW on CUDA)."""
        g = self.optimizer.param_groups[k]
        return bool({**g, **self.kernel_flags[k]}.get("fused") or g.get("capturable"))

    def _move(self, key: str, val: Any, like: torch.Tensor, step_on_device: bool) -> Any:
        """Per-element state follows the view (flat, on its device); scalar ``step`` where the kernel wants it; a
        whole parameter's state (Adafactor's ``row_var``) to the view's device, in its own shape."""
        if not torch.is_tensor(val):
            return val
        if key in self.whole_keys:
            return val.to(device=like.device)
        if val.dim() > 0:
            if val.numel() != like.numel():
                raise ValueError(
                    f"optimizer state of {val.numel()} elements for a shard piece of {like.numel()}: "
                    "state must be carried by piece, not by parameter"
                )
            return val.reshape(like.shape).to(device=like.device)
        return val.to(like.device if step_on_device else "cpu")

    # ----------------------------------------------------- plain state format
    def _positions(self) -> list[int]:
        """Param index of each position in this rank's ``optimizer.state_dict()`` numbering."""
        return [i for k in range(len(self.group_params)) for i in self.group_params[k] if i in self._views]

    def plain_state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` as the unchunked optimizer would write it (whole state, parameter shapes).

        A collective with several ranks: every rank calls it and gets the whole state."""
        plain_pos = self.plain_positions()
        whole = gather_optimizer_state(self.manager, self._views, self.optimizer.state, plain_pos, self.whole_keys)
        return {
            "state": {plain_pos[i]: st for i, st in sorted(whole.items(), key=lambda kv: plain_pos[kv[0]])},
            "param_groups": self.plain_param_groups(plain_pos),
        }

    def plain_positions(self) -> dict[int, int]:
        """Parameter index -> its position in the unchunked optimizer's ``state_dict``."""
        return {i: n for n, i in enumerate(i for g in self.group_params for i in g)}

    def plain_param_groups(self, plain_pos: dict[int, int]) -> list[dict[str, Any]]:
        """The param groups as the unchunked optimizer's ``state_dict`` writes them (the user's kernel flags)."""
        return [
            {
                **{key: v for key, v in g.items() if key != "params"},
                "params": [plain_pos[i] for i in self.group_params[k]],
            }
            for k, g in enumerate(self.optimizer.param_groups)
        ]

    def load_plain_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a state dict written by the unchunked optimizer (or by ``plain_state_dict``); each rank keeps its
        piece."""
        if len(sd["param_groups"]) != len(self.group_params):
            raise ValueError(
                f"the optimizer state has {len(sd['param_groups'])} param groups, the optimizer has "
                f"{len(self.group_params)}: the checkpoint was written for another optimizer"
                + (f"; or {GROUPS_ADDED_HINT}" if len(sd["param_groups"]) > len(self.group_params) else "")
            )
        # by position, or by name ([Note: optimizer state keyed by name] in plain_keys.py)
        whole = state_by_param(sd, self.group_params, self.manager.names)
        mine = local_optimizer_state(self.manager, self._views, whole, self.whole_keys)
        self.load_local_state(mine, [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]])

    def load_local_state(self, mine: dict[int, dict[str, Any]], hypers: list[dict[str, Any]]) -> None:
        """Load this rank's pieces of per-parameter state (flat, like the views) and the groups' hyperparameters."""
        pos = self._positions()
        local_groups = []
        n = 0
        for k, g in enumerate(hypers):
            count = sum(1 for i in self.group_params[k] if i in self._views)
            local_groups.append({**g, "params": list(range(n, n + count))})
            n += count
        self.optimizer.load_state_dict(
            {"state": {p: mine[i] for p, i in enumerate(pos) if i in mine}, "param_groups": local_groups}
        )
        self.kernel_flags = kernel_flags(self.optimizer, self.config.optimizer_kernel)  # as the loaded groups say
        keyed_by_shards(self.optimizer, self.manager)  # the load made it a plain defaultdict
        for k, g in enumerate(self.optimizer.param_groups):
            on_device = self._steps_on_device(k)
            for v in g["params"]:
                st = self.optimizer.state.get(v)
                if st and torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(v.device if on_device else "cpu")
        self.host_adam.reset()
        self.disk.keep_state()

    def unbind(self, *, whole_state: bool = True) -> None:
        """Point the optimizer back at the module parameters, with whole state in their shapes (e.g. when ``fit``
        ends). Without ``whole_state`` (after a failure on another rank) the state is dropped: no collectives."""
        mgr = self.manager
        whole = (
            gather_optimizer_state(mgr, self._views, self.optimizer.state, range(len(mgr.params)), self.whole_keys)
            if whole_state
            else {}
        )
        for k, g in enumerate(self.optimizer.param_groups):
            g["params"] = [mgr.params[i] for i in self.group_params[k]]
        keyed_by_parameters(self.optimizer)
        for i, st in whole.items():
            self.optimizer.state[mgr.params[i]] = st
        self._views = {}
        self.host_adam.reset()
        self._before_step.remove()

    def views(self) -> dict[int, torch.Tensor]:
        return self._views

    def detached(self) -> list[int]:
        """The parameters whose view is no longer a view of its master shard: given another tensor
        (``p.data = ...`` on a parameter of ``optimizer.param_groups``)."""
        mgr = self.manager
        out = []
        for i, v in self._views.items():
            c = mgr.lookup(mgr.params[i])[0]
            master = c.payload if c.master_is_payload() else c.master
            if master is not None and storage_of(v) != storage_of(master):
                out.append(i)
        return out

    def chunk_groups(self) -> list[int]:
        """The global param-group indices of this optimizer (a chunk belongs to exactly one group)."""
        return self.groups

    # ------------------------------------------------------------ gradients
    def steps_on_this_rank(self, chunk: Chunk) -> bool:
        """This rank's shard of ``chunk`` holds a piece of a parameter this optimizer steps (not padding alone)."""
        return bool(self.slots.of_chunk(chunk, with_grad=False))

    def step_chunk(self, chunk: Chunk, **kwargs: Any) -> Any:
        """``step(**kwargs)`` over the views of ``chunk`` alone, with their gradients attached for the call
        ([Note: stepping in backward] in ``early_step.py``); other param groups' views are left out as well."""
        mine = self.slots.of_chunk(chunk)
        if not mine:
            return None
        kwargs = self._with_closure(kwargs)
        ids = {id(s.view) for s in mine}
        low = chunk.grads_in_low  # none attached: the one pass reads them ([Note: gradients in bf16 until the step])
        with self.slots.for_the_call([] if low else mine), self.kernel():
            if self.whole is not None:  # one rank (check_optimizer): nothing is gathered
                return self._step_whole([chunk], kwargs)
            stepped, fresh = self.host_adam.step_one_pass(self._views, only=ids)
            self.fresh_low |= fresh
            rest = ids - stepped
            if not rest:
                return None
            # the one pass did not step the chunk: torch's kernel, from its gradients widened (exactly) to fp32
            wide = chunk.grad_low.float() if low and chunk.grad_low is not None else None
            with self.slots.for_the_call(mine if low else [], wide), self.narrowed(lambda v: id(v) in rest):
                return self._step_rest(**kwargs)


class OptimizerStateCarrier:
    """Carries every bound optimizer's per-element state through a repack, piece by piece
    ([Note: optimizer state through a repack] in ``repack.py``). Building it is a collective."""

    def __init__(self, manager: ChunkManager, bindings: Sequence[OptimizerBinding]) -> None:
        self.manager = manager
        self.bindings = list(bindings)
        # every rank agrees on the state keys and on each parameter's scalar state (``step``)
        self.parts = [optimizer_state_parts(manager, b.views(), b.optimizer.state, b.whole_keys) for b in self.bindings]
        self.owner = {g: k for k, b in enumerate(self.bindings) for g in b.chunk_groups()}
        self.pieces: list[dict[int, dict[str, torch.Tensor]]] = [{} for _ in self.bindings]

    def take(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        k = self.owner.get(chunk.spec.key.group)
        if k is None or not self.parts[k].keys:
            return {}
        parts, b = self.parts[k], self.bindings[k]
        out = {key: state_shard(self.manager, chunk, parts, key) for key in parts.in_chunk(chunk)}  # frozen: none
        for t in chunk.tensors:  # the old state goes now: a repack never holds two copies of it
            i = t.slot.param_index
            parts.local.pop(i, None)
            v = b.views().get(i)
            if v is not None:
                b.optimizer.state.pop(v, None)
        return out

    def give(self, param_index: int, pieces: dict[str, torch.Tensor], chunk: Chunk, offset: int) -> None:
        k = self.owner.get(self.manager.specs[param_index].key.group)
        if k is not None and param_index in self.parts[k].scalars:  # a parameter with no state gets none
            keep = self.manager.tiers.keep_piece  # a disk shard takes its pieces into its file now (zeros too)
            kept = {key: keep(chunk, offset, key, v) for key, v in pieces.items()}
            parts = self.parts[k]  # its state has the keys it had ([Note: state keys a parameter has])
            self.pieces[k][param_index] = {key: v for key, v in kept.items() if parts.has(param_index, key)}

    def state_for(self, k: int) -> dict[int, dict[str, Any]]:
        """Binding ``k``'s state on this rank after the repack: scalars merged across ranks, per-element pieces."""
        parts = self.parts[k]
        out = {i: dict(st) for i, st in parts.scalars.items()}
        for i, pieces in self.pieces[k].items():
            out.setdefault(i, {}).update(pieces)
        return out


def master_view(mgr: ChunkManager, param_index: int) -> torch.Tensor | None:
    """This rank's piece of one parameter's master, flat; ``None`` when another rank owns all of it."""
    chunk, info = mgr.lookup(mgr.params[param_index])
    lo, _ = chunk.shard_range
    a, b = piece_range(chunk, info.offset, info.numel)
    return chunk.master_tensor_for_read()[a - lo : b - lo] if a < b else None


def refuse_detached_views(bindings: Sequence[OptimizerBinding]) -> None:
    """Raise where an optimizer's parameter was given another tensor since the engine bound it.

    [Note: an optimizer's parameter given another tensor]
    The optimizer steps views of the master shards ([Note: per-parameter views of the master shards]). ``p.data = t``
    on one of them (SAM's ``second_step`` restores its weights so, in the manual recipe Lightning's users follow)
    made it a tensor of its own: every later update went there and never reached the weights the model computes
    with, silently (a SAM run one rank, fp32: 0.035 off plain Lightning after four steps). Before every training
    batch each view is checked to still share its master's storage (one pointer a parameter)."""
    for b in bindings:
        bad = b.detached()
        if bad:
            names = [b.manager.names[i] for i in bad]
            raise ChunkError(
                f"{type(b.optimizer).__name__}'s parameter {names[0]!r}"
                + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
                + " was given another tensor (`p.data = ...` on a parameter of optimizer.param_groups, as SAM's "
                "second_step restores its weights): under chunk_offload those parameters are views of the master "
                "shards the model is trained from, so the optimizer's updates no longer reach the model. Optimizers "
                "that move the weights between two forward and backward passes of one step (SAM) cannot step "
                "under chunk_offload; others should write into their parameters in place (`p.copy_(t)`)."
            )
