"""torch's Muon over sharded matrices: momentum by piece, each matrix orthogonalized whole.

[Note: Muon over sharded matrices]
``torch.optim.Muon`` updates a 2-D parameter from its gradient ``g`` and momentum buffer ``B``: ``B.lerp_(g, 1 - mu)``,
``U = g.lerp(B, mu)`` (Nesterov) or ``B``, ``O = NS(U)`` (Newton-Schulz iterations that orthogonalize the whole
matrix), then ``p *= 1 - lr * wd`` and ``p -= lr' * O`` with ``lr'`` scaled by the matrix's shape. Everything but
``NS`` is element-wise, and ``NS`` needs the whole matrix. The optimizer here steps flat pieces of this rank's master
shards ([Note: per-parameter views of the master shards] in ``binding.py``), so Muon's own ``step`` cannot run on
them: it refuses a 1-D tensor, and a matrix cut at a shard boundary is orthogonalized by no rank.

So the engine runs Muon's update itself, with torch's own functions for ``NS`` and the shape scaling. Each rank
updates its pieces' momentum (``momentum_buffer``, flat like the piece, so checkpoints, resharding and the plain
format treat it as any per-element state) and forms its pieces of ``U``; one all-gather a chunk holding Muon's
parameters (on every rank, in chunk order, as the chunks' own gathers are) gives each rank the whole ``U`` of the
matrices it holds a piece of; each orthogonalizes those on its compute device and applies its own slice. A rank
orthogonalizes only the matrices it holds a piece of, so the work is spread over the ranks as the pieces are; a
matrix cut at a shard boundary is orthogonalized by each rank that holds a piece of it, from the same ``U``, to the
same bits. The result is torch's ``Muon.step`` on whole parameters to the bit: on one rank each piece is a whole
matrix and nothing is gathered. ``optimizer.step()`` then runs over no parameter, so its hooks and an LR scheduler's
count see one step.

Newton-Schulz runs in bf16, so last-bit differences in its input come out bf16-sized: where the reduction itself
differs from DDP's in the last bits (sharded accumulation, four ranks' sums) the update does too, by a few tenths
of a percent a step, as two DDP runs with other buckets differ from each other.

Muon steps after backward (the gather is a collective the autograd thread should not wait in), and not on the disk
tier (whose chunks step one at a time through ``step()``): both are refused by ``check_optimizer``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from ..chunks.repack import piece_range

if TYPE_CHECKING:
    from .binding import OptimizerBinding


def is_muon(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, torch.optim.Muon)


class MuonStep:
    """Muon's update of one optimizer's views ([Note: Muon over sharded matrices])."""

    def __init__(self, binding: OptimizerBinding) -> None:
        self.binding = binding
        self.group_of = {i: k for k, idx in enumerate(binding.group_params) for i in idx}

    @torch.no_grad()
    def step(self, views: dict[int, torch.Tensor]) -> None:
        mgr, opt = self.binding.manager, self.binding.optimizer
        for chunk in mgr.chunks:
            tensors = [t for t in chunk.tensors if t.slot.param_index in self.group_of]
            if not tensors:
                continue
            mine = {}  # param index -> (its tensor info, its view, this rank's piece of U)
            for t in tensors:
                v = views.get(t.slot.param_index)
                if v is not None and v.grad is not None:
                    g = opt.param_groups[self.group_of[t.slot.param_index]]
                    buf = opt.state[v].setdefault("momentum_buffer", torch.zeros_like(v.grad))
                    buf.lerp_(v.grad, 1 - g["momentum"])
                    mine[t.slot.param_index] = (t, v, v.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf)
            whole = self._whole(chunk, mine)
            for i, (t, v, _) in mine.items():
                g = opt.param_groups[self.group_of[i]]
                lr = float(g["lr"])
                u = whole[i].to(mgr.device)  # orthogonalized where the module computes, as plain PyTorch does
                ortho = _zeropower_via_newtonschulz(u, g["ns_coefficients"], g["ns_steps"], g["eps"])
                a, b = piece_range(chunk, t.offset, t.numel)
                v.mul_(1 - lr * g["weight_decay"])
                v.add_(
                    ortho.reshape(-1)[a - t.offset : b - t.offset].to(v.device),
                    alpha=-_adjust_lr(lr, g["adjust_lr_fn"], t.shape),
                )

    def _whole(self, chunk: Any, mine: dict[int, tuple[Any, torch.Tensor, torch.Tensor]]) -> dict[int, torch.Tensor]:
        """The whole ``U`` of each matrix this rank holds a piece of: its own piece on one rank, else one all-gather
        of the chunk's pieces (every rank takes part, with zeros where it holds none)."""
        comm = self.binding.manager.comm
        if comm.world_size == 1:
            return {i: u.view(t.shape) for i, (t, _, u) in mine.items()}
        lo, _ = chunk.shard_range
        device = comm.tensor_device()
        shard = torch.zeros(chunk.shard_numel, dtype=chunk.master_dtype, device=device)
        for t, _, u in mine.values():
            a, b = piece_range(chunk, t.offset, t.numel)
            shard[a - lo : b - lo].copy_(u)
        full = torch.empty(chunk.capacity_numel, dtype=shard.dtype, device=device)
        comm.all_gather(full, shard, chunk=chunk.chunk_id).wait()
        return {i: full[t.offset : t.offset + t.numel].view(t.shape) for i, (t, _, _) in mine.items()}
