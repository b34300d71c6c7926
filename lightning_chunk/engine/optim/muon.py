"""torch's Muon over sharded matrices: momentum by piece, each matrix orthogonalized whole.

[Note: Muon over sharded matrices]
``torch.optim.Muon`` updates a 2-D parameter from its gradient ``g`` and momentum buffer ``B``: ``B.lerp_(g, 1 - mu)``,
``U = g.lerp(B, mu)`` (Nesterov) or ``B``, ``O = NS(U)`` (Newton-Schulz iterations that orthogonalize the whole
matrix), then ``p *= 1 - lr * wd`` and ``p -= lr' * O`` with ``lr'`` scaled by the matrix's shape. Everything but
``NS`` is element-wise, and ``NS`` needs the whole matrix ([Note: optimizers that need whole parameters] in
``whole.py`` says how the engine steps such an optimizer).

Each rank updates its pieces' momentum (``momentum_buffer``, flat like the piece, so checkpoints, resharding and
the plain format treat it as any per-element state) and forms its pieces of ``U``; the chunk's gather gives it the
whole ``U`` of the matrices it holds a piece of, which it orthogonalizes on its compute device with torch's own
functions for ``NS`` and the shape scaling, applying its own slice. The work is spread over the ranks as the pieces
are; a matrix cut at a shard boundary is orthogonalized by each rank that holds a piece of it.

Newton-Schulz runs in bf16, so last-bit differences in its input come out bf16-sized: where the reduction itself
differs from DDP's in the last bits (sharded accumulation, four ranks' sums) the update does too, by a few tenths
of a percent a step, as two DDP runs with other buckets differ from each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from .whole import WholeStep, gather_whole, own_slice

if TYPE_CHECKING:
    from ..chunks.chunk import Chunk, TensorInfo


class MuonStep(WholeStep):
    """Muon's update of one optimizer's views ([Note: Muon over sharded matrices])."""

    optimizer_class = torch.optim.Muon

    def step_chunk(self, chunk: Chunk, tensors: list[TensorInfo], views: dict[int, torch.Tensor]) -> None:
        mgr, opt = self.binding.manager, self.binding.optimizer
        mine = {}  # param index -> (its tensor info, its view, this rank's piece of U)
        for t in tensors:
            v = views.get(t.slot.param_index)
            if v is not None and v.grad is not None:
                g = opt.param_groups[self.group_of[t.slot.param_index]]
                buf = opt.state[v].setdefault("momentum_buffer", torch.zeros_like(v.grad))
                buf.lerp_(v.grad, 1 - g["momentum"])
                mine[t.slot.param_index] = (t, v, v.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf)
        # every rank gathers, with zeros where it holds nothing: the whole U of each matrix it holds a piece of,
        # in bf16, the first thing Newton-Schulz casts it to: half the bytes, the same bits
        pieces = {i: (t, [u]) for i, (t, _, u) in mine.items()}
        whole = gather_whole(mgr, chunk, pieces, 1, torch.bfloat16)
        for i, (t, v, _) in mine.items():
            g = opt.param_groups[self.group_of[i]]
            lr = float(g["lr"])
            u = whole[i][0].to(mgr.device)  # orthogonalized where the module computes, as plain PyTorch does
            ortho = _zeropower_via_newtonschulz(u, g["ns_coefficients"], g["ns_steps"], g["eps"])
            v.mul_(1 - lr * g["weight_decay"])
            v.add_(
                own_slice(chunk, t, ortho).to(v.device),
                alpha=-_adjust_lr(lr, g["adjust_lr_fn"], t.shape),
            )
