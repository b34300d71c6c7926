"""Stepping in backward past clipping by norm and fp16 loss scaling: step on a guess, keep what undoes it.

[Note: speculating past the norm and the overflow]
Clipping by the global norm multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))``, and fp16 loss
scaling skips the whole step when any gradient of any rank overflowed: both are known only once every gradient is.
So with either, a chunk stepped in backward steps on a guess, that the coefficient will be exactly 1.0 and that
nothing will overflow (SuperOffload's speculation), and first keeps a copy of what the step overwrites: its master
shard, its compute-dtype copy and its optimizer state (``Undo``). After backward the guess is checked where the
step after backward would act:

- the clip (``ChunkEngine.clip_grad_norm_``) computes the norm over every gradient shard, the speculated ones
  kept, as it always does; a coefficient other than exactly 1.0 (a norm that clips, or a NaN) marks the guess
  wrong, and ``optimizer.step()`` restores each speculated chunk and steps it again with its clipped gradients;
- fp16: a chunk's gradients are unscaled and checked for inf/NaN just before its step in backward (torch's
  ``_amp_foreach_non_finite_check_and_unscale_``, the operation the pass after backward runs), which then leaves
  them out; an overflow stops the speculation for the rest of that backward and joins the ranks' vote, and a vote
  that finds one anywhere restores every speculated chunk before the step is skipped.

Where the guess holds, the step is the speculated one; multiplying by 1.0 changes no bit, so it is the step after
backward bit for bit. Where it fails, the chunk is back to its pre-step bits and steps as after backward. So the
parameters, the optimizer state and the loss scale are those of stepping after backward, always.

What it costs:

- Memory: a speculated chunk keeps its gradient shard until ``optimizer.step()`` (as stepping after backward does;
  nothing is freed early) and its copy beside it: 4 + 2 + 8 = 14 bytes a parameter with Adam in bf16-mixed.
  Less cannot be exact: the stepped state mixes the old state with the gradient, and undoing it needs both, so
  at least a gradient's bytes must be kept beside it; an algebraic inverse of the update (DeepSpeed's Adam
  rollback) is not bit-exact. So only host-tier chunks speculate, where memory is plentiful; device chunks step
  after backward (the device Adam is fast), and so do disk chunks (their state is in files). A host memory
  limit does not budget the copies, so speculation is refused with one (``refusal``).
- Time: the copy (beside backward, on the worker thread where there is one), and where the guess fails a
  restore and the step again after backward: such a step costs more than stepping after backward. It pays where
  clipping and overflows are rare, as they become in a long run; ``speculation_rollbacks`` in ``memory_stats``
  counts the steps undone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..chunks.chunk import Chunk, Tier
from ..memory.master_writes import copies_made
from .binding import OptimizerBinding
from .grad_slots import GradSlot
from .scaler import DynamicLossScaler


def refusal(what: str, host_memory_limit: int) -> str:
    """The error for speculation under a host memory limit: ``what`` is the clipping or the loss scaling."""
    return (
        f"step_in_backward=True with {what} is not allowed with host_memory_limit={host_memory_limit!r}: each "
        "chunk stepped in backward would keep a copy of its master and optimizer state until the norm or the "
        "overflow is known ([Note: speculating past the norm and the overflow]), which the limit does not budget. "
        "Use step_in_backward=False, or leave host_memory_limit unset."
    )


@dataclass
class Undo:
    """What a chunk's step overwrites, as it was before it."""

    master: torch.Tensor
    low: torch.Tensor | None
    state: list[tuple[torch.Tensor, dict[str, Any] | None]] = field(default_factory=list)  # (view, its state)

    def nbytes(self) -> int:
        tensors = [self.master, self.low] + [v for _, st in self.state if st for v in st.values()]
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


