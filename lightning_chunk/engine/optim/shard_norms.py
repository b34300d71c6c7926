"""torch's norm clipping over the optimizer's own parameters, on several ranks; module gradients read where there
are none.

[Note: a norm over the optimizer's gradient shards]
The optimizer steps views of this rank's master shards (``binding.py``), and between backward and the step each view
holds its slice of the gradient shard (``grad_slots.py``), as ``param.grad`` does in plain PyTorch. On one rank the
views cover every parameter whole, and ``torch.nn.utils.clip_grad_norm_(optimizer.param_groups[0]["params"], ...)``
(or one call a param group) is plain PyTorch's to the bit. On several ranks each rank holds its own pieces: the norm
torch took was this rank's alone, each rank scaled its shard by a factor of its own, and training went away from DDP
without a word (a third of an update off on two ranks after four steps).

``ShardNorms`` watches where user code runs between backward and the step on several ranks: ``on_after_backward``,
``on_before_optimizer_step`` with the clipping Lightning does after it, and a manual ``training_step`` from its
backward to ``opt.step()`` (``ManualWindow``). A norm that torch's ``clip_grad.py`` (``clip_grad_norm_``,
``get_total_norm``) takes of a view's gradient raises, naming the ways that take the norm over every rank. Clipping
by value is element-wise, the same on shards, and runs. The engine's own clip (``gradients.py``) is not torch's file
and runs. A norm taken by hand (``vector_norm(v.grad)``) is not looked at. The same watch, on any number of ranks,
sees a read of a module parameter's ``.grad`` that finds ``None`` there (``Missing``: [Note: gradients read where
they are not] in ``precision.py``).

The watch is a ``TorchFunctionMode``, so it costs a Python call per torch function inside the window: the hooks,
and the few lines of a manual step between its backward and its step, never a forward (a mode there would also
break a compiled forward's graph at every op). The manual window opens in one call (the backward's end) and closes
in another (the step, the next backward, the end of ``training_step``), so torch's mode stack may have changed in
between. ``ManualWindow.close`` takes the mode off wherever it is, and puts back any the user's code entered above it
and has not left. A ``with`` block of the user's around the backward that ended before the step popped the top of
the stack, ours, in place of its own: then its own is taken off instead.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..errors import ChunkError

_CLIP_FILE = os.path.join("torch", "nn", "utils", "clip_grad.py")
_NORMS = frozenset({"_foreach_norm", "vector_norm", "norm"})
GRAD_GET: Any = torch.Tensor.grad.__get__  # type: ignore[union-attr]  # what a mode is handed for ``p.grad``
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # lightning_chunk/


class Missing(NamedTuple):
    """The module's parameters (the manager's ``index_of``: ``id`` -> index), and what to call where code outside
    this package reads ``.grad`` of a trainable one and finds ``None`` ([Note: gradients read where they are not] in
    ``precision.py``)."""

    index_of: Mapping[int, int]
    said: Callable[[torch.Tensor], None]

    def read(self, args: tuple, kwargs: dict) -> Any:
        """``p.grad`` for a mode handed ``GRAD_GET``, telling ``said`` where it is ``None`` on a trainable module
        parameter and the reader (two frames up: past the mode) is not this package nor a ``zero_grad``, whose reads
        look for no value."""
        out = GRAD_GET(*args, **kwargs)
        p, code = args[0], sys._getframe(2).f_code
        if out is None and id(p) in self.index_of and p.requires_grad and code.co_name != "zero_grad":
            if not code.co_filename.startswith(_PACKAGE):
                self.said(p)
        return out


class ShardNorms(TorchFunctionMode):
    """Raise where torch's ``clip_grad.py`` takes a norm of one of ``grads()`` (the views' gradients now), on
    several ranks; tell ``missing`` of a ``None`` read of a module parameter's ``.grad``."""

    def __init__(
        self, grads: Callable[[], Iterable[torch.Tensor]], world_size: int, missing: Missing | None = None
    ) -> None:
        super().__init__()
        self.grads = grads
        self.world_size = world_size
        self.missing = missing

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.missing is not None and func == GRAD_GET:
            return self.missing.read(args, kwargs)
        if self.world_size > 1 and getattr(func, "__name__", "") in _NORMS and _called_from_clip_grad():
            mine = {id(g) for g in self.grads()}
            if any(isinstance(t, torch.Tensor) and id(t) in mine for t in tree_flatten((args, kwargs))[0]):
                raise ChunkError(
                    f"torch.nn.utils.clip_grad_norm_ (or get_total_norm) took the norm of the optimizer's own "
                    f"parameters' gradients: under chunk_offload on {self.world_size} ranks those are this rank's "
                    "shards (pieces of each parameter), so the norm would be this rank's alone and every rank would "
                    "clip by a different factor. Clip with Trainer(gradient_clip_val=...) or "
                    "self.clip_gradients(optimizer, gradient_clip_val=..., gradient_clip_algorithm='norm'), which "
                    "take the norm over every rank's shards; or call torch's function on module parameters inside "
                    "`with self.trainer.strategy.full_parameters(with_grads=True):` (a norm a param group: pick "
                    "that group's parameters by name)."
                )
        return func(*args, **kwargs)


def _called_from_clip_grad() -> bool:
    f: Any = sys._getframe(2)  # past __torch_function__: the frame that called the torch function
    for _ in range(3):
        if f is None:
            return False
        if f.f_code.co_filename.endswith(_CLIP_FILE):
            return True
        f = f.f_back
    return False


def watched(
    grads: Callable[[], Iterable[torch.Tensor]], world_size: int, missing: Missing | None = None
) -> contextlib.AbstractContextManager[Any]:
    """``ShardNorms`` for the block, where there is something to watch."""
    return ShardNorms(grads, world_size, missing) if world_size > 1 or missing else contextlib.nullcontext()


class ManualWindow:
    """``ShardNorms`` from a manual backward's end to whichever comes first: the step, the next backward, the end
    of ``training_step``."""

    def __init__(self) -> None:
        self.mode: ShardNorms | None = None
        self._below: list[Any] = []  # torch's mode stack when the window opened

    def open(
        self, grads: Callable[[], Iterable[torch.Tensor]], world_size: int, missing: Missing | None = None
    ) -> None:
        if self.mode is None and (world_size > 1 or missing):
            self._below = _stack()
            self.mode = ShardNorms(grads, world_size, missing)
            self.mode.__enter__()

    def close(self) -> None:
        mode, self.mode = self.mode, None
        if mode is None:
            return
        stack = _stack()
        if not any(m is mode for m in stack):  # a user's block that ended popped ours in place of its own
            below = self._below
            if stack and len(stack) <= len(below) and all(a is b for a, b in zip(stack, below, strict=False)):
                torch._C._pop_torch_function_stack()
            return
        above = []  # modes the user's code entered after ours and has not left: off the stack, and back after
        while (top := torch._C._pop_torch_function_stack()) is not mode:
            above.append(top)
        for m in reversed(above):
            torch._C._push_on_torch_function_stack(m)

    @contextlib.contextmanager
    def closed_after(self) -> Iterator[None]:
        """The block (a ``training_step``), and the window closed after it, also on an error."""
        try:
            yield
        finally:
            self.close()


def _stack() -> list[Any]:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]
