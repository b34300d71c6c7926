"""A released parameter: the placeholder it shows ([Note: a released parameter]) and its class ([Note: a parked
parameter's class]).

[Note: a parked parameter's class]
While its chunk is released a parameter shows a NaN placeholder ([Note: a released parameter]). The
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


_NOT_A_VALUE: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def released_placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What a parameter shows while its chunk's payload is released ([Note: a released parameter]).

    [Note: a released parameter]
    A released payload's storage holds no bytes, and the views into it keep their shapes: code outside the
    engine that read a parameter between its uses (a callback logging a weight's norm between steps, Lightning's
    ``WeightAveraging``) read freed memory and crashed the process with a segmentation fault (host placement;
    several ranks, where the payloads go after each step). While its chunk is released, a parameter's ``.data``
    is instead one NaN (zero for integer dtypes) expanded to the parameter's shape, with its dtype and device:
    no memory, a read gives NaN, not a crash, and any write into it raises ("more than one element of the
    written-to tensor refers to a single memory location"), so nothing a user writes is silently lost. Read by
    attribute between steps, a read raises too ([Note: released parameters read between steps] in
    ``runtime/between_steps.py``). Gathering
    the chunk points the parameter back at its view of the payload. Tensors autograd saved are the parameters
    themselves (a node reads ``.data`` when it runs, after the pre-backward gather) or views of the payload's
    storage (valid again once it is re-filled), so training never sees the placeholder. Reading and writing the
    trained values between steps goes through ``ChunkOffloadStrategy.full_parameters()``."""
    key = (dtype, device)
    one = _NOT_A_VALUE.get(key)
    if one is None:
        one = _NOT_A_VALUE[key] = torch.full(
            (), float("nan") if dtype.is_floating_point else 0, dtype=dtype, device=device
        )
    return one.expand(shape)


_PLACEHOLDER_STORAGES: list[frozenset[int]] = [frozenset()]


def placeholder_storages() -> frozenset[int]:
    """The storages (``data_ptr``) that released parameters' placeholders view: one element each."""
    if len(_PLACEHOLDER_STORAGES[0]) != len(_NOT_A_VALUE):  # a placeholder of a new dtype or device was made
        _PLACEHOLDER_STORAGES[0] = frozenset(t.untyped_storage().data_ptr() for t in _NOT_A_VALUE.values())
    return _PLACEHOLDER_STORAGES[0]
