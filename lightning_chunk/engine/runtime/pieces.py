"""How many pieces a parameter's gradient arrives in, a backward.

[Note: gradients in pieces]
A parameter's gradient arrives once a backward: autograd sums every use's contribution before the parameter's
``AccumulateGrad`` runs, however often its module ran. Reentrant activation checkpointing
(``torch.utils.checkpoint(fn, ..., use_reentrant=True)``, torch's old default and Hugging Face's before transformers
5) breaks that: its forward runs ``fn`` without grad, and its backward recomputes ``fn`` and runs a backward of its
own, whose ``AccumulateGrad`` hands over that segment's part at once. A module used in two such segments, or in one
and outside (ALBERT's shared layers, a block applied twice) gets its gradient in pieces. Taking the first piece as
the whole reduced the chunk early: on one rank, stepping in backward (the default), the chunk stepped on one piece
and then again on the other (0.036 from plain Lightning after 4 steps, with no error); elsewhere the second piece
failed a state check. So each forward counts, per trainable parameter, the pieces this micro-batch's backward will
bring (``TensorInfo.grads_due``): one if a use ran with grad enabled outside backward (the step's own graph), and
one more for each reentrant checkpoint whose forward used it, found by its frame on the stack. A backward counts the
pieces that came (``grads_got``), and a chunk is complete only when each of its parameters has all of them
(``Chunk.grads_complete``): the reduce, the early step and, with several ranks, the agreement on complete chunks all
wait for the last piece; a piece after the first is added to the waiting gradient. A recomputation in backward adds
nothing (its first forward counted it), and non-reentrant checkpointing recomputes inside the step's own graph, so
it brings no piece of its own. A piece beyond the count (a function of the user's that runs a backward of its own
inside backward) is refused by name, not added to a chunk that may have stepped. The warm-up trace records each
piece's moment, so traced steps reduce after the last one as well.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from types import FrameType
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import CheckpointFunction

from ..chunks.chunk import TensorInfo
from ..errors import ChunkError

if TYPE_CHECKING:
    from ..memory.manager import ChunkManager

_REENTRANT_FORWARD = CheckpointFunction.forward.__code__


def reentrant_checkpoint() -> int | None:
    """An identity of the reentrant checkpoint whose forward runs now (its autograd context: alive until its
    backward), or ``None`` when no ``torch.utils.checkpoint`` reentrant forward is on the stack."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _REENTRANT_FORWARD:
            return id(frame.f_locals["ctx"])
        frame = frame.f_back
    return None


class GradPieces:
    """The pieces each trainable parameter's gradient arrives in, counted a micro-batch ([Note: gradients in
    pieces])."""

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self._own_graph: set[str] = set()  # modules that ran with grad enabled outside backward
        self._segments: dict[int, set[int]] = {}  # parameter -> the reentrant checkpoints that used it
        self._counted: list[TensorInfo] = []  # what to reset

    def forward(self, key: str, indices: Iterable[int]) -> None:
        """Module ``key``, owning parameters ``indices``, runs its forward outside backward in a training
        micro-batch. Without reentrant checkpointing (no segment yet) it costs one set insertion."""
        if torch.is_grad_enabled():
            self._own_graph.add(key)
            if not self._segments:
                return  # every gradient so far comes in one piece, the default
            segment = None
        else:
            segment = reentrant_checkpoint()
            if segment is None:
                return  # a use without grad that no backward recomputes
        mgr = self.manager
        own = key in self._own_graph
        for i in indices:
            param = mgr.params[i]
            if not param.requires_grad:
                continue
            segments = self._segments.setdefault(i, set())
            if segment is not None:
                segments.add(segment)
            info = mgr.lookup(param)[1]
            due = max(own + len(segments), 1)
            if info.grads_due != due:
                info.grads_due = due
                self._counted.append(info)

    def arrived(self, info: TensorInfo) -> None:
        """One piece of ``info``'s gradient arrived; refused beyond what the forward counted."""
        if info.grads_got >= info.grads_due:
            if info.grads_got:
                raise ChunkError(
                    f"parameter {info.name!r} got its gradient in more pieces this backward than its forward "
                    f"counted ({info.grads_due}): a function that runs a backward of its own inside backward, "
                    "other than torch.utils.checkpoint's, used it, so chunk_offload cannot tell when its gradient "
                    "is whole ([Note: gradients in pieces]). Checkpoint with torch.utils.checkpoint (use_reentrant "
                    "True or False), or report this."
                )
        info.grads_got += 1
        self._counted.append(info)

    def backward_ended(self) -> None:
        """The pieces of the next backward of this micro-batch (manual optimization) count from zero."""
        for info in self._counted:
            info.grads_got = 0

    def reset(self) -> None:
        """A micro-batch begins: every gradient is due in one piece until its forward says otherwise."""
        for info in self._counted:
            info.grads_due, info.grads_got = 1, 0
        self._counted.clear()
        self._own_graph.clear()
        self._segments.clear()
