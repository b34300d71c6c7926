"""Reads between steps: released parameters refused, gradients that are not there said ([Note: released parameters
read between steps], [Note: gradients read after the step])."""

from __future__ import annotations

import contextlib
import enum
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch._C import _len_torch_function_stack, _pop_torch_function_stack, _push_on_torch_function_stack

from ..chunks.parked import READERS
from ..errors import ChunkError
from ..optim.shard_norms import GRAD_GET, Missing
from .reads import ReleasedReads


def _read_anything(func: Any, args: tuple, kwargs: dict) -> None:
    """The parked class's check while ``suspended``."""


class Window(enum.Enum):
    """Where a released parameter was read, as the refusal says it."""

    BETWEEN_STEPS = "between steps"
    BEFORE_THE_STEP = "between the backward and the optimizer step"  # on_after_backward, on_before_optimizer_step


class BetweenReads(ReleasedReads):
    """``ReleasedReads`` armed between steps ([Note: released parameters read between steps]), which also tells
    ``missing`` of a ``None`` read of a trainable parameter's ``.grad`` ([Note: gradients read after the step])."""

    def __init__(self, name: Callable[[torch.Tensor], str | None], missing: Missing) -> None:
        super().__init__(name)
        self.missing = missing
        self.where = Window.BETWEEN_STEPS
        self.read: dict[tuple[int, ...], torch.Tensor] = {}  # the last parameter read, by shape
        self.off = False  # disarmed while another mode stood above it: passes every op through
        self.grads = False  # a parameter was read by attribute or iteration: ``.grad`` reads are looked at

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if self.off:
            return func(*args, **(kwargs or {}))
        if func == GRAD_GET:
            if self.grads and self.where is Window.BETWEEN_STEPS:
                return self.missing.read(args, kwargs or {})
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    def _refusal(self, func: Any, t: torch.Tensor) -> ChunkError:
        what = self.name(t)
        if what is None and tuple(t.shape) in self.read:  # a view or detached copy (``p.detach().clone()``)
            what = self.name(self.read[tuple(t.shape)])
        fn = getattr(func, "__name__", str(func))
        param = f"parameter {what!r}" if what else f"a released parameter (shape {tuple(t.shape)})"
        writes = fn.endswith("_") and not fn.startswith("_")
        return ChunkError(
            (f"{fn} wrote into {param}" if writes else f"{fn} read {param}")
            + f" {self.where.value}, where its chunk is released and the parameter holds a placeholder, so "
            + ("the write would be lost" if writes else "it would compute with NaN")
            + ". Read or write parameters between steps inside `with trainer.strategy.full_parameters():` "
            "(every rank; given a module or parameters, it gathers only theirs; docs/faq.md, 'Reading or writing "
            "parameters between steps'), or before fit; for an average of the weights use lightning_chunk.ChunkEMA."
        )


