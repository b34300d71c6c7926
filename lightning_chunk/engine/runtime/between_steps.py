"""Reads between steps: released parameters refused, gradients that are not there said ([Note: released parameters
read between steps], [Note: gradients read after the step])."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import _len_torch_function_stack, _pop_torch_function_stack, _push_on_torch_function_stack

from .reads import ReleasedReads


class BetweenSteps:
    """[Note: released parameters read between steps]
    Between steps a parameter whose chunk is released holds the placeholder of [Note: a released parameter] in
    ``chunk.py``, which refuses writes but reads as NaN: an exponential average kept by hand
    (``ema[n].lerp_(p, 0.1)`` over ``named_parameters()`` in ``on_train_batch_end``), a clone taken in
    ``on_fit_start``, a weight's norm logged from a callback, all computed with NaN without a word. Where DeepSpeed
    and FSDP leave an empty tensor, whose reads fail, a read here gave a wrong answer.

    Reading such a parameter by attribute or iteration between steps (the reader of [Note: writes through .data] in
    ``memory/full_params.py``) or between a backward and its step (``on_after_backward``, ``on_before_optimizer_step``:
    the reader of [Note: gradients read where they are not] in ``precision.py``), from code outside this package,
    ``arm``s a ``ReleasedReads`` on that thread: until the next micro-batch, backward, the end of that window, the
    optimizer step or the end of ``fit`` (``disarm``), a torch op that reads or writes a
    placeholder raises, naming the parameter (a detached copy, by the shape of the last one read) and
    ``full_parameters()``. Code that touches no released parameter between steps pays nothing; code that iterates them
    without reading values (Lightning's ``zero_grad`` as a stage starts and before validation, ``ModelSummary``) pays
    a Python call per torch op until the next micro-batch. The engine's own work between steps (a save, a repack)
    reads no placeholder: the fast tier passes with the check armed after every micro-batch. A reference kept from
    before training (not a module attribute) is not seen; the placeholder still refuses writes through it.

    Modes form a stack per thread, and ``with SomeMode():`` pops whatever is on top when it ends: the armed mode goes
    in at the bottom of the stack and is taken out from wherever it is, so a mode the user's code enters and leaves
    meanwhile (``with torch.device(...)``) comes and goes as it would without it."""

    def __init__(self, name: Callable[[torch.Tensor], str | None]) -> None:
        self.name = name
        self._mode: ReleasedReads | None = None
        self._thread = 0  # the thread whose stack holds it
        self._stale: list[ReleasedReads] = []  # disarmed from another thread (CUDA's backward): removed on its own
        self._suspended = 0  # inside ``suspended``: nothing arms

    @property
    def armed(self) -> bool:
        return self._mode is not None

    def arm(self, param: torch.Tensor, where: str = "between steps") -> None:
        """``param``, a released parameter, was read by attribute or iteration ``where``."""
        self._remove_stale()
        if self._suspended:
            return
        if self._mode is None:
            self._mode, self._thread = ReleasedReads(self.name, between=True), threading.get_ident()
            above = [_pop_torch_function_stack() for _ in range(_len_torch_function_stack())]
            for m in [self._mode, *reversed(above)]:
                _push_on_torch_function_stack(m)
        self._mode.read[tuple(param.shape)] = param
        self._mode.where = where

    def disarm(self) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.off = True  # passes every op through until it is out of the stack
            self._stale.append(mode)
        self._remove_stale()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Nothing armed inside: code of Lightning's that compares released parameters' values on purpose."""
        self.disarm()
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _remove_stale(self) -> None:
        if not self._stale or threading.get_ident() != self._thread:
            return
        above: list[Any] = []
        while self._stale and _len_torch_function_stack():
            top = _pop_torch_function_stack()
            if top in self._stale:
                self._stale.remove(top)
            else:
                above.append(top)
        self._stale.clear()  # not in the stack any more
        for m in reversed(above):
            _push_on_torch_function_stack(m)