class Speculation:
    """The chunks stepped in backward on a guess this step, and what undoes each ([Note: speculating past the
    norm and the overflow]). ``step`` may run on the worker thread; everything else runs after it is joined."""

    def __init__(self, binding: OptimizerBinding, scaler: DynamicLossScaler | None) -> None:
        self.binding = binding
        self.scaler = scaler
        self.undo: dict[int, Undo] = {}  # chunk id -> its pre-step bits, for the chunks stepped on the guess
        self.unscaled: set[int] = set()  # fp16: chunks whose gradients were unscaled in backward
        self.overflowed = False  # fp16: a chunk of this rank overflowed in backward
        self.wrong = False  # the clip's coefficient was not 1.0: every speculated chunk steps again
        self.rollbacks = 0  # steps whose speculation was undone
        self.guesses = 0  # chunks stepped on a guess since set-up (those undone included)
        self.held_bytes = 0  # the copies' bytes now
        self.peak_bytes = 0  # the most bytes the copies held at once

    @staticmethod
    def takes(chunk: Chunk) -> bool:
        """Only host-tier chunks speculate (the copies sit in host memory)."""
        return chunk.shard_tier is Tier.HOST

    def step(self, chunk: Chunk, clip: Any) -> None:
        """In backward: unscale and check (fp16), ``clip`` by value, keep the copy, step."""
        if self.overflowed:
            return  # the step will be skipped: the gradients are unscaled after backward with the others'
        slots = self.binding.slots.of_chunk(chunk)
        if not slots:
            return
        grads: list[torch.Tensor] = [s.grad for s in slots]  # type: ignore[misc]
        if self.scaler is not None:
            found = torch.zeros(1, device=grads[0].device)
            inv = torch.full((1,), 1.0 / self.scaler.scale, device=grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
            self.unscaled.add(chunk.chunk_id)
            if found.item() > 0:
                self.overflowed = True
                return
        clip(grads)
        undo = self.undo[chunk.chunk_id] = self._keep(chunk, slots)
        self.held_bytes += undo.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        self.binding.step_chunk(chunk)
        self.guesses += 1

    def clipped(self, coef: torch.Tensor) -> None:
        """The clip's coefficient: anything but exactly 1.0 (NaN included) proves the guess wrong."""
        if self.undo and not bool(coef.item() == 1.0):
            self.wrong = True

    def roll_back(self, chunk: Chunk) -> None:
        """Put ``chunk``'s master, compute copy and optimizer state back as they were before its step."""
        u = self.drop(chunk)
        chunk.master_tensor_for_read().copy_(u.master)
        if u.low is not None:
            assert chunk.low is not None
            chunk.low.copy_(u.low)
        copies_made(chunk)  # master and compute copy as before the step: no write of the user's
        state = self.binding.optimizer.state
        for view, before in u.state:
            if before is None:  # its first step made the state: torch makes it again
                state.pop(view, None)
                continue
            now = state.setdefault(view, {})
            for key in [k for k in now if k not in before]:
                del now[key]
            for key, old in before.items():
                cur = now.get(key)
                if torch.is_tensor(old) and torch.is_tensor(cur) and cur.shape == old.shape and cur.dtype == old.dtype:
                    cur.copy_(old)  # in place: the moments may be slices of the one pass's regions
                else:
                    now[key] = old

    def drop(self, chunk: Chunk) -> Undo:
        """``chunk``'s copy, no longer kept."""
        u = self.undo.pop(chunk.chunk_id)
        self.held_bytes -= u.nbytes()
        return u

    def roll_back_all(self, chunks: list[Chunk]) -> None:
        """Every speculated chunk as before backward: the step is skipped (an fp16 overflow on some rank) or taken
        again (the clip's coefficient was not 1.0)."""
        if self.undo:
            self.rollbacks += 1
        for c in chunks:
            if c.chunk_id in self.undo:
                self.roll_back(c)

    def reset(self) -> None:
        """The optimizer step is over: nothing is kept."""
        self.undo = {}
        self.held_bytes = 0
        self.unscaled = set()
        self.overflowed = self.wrong = False

    def _keep(self, chunk: Chunk, slots: list[GradSlot]) -> Undo:
        state = self.binding.optimizer.state
        kept = [(s.view, _copy(state.get(s.view))) for s in slots]
        low = chunk.low.clone() if chunk.low is not None else None
        return Undo(chunk.master_tensor_for_read().clone(), low, kept)


def _copy(state: dict[str, Any] | None) -> dict[str, Any] | None:
    if not state:
        return None
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
