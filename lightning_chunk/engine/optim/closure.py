"""The closure ``step()`` gets where the optimizer is not one the engine knows.

[Note: the closure of a step the engine runs]
Lightning passes ``optimizer.step`` a closure that runs the forward and backward. chunk_offload runs that closure
itself, before the step (its backward fills the shards), and calls ``step()`` without one: once after backward, or
once a chunk while stepping in backward. torch's optimizers call a closure only when given one. An optimizer we do not
know may call it whatever it is given (``loss = closure()``), and SAM calls it a second time, after moving the
weights, to take the gradients there: given none, both failed with ``TypeError: 'NoneType' object is not callable``,
which names neither the optimizer nor the reason. Such an optimizer (one taken on ``assume_elementwise_optimizer``
whose ``step`` takes a ``closure``) now gets ``AlreadyRun``: its first call in a ``step()`` returns ``None``, since
the forward and backward have run, and a second raises, naming the optimizer and why it cannot step here. The
count starts again at every ``step()`` call (the binding's step pre-hook), so the calls of one step made of several
(stepping in backward, the disk tier) each get their first.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import UnsupportedOptimizerError


class AlreadyRun:
    """A closure whose work is done: ``None`` at the first call of a ``step()``, an error at a second."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > 1:
            raise UnsupportedOptimizerError(
                f"{self.name}.step() called its closure a second time in one step: an optimizer that runs the forward "
                "and backward again inside its step (SAM and its variants, line searches) cannot step under "
                "chunk_offload, which runs the closure once, before step(), and steps flat shards of the parameters. "
                "Use an optimizer whose step needs the gradients alone."
            )


def closure_for(optimizer: torch.optim.Optimizer, known: bool) -> AlreadyRun | None:
    """``AlreadyRun`` for an optimizer the engine does not know whose ``step`` takes a ``closure``, else ``None``."""
    if known:
        return None
    try:
        takes = "closure" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return None
    return AlreadyRun(type(optimizer).__qualname__) if takes else None
