"""Lightning's ``toggle_optimizer`` under chunk_offload ([Note: toggled optimizers])."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from .checkpointing import ChunkCheckpoints


def follow_toggles(module: pl.LightningModule, strategy: ChunkCheckpoints) -> None:
    """Make ``toggle_optimizer`` freeze the module's parameters, not only the optimizers' tensors.

    [Note: toggled optimizers]
    The optimizers step views of the shards, so what Lightning's ``toggle_optimizer`` (its documented GAN
    pattern) does to ``optimizer.param_groups`` happens to the views: it set ``requires_grad=False`` on tensors
    autograd never sees, and the generator's loss left gradients on the discriminator's parameters, which then
    stepped with them (silently: 0.07 from plain Lightning after 12 steps). While an optimizer is toggled, the
    other optimizers' parameters of the module do not require grad either (as in plain Lightning: no gradient,
    no work); ``untoggle_optimizer`` gives them back their flags. The module's own methods (a user's override
    included) still run first. A change of flags that outlives a training step is a repack
    ([Note: requires_grad changed] in ``engine/runtime/engine.py``)."""
    toggle, untoggle = module.toggle_optimizer, module.untoggle_optimizer
    saved: dict[int, bool] = {}

    def toggle_optimizer(optimizer: Any) -> None:
        toggle(optimizer)
        mine = strategy._binding_of(optimizer)
        if mine is None or strategy.engine is None:
            return
        params = strategy.engine.manager.params
        for b in strategy.engine.bindings:  # a parameter is in one optimizer at most (checked at set-up)
            for i in (i for g in b.group_params for i in g if b is not mine):
                saved.setdefault(i, params[i].requires_grad)
                params[i].requires_grad_(False)

    def untoggle_optimizer(optimizer: Any) -> None:
        untoggle(optimizer)
        if strategy.engine is not None:
            for i, flag in saved.items():
                strategy.engine.manager.params[i].requires_grad_(flag)
        saved.clear()

    module.__dict__["toggle_optimizer"] = toggle_optimizer
    module.__dict__["untoggle_optimizer"] = untoggle_optimizer
