"""A backward that raised, ended where it stopped, so that training can go on after it.

[Note: a backward that raised]
The end of a backward is a callback queued on the autograd engine ([Note: a backward that delivers no gradient] in
``hooks.py``); a backward that raises never runs it. Lightning's ``BatchSizeFinder`` catches an out-of-memory raised
in backward (the allocator's, or a ``DeviceMemoryLimitError`` when a chunk is gathered again for it) and tries a
smaller batch, and a loop that skips a batch too long catches it too. The engine then still took a backward to be
running: the next one queued no end and began nothing, and its first gradient for a parameter the failed one had
delivered raised an "illegal tensor-state transition", blamed on a hook-order bug. Plain PyTorch leaves the
gradients that arrived in ``param.grad`` and goes on.

``end_raised_backward`` ends it as its callback would have, for the gradients it delivered: chunks waiting to
reduce reduce, tensors leave backward's states, the worker thread is joined, gradients kept in bf16 are widened
and the gradients are attached to the optimizer's views, where ``zero_grad()`` clears them as it clears
``param.grad``. A warm-up's trace so far is taken, and the next micro-batch traces again, as after a warm-up
micro-batch without a backward. The strategy calls it as an exception leaves ``backward`` (before the user's code
can call ``zero_grad()``; an interrupt ends the fit instead, whose teardown says what a step half taken left);
``after_backward`` calls it where the user's ``backward`` hook caught the exception; and the next micro-batch calls
it for a loop that drove the engine itself. Where ending it raises in turn (a gradient payload that did not fit is
asked for again), the strategy raises the backward's own error, where it stopped, with the clean-up's as a note.

Stepping in backward, chunks may have stepped before the failure. Those that stepped on a guess ([Note: speculating
past the norm and the overflow]) are put back, bit for bit. The others keep the update of this batch; plain
PyTorch would have none, so a warning names how many, and the step's bookkeeping ends as a skipped step's (the
chunks stepped have no gradient left to step with again). With several ranks every rank must have raised at the
same point for the collectives of the end to pair up, as with DDP, whose reducer cannot go on either otherwise.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine calls this
    from .engine import ChunkEngine


def end_raised_backward(engine: ChunkEngine) -> None:
    """End a backward that raised, if one did (``hooks.moments.backward_queued`` still set): idempotent."""
    if not engine.hooks.moments.backward_queued:
        return
    early = engine.early
    if early is not None:
        early.active = False  # nothing more steps in it
    engine.hooks.end_backward()
    if early is None:
        return
    spec = early.speculation
    kept = len(early.stepped - (set(spec.undo) if spec is not None else set()))
    early.roll_back()  # the guesses: put back
    if kept:
        warnings.warn(
            f"chunk_offload: a backward raised after {kept} chunk(s) had stepped in it (step_in_backward=True): "
            "their update from this batch stays, where plain PyTorch would have made none. Use "
            "step_in_backward=False where a loop goes on past a backward that fails ([Note: a backward that raised] "
            "in engine/runtime/raised.py).",
            stacklevel=3,
        )
    early.finish()
