"""The closure ``step()`` gets where the optimizer is not one the engine knows.

[Note: the closure of a step the engine runs]
Lightning passes ``optimizer.step`` a closure that runs the forward and backward. chunk_offload runs that closure
itself, before the step (its backward fills the shards), and calls ``step()`` without one: once after backward, or
once a chunk while stepping in backward. torch's optimizers call a closure only when given one. An optimizer we do not
know may call it whatever it is given (``loss = closure()``): given none, it failed with ``TypeError: 'NoneType'
object is not callable``, which names neither the optimizer nor the reason. Such an optimizer (one taken on
``assume_elementwise_optimizer`` whose ``step`` takes a ``closure``) now gets ``AlreadyRun``, whose first call in a
``step()`` returns ``None``: the forward and backward have run, at the weights the step began with. Where the step
wrote its parameters before that call (schedule-free's closure variants move them to the point where they want the
gradients; SAM perturbs them), or called the closure a second time (SAM, line searches), the gradients it wants are
at other weights, which only a forward and backward inside the step could give: it raises, naming the optimizer and
why. A write is seen by the parameters' version counters, noted when each ``step()`` call begins (the binding's step
pre-hook), so the calls of one step made of several (stepping in backward, the disk tier) each start afresh.
"""

from __future__ import annotations

import inspect

import torch

from ..errors import UnsupportedOptimizerError


class AlreadyRun:
    """A closure whose work is done: ``None`` at the first call of a ``step()`` that has not written its parameters,
    an error otherwise."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.name = type(optimizer).__qualname__
        self.calls = 0
        self.versions: list[int] = []

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def reset(self) -> None:
        """A ``step()`` call begins: note its parameters' version counters."""
        self.calls = 0
        self.versions = [p._version for p in self._params()]

    def __call__(self) -> None:
        self.calls += 1
        if self.calls > 1:
            why = "called its closure a second time in one step"
        elif [p._version for p in self._params()] != self.versions:
            why = "wrote its parameters and then called its closure"
        else:
            return
        raise UnsupportedOptimizerError(
            f"{self.name}.step() {why}: it wants the gradients at weights other than those the step began with "
            "(schedule-free's closure variants, SAM and its variants, line searches), which only a forward and "
            "backward inside the step could give. chunk_offload runs the closure once, before step(), and steps "
            "flat shards of the parameters. Use an optimizer whose step needs the gradients alone (for "
            "schedule-free, the variant without a closure, with assume_elementwise_optimizer=True)."
        )


def closure_for(optimizer: torch.optim.Optimizer, known: bool) -> AlreadyRun | None:
    """``AlreadyRun`` for an optimizer the engine does not know whose ``step`` takes a ``closure``, else ``None``."""
    if known:
        return None
    try:
        takes = "closure" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return None
    return AlreadyRun(optimizer) if takes else None
