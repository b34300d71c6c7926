"""A ``save_pretrained`` directory in the layout transformers converts when it loads, read as the model's own names.

[Note: converted checkpoints]
transformers 5 keeps some models' weights in another layout than their checkpoints: a mixture of experts (Mixtral,
Qwen-MoE, DeepSeek, OLMoE, ...) holds each layer's experts as one 3D tensor (``mlp.experts.gate_up_proj``) where the
checkpoint has a tensor per expert and projection (``block_sparse_moe.experts.0.w1.weight``), and legacy names
(``gamma``, ``beta``) are renamed. ``from_pretrained`` converts on load with the model's conversion mapping
(``transformers.conversion_mapping``), and ``save_pretrained`` writes the checkpoint layout back. Streamed into the
chunks by name, such a checkpoint matched nothing of the model ("Tensors missing from the file: ...gate_up_proj"),
so every Mixtral, Qwen-MoE or DeepSeek checkpoint was refused.

``converted(weights, module)`` reads the file through that mapping, planned up front as ``from_pretrained`` plans it
(``rename_source_key`` for each checkpoint key, grouped per converter): a renamed tensor is read as before, in pieces;
a converted one (experts merged, gate and up concatenated) is made by the converter itself from its whole source
tensors when the pack first asks for it, kept while the pack reads its pieces, and let go for the next. Its shape is
known before any read by running the converter on meta tensors, so ``ModuleWeights`` checks every name and shape
first, as for any file. A rank reads a converted tensor's sources whole, where it reads only its own piece of a
plain one. Where the installed transformers has no conversion API, the file is read by its own names.

The export goes back (``saved_layout``, ``as_saved``): each of the model's tensors streams out as the tensors
``save_pretrained`` writes for it (transformers' own reverse conversion, planned on meta tensors), so the export
has the names and layout of the checkpoint the model came from, which tools other than transformers 5 read.
"""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Any

import torch

from .engine.files.weights import Weights, WeightsError

_GROUPS_KEPT = 2  # converted groups whose tensors stay made: the pack reads a tensor's pieces in a row


class _Group:
    """The checkpoint tensors one converter turns into one or more of the model's tensors."""

    def __init__(self, converter: Any, first: str) -> None:
        self.converter = converter  # the mapping's template, copied for each conversion
        self.first = first  # the name the converter is asked for (its first target)
        self.sources: list[tuple[str, str]] = []  # (source pattern, checkpoint key), in the checkpoint's order
        self.targets: dict[str, torch.Tensor] = {}  # the model's name -> a meta tensor of its shape and dtype


