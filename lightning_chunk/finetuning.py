"""Lightning's finetuning callbacks (``BaseFinetuning``, ``BackboneFinetuning``) under chunk_offload ([Note:
finetuning callbacks])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from .engine import ChunkEngine
from .engine.runtime.added_groups import views_in_groups


def follow_finetuning(trainer: pl.Trainer, engine: ChunkEngine) -> None:
    """Let ``trainer``'s finetuning callbacks find the optimizers' parameters by identity.

    [Note: finetuning callbacks]
    A ``BaseFinetuning`` callback freezes a backbone at set-up, and at some epoch unfreezes it and adds its
    parameters to the optimizer as a param group of their own: a repack follows ([Note: param groups added while
    training] in ``engine/runtime/added_groups.py``). Three more of its steps meet the optimizer's views:
    - After each epoch's start it saves every group's parameter *names*, mapping the optimizer's parameters to the
      module's by identity; views are not the module's, and it failed with a ``KeyError``. It now runs with the groups
      showing the module's parameters.
    - On a resume it adds the saved groups back at ``on_fit_start`` from their names, before Lightning loads the
      optimizer state. Here the checkpoint loads after set-up, and so after ``on_fit_start``: the optimizer met a
      checkpoint with more groups than it had. The groups are now added back from the checkpoint's callback state
      as the checkpoint loads, before its optimizer state, and the callback does not add them a second time.
    - Where it does replace the groups at ``on_fit_start`` (a fit after a fit), the bound groups get their views
      back and the added ones are followed at once.
    - Its check that a parameter is not in the optimizer already (``filter_on_optimizer``) compares values: the
      module's parameters with the optimizer's views, which never match (a released parameter shows a placeholder of
      NaN). A backbone the user's ``configure_optimizers`` had put in the optimizer already (frozen, the callback
      meant to skip it with a warning) was added a second time and refused. Inside ``finetune_function`` the check
      finds a bound optimizer's parameters by identity instead, and warns as Lightning's does; it runs with the
      refusal of reads between steps suspended ([Note: released parameters read between steps] in
      ``engine/runtime/between_steps.py``).
    """
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, BaseFinetuning):
            _Adapted(cb, engine)


_WRAPPED = ("_store", "on_fit_start", "load_state_dict", "finetune_function")


def unfollow_finetuning(trainer: pl.Trainer) -> None:
    """The callbacks' own methods again when the fit ends (a later fit may run under another strategy)."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(cb, BaseFinetuning):
            for name in _WRAPPED:
                cb.__dict__.pop(name, None)


class _Adapted:
    """One callback's methods that meet the optimizer's views, wrapped on the instance for this fit."""

    def __init__(self, cb: BaseFinetuning, engine: ChunkEngine) -> None:
        cls = type(cb)
        self.cb, self.engine = cb, engine
        self.restored = False  # the groups of the checkpoint loading were added back already
        self._orig = {name: getattr(cls, name).__get__(cb, cls) for name in _WRAPPED}
        cb.__dict__.update({name: getattr(self, name) for name in _WRAPPED})

    def _store(self, *args: Any) -> None:
        with module_params_in_groups(self.engine):
            self._orig["_store"](*args)

    def finetune_function(self, *args: Any) -> None:
        with self.engine.hooks.between.suspended(), _held_by_identity(self.engine):
            self._orig["finetune_function"](*args)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        restarting = self.cb._restarting
        self._orig["on_fit_start"](trainer, pl_module)
        if restarting:
            self._follow()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._orig["load_state_dict"](state_dict)
        if self.restored:  # restore_groups added them back: on_fit_start must not again
            self.cb._restarting = False

    def restore_groups(self, trainer: pl.Trainer, state: Mapping[str, Any]) -> None:
        metadata = state.get("internal_optimizer_metadata", state)
        named = dict(trainer.lightning_module.named_parameters())
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            if opt_idx in metadata:
                optimizer.param_groups = self.cb._apply_mapping_to_param_groups(metadata[opt_idx], named)
        self.restored = True
        self._follow()

    def _follow(self) -> None:
        for b in self.engine.bindings:
            views_in_groups(b)
        self.engine.warm_up.follow_keys(training=True)


def restore_finetuning_groups(trainer: pl.Trainer, callbacks_state: Mapping[str, Any]) -> None:
    """Before a checkpoint's optimizer state loads: the groups its finetuning callbacks had added, added back
    ([Note: finetuning callbacks])."""
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        adapted = getattr(cb, "_store", None)
        owner = getattr(adapted, "__self__", None)
        if isinstance(cb, BaseFinetuning) and isinstance(owner, _Adapted) and callbacks_state.get(cb.state_key):
            owner.restore_groups(trainer, callbacks_state[cb.state_key])


@contextlib.contextmanager
def module_params_in_groups(engine: ChunkEngine) -> Iterator[None]:
    """The bound param groups list the module's parameters inside this block, their views again after it."""
    params = engine.manager.params
    saved = []
    for b in engine.bindings:
        for k, g in enumerate(b.optimizer.param_groups[: len(b.group_params)]):
            saved.append((g, g["params"]))
            g["params"] = [params[i] for i in b.group_params[k]]
    try:
        yield
    finally:
        for g, views in saved:
            g["params"] = views


@contextlib.contextmanager
def _held_by_identity(engine: ChunkEngine) -> Iterator[None]:
    """``BaseFinetuning.filter_on_optimizer`` finds the module parameters a bound optimizer holds by identity inside
    this block ([Note: finetuning callbacks]); other optimizers as Lightning finds them."""
    lightning_s = BaseFinetuning.__dict__["filter_on_optimizer"]

    def filter_on_optimizer(optimizer: Optimizer, params: Any) -> list:
        bound = [b for b in engine.bindings if b.optimizer is optimizer]
        if not bound:
            return lightning_s.__func__(optimizer, params)
        b, params = bound[0], list(params)
        held = {id(engine.manager.params[i]) for idx in b.group_params for i in idx}
        held |= {id(p) for g in optimizer.param_groups[len(b.group_params) :] for p in g["params"]}  # not adopted yet
        out = [p for p in params if id(p) not in held]
        if len(out) < len(params):  # Lightning's words
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this optimizer."
                " Those parameters will be skipped.\n"
                "HINT: Did you init your optimizer in `configure_optimizer` as such:\n"
                f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) ",
            )
        return out

    BaseFinetuning.filter_on_optimizer = staticmethod(filter_on_optimizer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        BaseFinetuning.filter_on_optimizer = lightning_s  # type: ignore[method-assign]
