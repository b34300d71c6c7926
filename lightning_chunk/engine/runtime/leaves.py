"""Leaf modules: modules that own their whole subtree's parameters.

[Note: leaf modules]
Hooks go on every module that owns parameters, and a module's parameters are gathered when its own forward runs.
Some modules read a child's parameters without calling the child: torch's MultiheadAttention passes
``out_proj.weight`` to ``F.multi_head_attention_forward``, and TransformerEncoderLayer's fast path (evaluation,
no grad) hands every child's tensors to one fused op. The child's chunk was then never gathered for them:
"setStorage ... storage of size 0" in forward, and in backward an IllegalTransitionError (a gradient for a
parameter no forward had in use). Such a module is a *leaf*: it owns its whole subtree's parameters, gathered at
its own forward, and its descendants get no hooks (DeepSpeed's "ZeRO-3 leaf modules"). The classes below are
leaves always; ``ChunkConfig.leaf_modules`` adds a user's own.

A module with a parametrization (``torch.nn.utils.parametrize``: ``weight_norm``, ``orthogonal``, a user's own) is a
leaf too. Its ``weight`` is computed by a child ``ParametrizationList`` from the ``original`` it owns, and what that
child returns can be the ``original`` itself (an identity, or a parametrization that returns its input): with the
child hooked, its forward's end let the payload go and the parent's ``F.linear`` read the released placeholder
(NaN, under host placement). As a leaf, the parent gathers the originals for its whole forward and backward.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.utils import parametrize

ALWAYS_LEAVES: tuple[type, ...] = (
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerDecoderLayer,
)


class ModuleClasses:
    """Which modules are instances of the classes a user named (a class, its ``__name__``, or an importable dotted
    path such as ``"torch.nn.TransformerEncoderLayer"``, which is also matched by ``module.qualname``). Remembers
    which entries matched a module."""

    def __init__(self, extra: Iterable[Any]) -> None:
        self.extra = tuple(extra)
        self._types: dict[type, Any] = {}  # class -> the entry that named it
        self._names: dict[str, Any] = {}
        for entry in self.extra:
            cls = entry if isinstance(entry, type) else _import_class(entry)
            if cls is not None:
                self._types[cls] = entry
            else:
                self._names[entry] = entry
        self.matched: set[int] = set()  # indices into ``extra``

    def __call__(self, mod: torch.nn.Module) -> bool:
        hit = [e for cls, e in self._types.items() if isinstance(mod, cls)]
        if self._names:
            for c in type(mod).__mro__:
                for key in (c.__name__, f"{c.__module__}.{c.__qualname__}"):
                    if key in self._names:
                        hit.append(self._names[key])
        self.matched.update(i for i, e in enumerate(self.extra) if any(e is h for h in hit))
        return bool(hit)

    def unmatched(self) -> list[Any]:
        """The user's entries that named no module of the model seen so far."""
        return [e for i, e in enumerate(self.extra) if i not in self.matched]

    def refuse_unmatched(self, field: str, module: torch.nn.Module) -> None:
        """Raise, naming ``field`` and the model's module classes, if an entry named no module of ``module``."""
        unmatched = self.unmatched()
        if unmatched:
            classes = sorted({type(m).__name__ for m in module.modules()})
            raise ValueError(
                f"{field}={list(self.extra)!r}: {unmatched!r} names no module of this model; give a module class, "
                f"its name or an importable path (pkg.module.Class). The model's module classes: {', '.join(classes)}."
            )


class LeafModules(ModuleClasses):
    """Which modules are leaves: instances of ``ALWAYS_LEAVES``, parametrized modules, or instances of the classes
    ``ChunkConfig.leaf_modules`` names."""

    def __call__(self, mod: torch.nn.Module) -> bool:
        if isinstance(mod, ALWAYS_LEAVES) or parametrize.is_parametrized(mod):
            return True
        return super().__call__(mod)


def _import_class(name: str) -> type | None:
    """``"pkg.mod.Class"`` imported, when it names an importable ``nn.Module`` subclass; else ``None``."""
    module, _, attr = name.rpartition(".")
    if not module:
        return None
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, torch.nn.Module) else None
