"""An optimizer the engine does not know, taken as element-wise on the user's word: the word checked on twins.

[Note: an optimizer said to be element-wise]
``assume_elementwise_optimizer=True`` accepts an optimizer class the engine does not know. Several ranks each step
their pieces of the parameters, and stepping in backward (or the disk tier) steps a group in several calls over
some of its parameters, so an update that reads more than its own element computes something else there: a norm
over the parameter (LAMB's and LARS's trust ratio) is taken over a piece, a sum over the group (Prodigy's step
size, a global normalisation) over the parameters of one call or of one rank: silently. So the word is checked once
at set-up, on twins: a fresh optimizer of the same class built with each group's hyperparameters (those its
constructor names) steps 64 random elements three times as one parameter, as two parameters (24 and 40 elements)
in one optimizer, and as the same two in two optimizers. The last two differing beyond rounding (1e-4 relative)
shows a dependence across parameters, refused where this run splits a group (several ranks, stepping in backward, a
host limit that may put chunks on disk); else the first two differing shows one within a parameter, refused with
several ranks. A class the twins cannot build or step (SAM takes its base optimizer) is taken on the word alone. An
update that depends on a parameter's shape (Shampoo's preconditioners) cannot be seen on flat twins.
"""

from __future__ import annotations

import enum
import inspect
from typing import Any

import torch


class Dependence(enum.Enum):
    """What an element's update read beside the element, on the twins."""

    ACROSS = "across the parameters of a group"  # refused where a group is stepped in several calls
    WITHIN = "within a parameter"  # refused where a parameter is stepped in pieces (several ranks)

    def __str__(self) -> str:
        return self.value


def twin_settings(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, Any] | None:
    """The settings of ``group`` that ``type(optimizer)``'s constructor takes, to build a twin of it (not the kernel
    choice); ``None`` where its signature cannot be read. Only those: torch's ``AdamW`` keeps
    ``decoupled_weight_decay`` in its defaults and refuses it as an argument."""
    try:
        accepted = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return None
    anything = any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())
    names = set(optimizer.defaults) if anything else set(accepted) - {"self"}
    return {k: v for k, v in group.items() if k in names and k not in ("params", "fused", "foreach")}


def dependence(optimizer: torch.optim.Optimizer) -> Dependence | None:
    """``ACROSS`` or else ``WITHIN`` where a group's update of an element read other elements on the twins, else
    ``None`` (element-wise as far as twins show, or twins that could not be built)."""
    cls = type(optimizer)
    seen: set[tuple[str, ...]] = set()
    for group in optimizer.param_groups:
        kwargs = twin_settings(optimizer, group)
        if kwargs is None:
            return None
        key = tuple(sorted(f"{k}={v!r}" for k, v in kwargs.items()))
        if key in seen:
            continue
        seen.add(key)
        try:
            whole, together, apart = (_stepped(cls, kwargs, split) for split in ([[64]], [[24, 40]], [[24], [40]]))
        except Exception:  # a constructor or step the twins cannot satisfy
            return None
        if not _close(together, apart):  # first: refused wherever the other is, and more
            return Dependence.ACROSS
        if not _close(whole, together):
            return Dependence.WITHIN
    return None


def _stepped(cls: type, kwargs: dict[str, Any], split: list[list[int]]) -> torch.Tensor:
    """The same 64 elements stepped three times by ``len(split)`` twins holding tensors of these sizes."""
    g = torch.Generator().manual_seed(0)
    start, grads = torch.randn(64, generator=g), [torch.randn(64, generator=g) for _ in range(3)]
    sizes = [n for ns in split for n in ns]
    tensors = [t.clone() for t in start.split(sizes)]
    twins, k = [], 0
    for ns in split:
        twins.append(cls(tensors[k : k + len(ns)], **kwargs))
        k += len(ns)
    for grad in grads:
        for t, piece in zip(tensors, grad.split(sizes), strict=True):
            t.grad = piece.clone()
        for twin in twins:
            twin.step()
    return torch.cat([t.detach() for t in tensors])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6, equal_nan=True))
