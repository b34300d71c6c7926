"""Parameters read outside the module that owns them.

[Note: parameters read outside their owner]
A module's parameters are gathered when its own forward runs (``hooks.py``). Code that reads a parameter by
attribute somewhere else — a GPT-2 style tied head in the LightningModule's ``forward``
(``F.linear(h, self.tok.weight)``, ``h @ self.wte.weight.T``), a table indexed in ``training_step``
(``self.pos.weight[idx]``), a block that uses a child's weight without calling the child — read it after its
module's forward had let it go. With the payload released, ``.data`` is the placeholder of
[Note: a released parameter] in ``chunks/parked.py``: the step computed with NaN and trained to NaN weights, silently.
Resident but not in use, its backward could find it released later and compute with NaN there.

While a step's forward runs, each managed module's ``_parameters`` is a ``WatchedParameters``: reading a
parameter by attribute (``module.weight``) or by iteration (``module.parameters()``) tells the hooks. A parameter
its own module's forward has in use (COMPUTE) needs nothing. Any other, read by attribute, is *adopted* by the
innermost module of the model whose code runs (found on the Python stack; the root, for reads in
``forward``/``training_step`` outside every child): gathered now, in use until that module's forward ends, and
from then on owned by that module as a parameter tied by assignment is — gathered at its forward and before its
backward, counted by the trace, the chunk size and the limit check. The warm-up is traced again at the next
training micro-batch, since the moments changed. Once: in later steps the tied head's read comes after the
embedding's forward let the weight go again, and it is gathered for the read with no new adoption (each step's
read had counted as one, and every step was traced and repacked again). This is DeepSpeed's ``ZeROOrderedDict``,
which registers such parameters as "external parameters" of the running module. A read by iteration (an L2 penalty over
``self.parameters()``, values recorded in ``training_step``) is usually a one-off, and adopting every parameter
for good would keep the whole model gathered for every later step: it is *held* instead, gathered and in use
until this micro-batch's backward ends (its graph may read it there), and let go after.

What the watch cannot see: a parameter reached other than as a module attribute (a reference kept in a plain list
or a closure before training). Such a read finds the placeholder. While a warm-up micro-batch runs (and the first
evaluation step), ``ReleasedReads`` looks at every torch function's tensor arguments: one that views a
placeholder's storage (the parameter, or a view of it such as ``w.T``) raises at once, naming the parameter and
the fix — read it as a module attribute, or name the module that reads it in ``leaf_modules``, so that it owns
its subtree ([Note: leaf modules] in ``leaves.py``), the root included. Later steps run the same code, so a read
the warm-up did not make is one a data-dependent branch makes (a penalty every tenth step); they are not checked
op by op (a Python call per torch function would cost every step), but by the released parameter's class, which
costs nothing ([Note: a parked parameter's class] in ``chunks/parked.py``): an op on the parameter itself raises
the same error (one on a view taken of it, ``w.T``, is seen in the warm-up only).

The watch costs a dictionary look-up per attribute read during a step, none outside one. A module is copied or
pickled with a plain dict (``__reduce_ex__``), so copies (an EMA's, a deep copy in a callback) and saved modules
carry nothing of the engine, and ``unwatch`` puts plain dicts back when the engine is torn down.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..chunks.parked import READERS, is_parked, parked_from, placeholder_storages
from ..errors import ChunkError

if TYPE_CHECKING:  # a type only: outside_autocast.py enters CastUp
    from .outside_autocast import OutsideAutocast

_PARKED_READS: dict[int, Callable[[Any, tuple, dict], None]] = {}  # by the id of the module watched
Reader = Callable[[torch.Tensor, bool], None]  # (parameter, read by attribute: else by iteration)
_CLIP_FILE = os.path.join("torch", "nn", "utils", "clip_grad.py")
_CLIPPERS = frozenset({"clip_grad_norm_", "clip_grad_norm", "clip_grad_value_"})

_reader: Reader | None = None  # the engine whose step is running; one step runs at a time in a process
_idle: Reader | None = None  # the reader between steps, when no step's reader is set


def _set_idle(reader: Reader | None) -> None:
    global _reader, _idle
    if _reader is _idle:
        _reader = reader
    _idle = reader


class WatchedParameters(dict):
    """A module's ``_parameters`` while the engine runs: reads by attribute or iteration go to the step's reader."""

    __slots__ = ()

    def __getitem__(self, name: str) -> Any:
        p = dict.__getitem__(self, name)
        if _reader is not None and p is not None:
            _reader(p, True)
        return p

    def values(self) -> Any:  # type: ignore[override]
        if _reader is None:
            return dict.values(self)
        return [v for _, v in self.items()]

    def items(self) -> Any:  # type: ignore[override]
        reader = _reader
        if reader is None:
            return dict.items(self)
        out = list(dict.items(self))
        for _, p in out:
            if p is not None:
                reader(p, False)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        return dict, (dict(dict.items(self)),)


# torch functions that read no values: metadata, views (an op on the view is checked), hooks, the engine's own
# ``param.data = ...``
_NOT_READS = frozenset(
    {
        "__get__",
        "__set__",
        "size",
        "dim",
        "numel",
        "stride",
        "storage_offset",
        "untyped_storage",
        "data_ptr",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_signed",
        "is_inference",
        "is_pinned",
        "is_shared",
        "is_set_to",
        "is_same_size",
        "is_conj",
        "is_neg",
        "dim_order",
        "storage",
        "retain_grad",
        "is_contiguous",
        "__hash__",
        "__len__",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "requires_grad_",
        "detach",
        "view",
        "view_as",
        "expand",
        "expand_as",
        "t",
        "transpose",
        "permute",
        "reshape",
        "flatten",
        "unsqueeze",
        "squeeze",
        "as_strided",
        "__getitem__",
        "split",
        "chunk",
        "narrow",
        "select",
        "unbind",
        "_is_view",
        "is_leaf",
        "get_device",
        "_has_compatible_shallow_copy_type",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "new_empty",
        "new_zeros",
        "new_ones",
        "new_full",
    }
)


def _reads_values(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a torch function reads its tensors' values: not one of ``_NOT_READS``, nor ``p.type()`` asked for the
    type's name."""
    name = getattr(func, "__name__", "")
    return name not in _NOT_READS and not (name == "type" and len(args) == 1 and not kwargs)