class HFConvertedWeights(Weights):
    """``inner`` read as ``model``'s names through its transformers conversion mapping ([Note: converted
    checkpoints])."""

    def __init__(self, inner: Weights, model: torch.nn.Module, mapping: list[Any]) -> None:
        from transformers.core_model_loading import (  # converted() checked that they import
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )

        self.inner, self.model, self.path = inner, model, inner.path
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        named = model.state_dict(keep_vars=True)
        prefix = getattr(model, "base_model_prefix", None)
        self._plain: dict[str, str] = {}  # the model's name (or an unmatched checkpoint key) -> checkpoint key
        groups: dict[str, _Group] = {}
        self.converts = False  # a transform, not only the base model's prefix, changed a name
        for key in sorted(inner.keys(), key=dot_natural_key):  # as from_pretrained orders them (experts 0, 1, .. 10)
            name, pattern = rename_source_key(key, renamings, converters, prefix, named)
            self.converts |= pattern is not None or rename_source_key(key, renamings, converters)[0] != key
            if name not in named and key in named:
                name, pattern = key, None
            if pattern is None or name not in named:
                self._plain.setdefault(name if name in named else key, key)
                continue
            groups.setdefault(name, _Group(by_pattern[pattern], name)).sources.append((pattern, key))
        self._group_of: dict[str, _Group] = {}
        for group in groups.values():
            for target, t in self._convert(group, meta=True).items():
                group.targets[target] = t
                self._group_of[target] = group
        self._made: dict[int, dict[str, torch.Tensor]] = {}  # id(group) -> its tensors, the latest last

    def _convert(self, group: _Group, *, meta: bool) -> dict[str, torch.Tensor]:
        conv = copy.deepcopy(group.converter)
        for pattern, key in group.sources:
            shape, dtype = self.inner.shape(key), self.inner.dtype(key)

            def make(k: str = key, s: torch.Size = shape, d: torch.dtype = dtype) -> torch.Tensor:
                return torch.empty(s, dtype=d, device="meta") if meta else self.inner.read(k).view(s)

            conv.add_tensor(group.first, key, pattern, make)
        try:
            out = conv.convert(group.first, model=self.model, config=getattr(self.model, "config", None))
        except Exception as e:  # noqa: BLE001 - named with the tensors it was converting
            keys = ", ".join(k for _, k in group.sources[:4]) + (" ..." if len(group.sources) > 4 else "")
            raise WeightsError(
                f"weights {self.path}: transformers' conversion of {keys} into {group.first} failed "
                f"({type(e).__name__}: {e}); load the model with from_pretrained outside configure_model instead."
            ) from None
        return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}

    def keys(self) -> list[str]:
        return [*self._plain, *self._group_of]

    def shape(self, key: str) -> torch.Size:
        group = self._group_of.get(key)
        return group.targets[key].shape if group is not None else self.inner.shape(self._plain[key])

    def dtype(self, key: str) -> torch.dtype:
        group = self._group_of.get(key)
        return group.targets[key].dtype if group is not None else self.inner.dtype(self._plain[key])

    def read(self, key: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        group = self._group_of.get(key)
        if group is None:
            return self.inner.read(self._plain[key], a, b)
        made = self._made.pop(id(group), None)
        if made is None:
            made = {k: v.contiguous() for k, v in self._convert(group, meta=False).items()}
            while len(self._made) >= _GROUPS_KEPT:
                del self._made[next(iter(self._made))]
        self._made[id(group)] = made  # the latest last
        return made[key].reshape(-1)[a:b]


def pretrained_class() -> type | None:
    """``transformers.PreTrainedModel`` where the module defining it is loaded; ``None`` where no model of it can exist.
    Not whether ``transformers`` is in ``sys.modules``: ``import lightning`` puts its lazy top module there wherever it
    is installed, and ``from transformers import PreTrainedModel`` then loads the modelling code (0.4 s on the 2-core
    CI machine, in every process that fits a model that is not a transformers one, at set-up or teardown)."""
    return getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)


def converted(weights: Weights, module: torch.nn.Module) -> Weights:
    """``weights`` read through the conversion mapping of the transformers model in ``module`` (the outermost one,
    where every outermost one is of one class), or ``weights`` itself where there is none or it converts nothing."""
    pretrained = pretrained_class()
    found: dict[str, Any] = {}  # the transformers models in it, by name
    if pretrained is not None:
        found = {n: m for n, m in module.named_modules() if isinstance(m, pretrained)}
    if not found:  # no transformers model in the module
        return weights
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (  # noqa: F401 - what HFConvertedWeights uses
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # a transformers without the conversion API: read the file by its names
        return weights
    outer = [m for n, m in found.items() if not any(n.startswith(f"{o}.") or (o == "" != n) for o in found)]
    if not outer or len({type(m) for m in outer}) > 1:
        return weights
    view = HFConvertedWeights(weights, outer[0], get_model_conversion_mapping(outer[0]))
    # a file no transform changes is read by its own names: a consolidated checkpoint of a module holding the model
    # beside other parameters ("model.model.layers..", "head.weight") keeps the names ModuleWeights matches whole
    return view if view.converts else weights


def saved_layout(model: Any, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, torch.Size]] | None:
    """Each of ``model``'s names (``shapes``: those ``save_pretrained`` keeps) as the names and shapes
    ``save_pretrained`` writes it, where transformers reverts a conversion for this model on save (experts one by
    one); ``None`` where it writes the model's own names, or where a saved tensor needs several of the model's at once
    (then the model's own names, which transformers 5 loads, are written: a warning says so)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    meta = {k: torch.empty(s, device="meta") for k, s in shapes.items()}
    whole = {n: t.shape for n, t in revert_weight_conversion(model, dict(meta)).items()}
    if whole == {k: t.shape for k, t in meta.items()}:
        return None
    alone = {k: {n: t.shape for n, t in revert_weight_conversion(model, {k: t}).items()} for k, t in meta.items()}
    if {n: s for d in alone.values() for n, s in d.items()} != whole:
        warnings.warn(
            f"{type(model).__name__}: save_pretrained writes some tensors from several of the model's at once, which "
            "a streamed export does not hold together; the model's own names are written (transformers 5 loads them).",
            stacklevel=3,
        )
        return None
    return alone


def as_saved(model: Any, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """``value`` of ``model``'s ``name`` as the tensors ``save_pretrained`` writes for it (``saved_layout``)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {n: v[0] if isinstance(v, list) else v for n, v in revert_weight_conversion(model, {name: value}).items()}
