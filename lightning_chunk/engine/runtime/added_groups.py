"""Param groups a user adds to an optimizer while training, followed by a repack.

[Note: param groups added while training]
A chunk holds the parameters of one param group (its ``ChunkKey.group``): their optimizer state has one layout and
one set of hyperparameters. ``optimizer.add_param_group`` while training (unfreezing a backbone at some epoch with
a learning rate of its own, as Lightning's ``BaseFinetuning`` callbacks do) gave the optimizer a group of module
parameters the engine had not packed, and the next step failed in a ``zip`` deep inside it. Before each training
micro-batch the engine now compares each optimizer's group count with the one it bound: the added groups' parameters
take new group numbers (one past every number in use, so no chunk already packed changes its key), and the model is
repacked as when ``requires_grad`` changes ([Note: requires_grad changed] in ``warmup.py``), one repack for both
where a callback unfreezes and adds a group at once. The optimizer then steps views of the new group's pieces, from
no state, with the group's own hyperparameters, as in PyTorch. A parameter that was in a group before is refused
(``add_param_group`` cannot see it: the groups it compares with hold views of shards). A group added inside
gradient accumulation, or between a backward and its step, is refused with where to add it instead; a refused group
leaves the optimizer, as torch's ``add_param_group`` adds nothing where it refuses. Several ranks must add the same
groups at the same micro-batch, as with any change to the model they run.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ..errors import ChunkError
from ..optim.binding import OptimizerBinding
from ..optim.kernels import check_optimizer, kernel_flags

if TYPE_CHECKING:
    from .engine import ChunkEngine


def follow_added_groups(engine: ChunkEngine) -> bool:
    """Give the parameters of the param groups added since the last bind their new group numbers (the caller
    repacks); whether any group was added."""
    grown = [b for b in engine.bindings if len(b.optimizer.param_groups) != len(b.group_params)]
    if not grown:
        return False
    mgr = engine.manager
    if not engine._no_grads_held:
        for b in grown:
            b.drop_unbound_groups()
        raise ChunkError(
            "a param group was added to "
            + ", ".join(type(b.optimizer).__name__ for b in grown)
            + " inside a step whose gradients are being accumulated; add it before a step's first micro-batch (in "
            "on_train_epoch_start, or in on_train_batch_start at an accumulation boundary)."
        )
    next_group = 1 + max((g for b in engine.bindings for g in b.groups), default=-1)
    for b in grown:
        for i, group in adopt_added_groups(b, next_group, engine.module).items():
            spec = mgr.specs[i]
            mgr.specs[i] = dataclasses.replace(spec, key=dataclasses.replace(spec.key, group=group))
        next_group = 1 + max(b.groups)
        engine._optim_bytes.update(b.state_bytes())
    return True


def adopt_added_groups(b: OptimizerBinding, next_group: int, module: torch.nn.Module) -> dict[int, int]:
    """The param groups added to ``b``'s optimizer since the bind, numbered from ``next_group`` on: parameter index ->
    its group's number. Nothing changes where a group is refused."""
    mgr, opt = b.manager, b.optimizer
    name, bound = type(opt).__name__, len(b.group_params)
    if len(opt.param_groups) < bound:
        raise ChunkError(
            f"{name} has {len(opt.param_groups)} param groups but had {bound}: chunk_offload follows param groups "
            "added while training (optimizer.add_param_group), not removed ones."
        )
    try:
        added = _added_indices(b, module)
    except ValueError:
        b.drop_unbound_groups()
        raise
    joined: dict[int, int] = {}
    for idx in added:
        b.group_params.append(idx)
        b.groups.append(next_group)
        joined.update(dict.fromkeys(idx, next_group))
        next_group += 1
    check_optimizer(opt, b.config, mgr.comm.world_size)
    b.kernel_flags = kernel_flags(opt, b.config.optimizer_kernel)
    if b.whole is not None:
        b.whole.regroup()
    return joined


def _added_indices(b: OptimizerBinding, module: torch.nn.Module) -> list[list[int]]:
    """Each added group's parameter indices; a tensor that is not a packed parameter, or one in a group already, is
    refused."""
    mgr, opt = b.manager, b.optimizer
    name = type(opt).__name__
    added: list[list[int]] = []
    for g in opt.param_groups[len(b.group_params) :]:
        added.append([])
        for p in g["params"]:
            i = mgr.index_of.get(id(p))
            if i is None:
                late = any(p is q for q in module.parameters())
                raise ValueError(
                    f"the param group added to {name} holds a tensor of shape {tuple(p.shape)} that "
                    + (
                        "became a parameter of the module after fit began; chunk_offload packs the module's "
                        "parameters at set-up: create it in __init__ or configure_model (frozen until it trains)."
                        if late
                        else "is not a parameter of the module; chunk_offload can only step module parameters."
                    )
                )
            if mgr.specs[i].key.group != -1 or any(i in idx for idx in added):
                raise ValueError(
                    f"parameter {mgr.names[i]!r} is in a param group already, and {name}.add_param_group added it "
                    "again: a parameter steps in one param group."
                )
            added[-1].append(i)
    return added


def views_in_groups(b: OptimizerBinding) -> None:
    """Point the groups ``b`` bound at their views again, where a callback replaced the groups by ones that hold the
    module's parameters (``BaseFinetuning`` restoring the groups it saved, at ``on_fit_start``)."""
    views = b.views()
    for k, g in enumerate(b.optimizer.param_groups[: len(b.group_params)]):
        g["params"] = [views[i] for i in b.group_params[k] if i in views]