class BetweenSteps:
    """[Note: released parameters read between steps]
    Between steps a parameter whose chunk is released holds the placeholder of [Note: a released parameter] in
    ``chunks/parked.py``, which refuses writes but reads as NaN: an exponential average kept by hand
    (``ema[n].lerp_(p, 0.1)`` over ``named_parameters()`` in ``on_train_batch_end``), a clone taken in
    ``on_fit_start``, a weight's norm logged from a callback, all computed with NaN without a word. Where DeepSpeed
    and FSDP leave an empty tensor, whose reads fail, a read here gave a wrong answer.

    Whenever control goes back to the user's code with some parameter released and no step running (``guard``: the
    end of setup, of a backward, of an optimizer step, of an evaluation step or a manually optimized training step;
    between a backward and its step for ``on_after_backward`` and ``on_before_optimizer_step``; inside a manually
    optimized ``training_step`` nothing is armed), a ``BetweenReads`` goes on that thread: until the next
    micro-batch, the optimizer step or the end of ``fit`` (``disarm``), a torch op that reads or writes a placeholder
    raises, naming the parameter (a detached copy, by the shape of the last one read) and ``full_parameters()``,
    however the code reached it: by attribute, by iteration, or through a reference kept from before training, which
    no watch on module attributes sees (it read NaN, silently, while the check waited for an attribute read). Each
    torch op between steps then pays a Python call, about 2.6 us: 104 ops a step in a loop that logs every step with
    a progress bar (most of them Lightning's logging and the collation of the batch), 0.3 ms a step. A forward outside
    a step (a sample generated in a callback) pays it on each op as well, beside gathering every released chunk it
    reads, which costs far more. With every parameter resident (nothing released) nothing is armed or paid. The
    engine's own work between steps (a save, a repack) reads no placeholder, and ``disarm`` runs first as a step
    starts.

    A read of a parameter by attribute or iteration from code outside this package (the reader of [Note: writes
    through .data] in ``memory/full_params.py``, and of [Note: gradients read where they are not] in
    ``precision.py``) ``arm``s the same mode, which then also looks at ``.grad`` reads ([Note: gradients read after
    the step]); a guard alone leaves them be (``optimizer.zero_grad()`` reads every ``.grad``).

    Modes form a stack per thread, and ``with SomeMode():`` pops whatever is on top when it ends: the armed mode goes
    in at the bottom of the stack and is taken out from wherever it is, so a mode the user's code enters and leaves
    meanwhile (``with torch.device(...)``) comes and goes as it would without it."""

    def __init__(
        self,
        name: Callable[[torch.Tensor], str | None],
        index_of: Mapping[int, int],
        parked: Callable[[], bool],
        *,
        speaks: bool = True,
    ) -> None:
        self.name = name
        self.parked = parked  # some parameter shows a placeholder
        self.index_of = index_of  # the module's parameters: id -> index
        self.speaks = speaks  # the rank that warns (rank 0)
        self.grads_expected = False  # a backward ran in this fit: plain PyTorch's parameters hold gradients now
        self._said_missing = False
        self._mode: BetweenReads | None = None
        self._thread = 0  # the thread whose stack holds it
        self._stale: list[BetweenReads] = []  # disarmed from another thread (CUDA's backward): removed on its own
        self._suspended = 0  # inside ``suspended``: nothing arms

    def arm(self, param: torch.Tensor, released: bool = True, where: Window = Window.BETWEEN_STEPS) -> None:
        """``param`` was read by attribute or iteration ``where``: a released parameter, or (``released=False``)
        one whose ``.grad`` may be looked for next."""
        if not (released or self.grads_expected):
            return
        mode = self._push(where)
        if mode is not None:
            mode.read[tuple(param.shape)] = param
            mode.grads = True

    def guard(self, where: Window = Window.BETWEEN_STEPS) -> None:
        """Control goes back to the user's code ``where``: while a parameter shows a placeholder, an op that reads one
        raises, however the code reached it (a reference kept from before training as well)."""
        if self.parked():
            self._push(where)

    def _push(self, where: Window) -> BetweenReads | None:
        self._remove_stale()
        if self._suspended:
            return None
        if self._mode is None:
            self._mode = BetweenReads(self.name, Missing(self.index_of, self._missing))
            self._thread = threading.get_ident()
            above = [_pop_torch_function_stack() for _ in range(_len_torch_function_stack())]
            for m in [self._mode, *reversed(above)]:
                _push_on_torch_function_stack(m)
        self._mode.where = where
        return self._mode

    def disarm(self, *, remove: bool = True) -> None:
        """Nothing more is checked. ``remove=False`` where the thread's mode stack is not the one the mode went into
        (a backward hook: autograd runs it with a stack of its own); the next ``disarm`` takes it out."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.off = True  # passes every op through until it is out of the stack
            self._stale.append(mode)
        if remove:
            self._remove_stale()

    def _missing(self, param: torch.Tensor) -> None:
        """[Note: gradients read after the step]
        In plain PyTorch a parameter keeps its gradient from backward until the next ``zero_grad()``, which Lightning
        calls just before the next backward: a callback reading ``p.grad`` in ``on_train_batch_end`` (a histogram, a
        norm) finds this step's gradients. Here they are in the chunks' shards, and ``p.grad`` is ``None``: the
        callback logged nothing, without a word. Once a backward has run, a read of a parameter between steps arms
        ``BetweenReads`` (a resident one too), and a ``None`` read of a trainable parameter's ``.grad`` warns once,
        naming it and where the gradients can be read. (After a ``zero_grad()`` by hand in manual optimization plain
        PyTorch reads ``None`` as well; the warning says so.)"""
        if self._said_missing or not self.speaks or not self.grads_expected:
            return
        self._said_missing = True
        warnings.warn(
            f"param.grad of {self.name(param)!r} was read between steps and is None: under chunk_offload the "
            "gradients are in the chunks' shards, not on the parameters, after the optimizer step and between the "
            "micro-batches of an accumulation, where plain PyTorch keeps them until the next zero_grad(). Read "
            "them in on_before_optimizer_step (or on_after_backward): their norms with trainer.strategy.grad_norm(2) "
            "(no gather), whole inside `with trainer.strategy.full_parameters(with_grads=True):` (every rank).",
            UserWarning,
            stacklevel=3,
        )

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Nothing armed inside: code of Lightning's that compares released parameters' values on purpose (nor
        their parked class's check, [Note: a parked parameter's class])."""
        self.disarm()
        self._suspended += 1
        READERS.append(_read_anything)
        try:
            yield
        finally:
            READERS.remove(_read_anything)
            self._suspended -= 1

    def _remove_stale(self) -> None:
        if not self._stale or threading.get_ident() != self._thread:
            return
        kept: list[Any] = []
        for _ in range(_len_torch_function_stack()):
            top = _pop_torch_function_stack()
            if any(top is m for m in self._stale):
                self._stale = [m for m in self._stale if m is not top]
            else:
                kept.append(top)
        for m in reversed(kept):
            _push_on_torch_function_stack(m)
