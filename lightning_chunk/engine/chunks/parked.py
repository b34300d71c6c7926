"""A released parameter's class ([Note: a parked parameter's class]).

[Note: a parked parameter's class]
While its chunk is released a parameter shows a NaN placeholder ([Note: a released parameter] in ``chunk.py``). The
warm-up checks every op for it ([Note: parameters read outside their owner] in ``runtime/reads.py``), but a read
through a reference the engine cannot follow (a list made before training) that only a later step makes — a
penalty every tenth step — computed with NaN and trained to NaN weights, silently: a check of every op costs a
Python call per op in every step. The parameter's class costs nothing: while parked it is a subclass of its own
class (``isinstance`` holds) whose ``__torch_function__`` hands each op to ``READERS``, which the runtime fills
with a check that refuses a read of values, naming the parameter; gathered, it is its own class again, with no
``__torch_function__`` of its own, so the ops of a step pay nothing. The engine changes ``.data`` and the class
together through ``show`` and nowhere else, and reads a parked parameter's version counter, storage and
``requires_grad`` in its loops under ``engine_reads``: dispatched through the class each read cost 2.5 us, ten of
them a parameter a step, where the plain read costs 0.1-0.5 us. A view taken of a parked parameter (``.T``,
``.data``, ``detach()``, ``[0]``) reads no values, so it passes, but it shows the placeholder's NaN for good: it
is parked too, with the parameter it came from (``parked_from``) for the refusal to name — a plain view computed
``refs[0].T.pow(2).sum()`` with NaN after the warm-up and trained to NaN, unseen."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

# the runtime's checks, newest last: each raises for an op that reads a parked parameter's values
READERS: list[Callable[[Any, tuple, dict], None]] = []


class _Parked:
    _parked_base: type

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if READERS:
            READERS[-1](func, args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                _park_view(out, args)
            elif isinstance(out, (tuple, list)):  # split, chunk, unbind
                for o in out:
                    if isinstance(o, torch.Tensor):
                        _park_view(o, args)
            return out


def _park_view(out: torch.Tensor, args: tuple) -> None:
    """``out`` parked too if it views a parked argument's placeholder ([Note: a parked parameter's class])."""
    if isinstance(out, _Parked):
        return
    for a in args:
        if isinstance(a, torch.Tensor) and isinstance(a, _Parked):
            try:
                same = out.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # meta and fake tensors hold no storage
                return
            if same:
                out.__class__ = parked_class(type(out))
                out.parked_from = parked_from(a)  # type: ignore[attr-defined]
            return


def parked_from(t: torch.Tensor) -> torch.Tensor:
    """The parameter a parked tensor is, or is a view of."""
    return getattr(t, "parked_from", t)


_CLASSES: dict[type, type] = {}


def parked_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Parked{base.__name__}", (_Parked, base), {"_parked_base": base})
    return cls


def own_class(t: torch.Tensor) -> type:
    return getattr(type(t), "_parked_base", type(t))


def is_parked(t: Any) -> bool:
    return isinstance(t, _Parked)


F = TypeVar("F", bound=Callable[..., Any])


def engine_reads(fn: F) -> F:
    """``fn`` runs without the parked class's dispatch ([Note: a parked parameter's class])."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return fn(*args, **kwargs)

    return wrapped  # type: ignore[return-value]


def show(param: torch.Tensor, value: torch.Tensor, *, parked: bool = False) -> None:
    """``param.data = value``, the parameter's class parked or its own ([Note: a parked parameter's class])."""
    base = own_class(param)
    if type(param) is not base:
        param.__class__ = base
    param.data = value
    if parked:
        param.__class__ = parked_class(base)
