"""Parameters kept gathered for a graph that a backward built (a gradient penalty).

[Note: double backward]
``torch.autograd.grad(..., create_graph=True)`` (a gradient penalty, WGAN-GP) runs a backward whose nodes build a
second graph, and that graph saved the parameters the backward used (views of their payloads). A later backward
reads them through nodes no module hook precedes, so nothing would gather them again: with host placement (or under
a limit) the payload was released at the end of the first backward and the second read freed memory (a segmentation
fault). A backward builds a graph when grad mode is on inside it, which the module hooks see (``ChunkHooks._use``).
The parameters such a backward used stay in use (COMPUTE, so no plan evicts their chunks) until a backward that
builds no graph ends, or the next micro-batch begins. The warm-up trace ends with the first backward, so a device
limit does not count them: one too tight for them is refused when it is met, with its numbers.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..chunks.states import TensorState
from .manager import ChunkManager

S = TensorState


class GradGraphKeeper:
    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self.kept: set[int] = set()  # parameter indices
        self.building = False  # the backward running now builds a graph

    def used(self, params: Iterable[int]) -> None:
        """A backward in grad mode (``create_graph=True``) used ``params``."""
        self.building = True
        self.kept.update(params)

    def backward_ended(self) -> None:
        """After ``ChunkManager.grads.end_backward``: keep what a graph-building backward used in use; a backward that
        built none consumed the graph, so its parameters may go."""
        if not self.building:
            self.release()
            return
        self.building = False
        mgr = self.manager
        for i in self.kept:
            chunk, info = mgr.lookup(mgr.params[i])
            if info.state is S.HOLD_AFTER_BWD:
                chunk.set_state(info, S.COMPUTE)

    def reset(self) -> None:
        """A new micro-batch: a graph no backward consumed is gone with the last one's tensors."""
        self.building = False
        self.release()

    def release(self) -> None:
        self.manager.let_go(self.kept, S.HOLD_AFTER_BWD)
        self.kept.clear()
