"""Parameters read outside the module that owns them.

[Note: parameters read outside their owner]
A module's parameters are gathered when its own forward runs (``hooks.py``). Code that reads a parameter by
attribute somewhere else — a GPT-2 style tied head in the LightningModule's ``forward``
(``F.linear(h, self.tok.weight)``, ``h @ self.wte.weight.T``), a table indexed in ``training_step``
(``self.pos.weight[idx]``), a block that uses a child's weight without calling the child — read it after its
module's forward had let it go. With the payload released, ``.data`` is the placeholder of
[Note: a released parameter] in ``chunk.py``: the step computed with NaN and trained to NaN weights, silently.
Resident but not in use, its backward could find it released later and compute with NaN there.

While a step's forward runs, each managed module's ``_parameters`` is a ``WatchedParameters``: reading a
parameter by attribute (``module.weight``) or by iteration (``module.parameters()``) tells the hooks. A parameter
its own module's forward has in use (COMPUTE) needs nothing. Any other, read by attribute, is *adopted* by the
innermost module of the model whose code runs (found on the Python stack; the root, for reads in
``forward``/``training_step`` outside every child): gathered now, in use until that module's forward ends, and
from then on owned by that module as a parameter tied by assignment is — gathered at its forward and before its
backward, counted by the trace, the chunk size and the limit check. The warm-up is traced again at the next
training micro-batch, since the moments changed. This is DeepSpeed's ``ZeROOrderedDict``, which registers such
parameters as "external parameters" of the running module. A read by iteration (an L2 penalty over
``self.parameters()``, values recorded in ``training_step``) is usually a one-off, and adopting every parameter
for good would keep the whole model gathered for every later step: it is *held* instead, gathered and in use
until this micro-batch's backward ends (its graph may read it there), and let go after.

What is not seen: a parameter reached other than as a module attribute (a reference kept in a plain list or a
closure before training). Such a read between uses sees the placeholder; ``leaf_modules`` names the module that
reads it, so that it owns its subtree ([Note: leaf modules] in ``leaves.py``), or the root, which then owns every
parameter for the whole step.

The watch costs a dictionary look-up per attribute read during a step, none outside one. A module is copied or
pickled with a plain dict (``__reduce_ex__``), so copies (an EMA's, a deep copy in a callback) and saved modules
carry nothing of the engine, and ``unwatch`` puts plain dicts back when the engine is torn down.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

Reader = Callable[[torch.Tensor, bool], None]  # (parameter, read by attribute: else by iteration)

_reader: Optional[Reader] = None  # the engine whose step is running; one step runs at a time in a process


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


def watch(module: torch.nn.Module) -> None:
    """Give every submodule of ``module`` a ``WatchedParameters`` (idempotent)."""
    for mod in module.modules():
        params = mod.__dict__.get("_parameters")
        if params is not None and type(params) is dict:
            mod.__dict__["_parameters"] = WatchedParameters(params)


def unwatch(module: torch.nn.Module) -> None:
    """Plain dicts again, with whatever the module holds now."""
    for mod in module.modules():
        params = mod.__dict__.get("_parameters")
        if isinstance(params, WatchedParameters):
            mod.__dict__["_parameters"] = dict(dict.items(params))


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
