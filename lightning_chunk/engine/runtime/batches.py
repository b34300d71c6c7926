"""The tensors in what a step is handed and in what a module returns, found where Lightning's ``apply_to_collection``
finds them to move a batch: in lists and tuples (named ones too), mappings of any kind and dataclasses.

A pytree walk sees only the containers registered with torch: ``dict``, ``list``, ``tuple``, a named tuple, and what
a library registers (Hugging Face's ``ModelOutput``). A collator's ``BatchEncoding`` (a ``UserDict``) or a dataclass
batch counted 0 input bytes, so dynamic padding grew past the warm-up's activations unseen ([Note: inputs that grow
after the warm-up] in ``schedule/growth.py``); a module that owns parameters and returned its tensors in a dataclass
or a ``UserDict`` got no pre-backward hook, and its backward failed with an ``IllegalTransitionError`` that blamed a
parameter read outside its module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils._pytree import SUPPORTED_NODES, tree_flatten


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``, depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name))
    elif type(obj) in SUPPORTED_NODES:  # another container a library registered with torch's pytree
        for v in tree_flatten(obj)[0]:
            yield from tensors_in(v)


def input_bytes(*args: Any, **kwargs: Any) -> int:
    """Bytes of every tensor in a step's arguments."""
    return sum(t.numel() * t.element_size() for t in tensors_in((args, kwargs)))