class ReleasedReads(TorchFunctionMode):
    """An op that reads a released parameter's placeholder raises ([Note: parameters read outside their owner]).
    ``name(tensor)``: the parameter's name, if ``tensor`` is a managed parameter. ``marks``: under mixed precision,
    what marks the parameters ops read with autocast off ([Note: parameters read outside autocast])."""

    def __init__(self, name: Callable[[torch.Tensor], str | None], marks: OutsideAutocast | None = None) -> None:
        super().__init__()
        self.name = name
        self.marks = marks

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _reads_values(func, args, kwargs):
            flat, spec = tree_flatten((args, kwargs)) if self.marks is not None else (_tensors(args, kwargs), None)
            released = placeholder_storages()
            if released:
                for t in flat:
                    if isinstance(t, torch.Tensor) and _storage(t) in released:
                        raise self._refusal(func, t)
            if self.marks is not None:
                return self.marks.call(func, args, kwargs, flat, spec)
        return func(*args, **kwargs)

    def _refusal(self, func: Any, t: torch.Tensor) -> ChunkError:
        return _kept_reference(f"{getattr(func, '__name__', func)} read {_named(self.name(t), t)}")


def parked_reads(name: Callable[[torch.Tensor], str | None]) -> Callable[[Any, tuple, dict], None]:
    """The check a parked parameter's class hands its ops to ([Note: a parked parameter's class] in
    ``chunks/parked.py``): an op that reads its values raises, naming it."""

    def check(func: Any, args: tuple, kwargs: dict) -> None:
        if _reads_values(func, args, kwargs):
            flat = [t for t in tree_flatten((args, kwargs))[0] if is_parked(t)]
            param = parked_from(flat[0]) if flat else None
            read = _named(name(param), param) if param is not None else "a parameter"
            what = f"{getattr(func, '__name__', func)} read {read}"
            raise _kept_reference(what)

    return check


def _named(what: str | None, t: torch.Tensor) -> str:
    return f"parameter {what!r}" if what else f"a released parameter (shape {tuple(t.shape)})"


