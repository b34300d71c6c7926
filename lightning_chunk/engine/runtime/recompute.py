"""Activation checkpointing named in the configuration.

[Note: activation checkpointing by class]
Lightning's FSDP strategy takes ``activation_checkpointing_policy={Block}`` and DeepSpeed's config an
``activation_checkpointing`` section, so a model is checkpointed without a change to its code. Here
``ChunkConfig.activation_checkpointing`` names module classes as ``leaf_modules`` does (a class, its name, or an
importable path), and before the hooks go in each instance gets torch's composable ``checkpoint(module)``: its
forward keeps no activations, and backward runs it again, non-reentrant, with the forward's random state restored
(dropout draws the same masks). Parameter names are unchanged; a wrapper module (``checkpoint_wrapper``) would add a
prefix to every ``state_dict`` key and checkpoint. The engine's hooks go on after checkpoint's own, the order of a
model that applies ``checkpoint`` itself: a block's parameters are gathered before its checkpointed region and let
go after it, and the recomputation gathers them again like any backward.

A module inside one already checkpointed is left alone (nested regions recompute the inner forward twice over), as
is one checkpointed already (by the model, or by an earlier fit: torch applies it once). It stays after ``fit``, as
FSDP's wrappers do. Naming the model itself is refused: its forward is the whole step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed._composable import checkpoint

from .leaves import ModuleClasses


def apply_activation_checkpointing(module: torch.nn.Module, classes: Iterable[Any]) -> int:
    """Composable ``checkpoint`` on each outermost instance of ``classes`` in ``module``; the number of modules
    checkpointed (those checkpointed already included)."""
    match = ModuleClasses(classes)
    if not match.extra:
        return 0
    inside: set[int] = set()
    count = 0
    for mod in module.modules():  # parents before their children
        if id(mod) in inside or not match(mod):
            continue
        if mod is module:
            raise ValueError(
                f"activation_checkpointing={list(match.extra)!r} names the model itself ({type(module).__name__}); "
                "name the blocks whose activations should be recomputed in backward."
            )
        if checkpoint.state(mod) is None:
            checkpoint(mod)
        inside.update(id(m) for m in mod.modules())
        count += 1
    match.refuse_unmatched("activation_checkpointing", module)
    return count