def _kept_reference(happened: str) -> ChunkError:
    return ChunkError(
        f"{happened} while its chunk was released: the code holds a reference the engine cannot follow (a list or "
        "closure made before training, not a module attribute), so it would compute with NaN. Read the parameter "
        "as an attribute of its module (self.tok.weight), or name the module whose forward reads it in "
        "ChunkOffloadStrategy(leaf_modules=[...]) (the LightningModule itself included)."
    )


class CastUp(TorchFunctionMode):
    """``marks``' cast alone, for a backward that runs a checkpointed block's forward again before the parameters
    its first run marked have moved ([Note: parameters read outside autocast])."""

    def __init__(self, marks: OutsideAutocast) -> None:
        super().__init__()
        self.marks = marks

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _reads_values(func, args, kwargs):
            return self.marks.call(func, args, kwargs, *tree_flatten((args, kwargs)))
        return func(*args, **kwargs)


def _tensors(args: tuple, kwargs: dict) -> list[Any]:
    """The tensors among a torch function's arguments and one level into lists and tuples (``torch.cat([a, b])``):
    ``tree_flatten`` costs several microseconds an op."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(a)
    return out


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta and fake tensors (dynamo tracing) hold no storage
        return -1


def watch(
    module: torch.nn.Module, idle: Reader | None = None, name: Callable[[torch.Tensor], str | None] | None = None
) -> None:
    """Give every submodule of ``module`` a ``WatchedParameters`` (idempotent); ``idle`` takes the reads made while
    no step's reader is set ([Note: writes through .data] in ``memory/full_params.py``); ``name`` names the
    parameters whose parked class refuses a read ([Note: a parked parameter's class])."""
    _set_idle(idle)
    if name is not None and id(module) not in _PARKED_READS:
        _PARKED_READS[id(module)] = parked_reads(name)
        READERS.append(_PARKED_READS[id(module)])
    for mod in module.modules():
        params = mod.__dict__.get("_parameters")
        if params is not None and type(params) is dict:
            mod.__dict__["_parameters"] = WatchedParameters(params)


def unwatch(module: torch.nn.Module) -> None:
    """Plain dicts again, with whatever the module holds now."""
    _set_idle(None)
    check = _PARKED_READS.pop(id(module), None)
    if check in READERS:
        READERS.remove(check)
    for mod in module.modules():
        params = mod.__dict__.get("_parameters")
        if isinstance(params, WatchedParameters):
            mod.__dict__["_parameters"] = dict(dict.items(params))


def current_reader() -> Reader | None:
    """The reader reads go to now: a step's, the one between steps, or ``None``."""
    return _reader


@contextlib.contextmanager
def reading(reader: Reader) -> Iterator[None]:
    """Send attribute reads of watched parameters to ``reader`` inside this block (a step's forward)."""
    global _reader
    before, _reader = _reader, reader
    try:
        yield
    finally:
        _reader = before


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """No reads reported inside this block (the engine's own work during a read)."""
    global _reader
    before, _reader = _reader, None
    try:
        yield
    finally:
        _reader = before


def refuse_clipping_without_gradients(param: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Raise where torch's ``clip_grad_norm_``/``clip_grad_value_`` is reading ``param``, which has no ``.grad``, and
    no parameter of ``params`` has one: the gradients are in the shards, so it would clip nothing and return a norm
    of 0, silently ([Note: gradients read where they are not] in ``precision.py``). Inside
    ``full_parameters(with_grads=True)`` the gradients are there: a parameter without one got none this step."""
    if param.grad is not None or not param.requires_grad:
        return
    f: Any = sys._getframe(1)
    for _ in range(12):
        if f is None:
            return
        if f.f_code.co_name in _CLIPPERS and f.f_code.co_filename.endswith(_CLIP_FILE):
            if any(p.grad is not None for p in params):
                return
            raise ChunkError(
                f"torch.nn.utils.{f.f_code.co_name} found no gradients: under chunk_offload they are in the shards "
                "between backward and the step, and param.grad is None there, so it would clip nothing (and return "
                "a norm of 0). Clip the shards with Trainer(gradient_clip_val=...) or self.clip_gradients(optimizer, "
                "gradient_clip_val=..., gradient_clip_algorithm='norm' or 'value'); or call it inside `with "
                "self.trainer.strategy.full_parameters(with_grads=True):`, which gathers every gradient."
            )
        f = f.f_back
