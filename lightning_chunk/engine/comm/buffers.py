"""Module buffers across ranks: rank 0's at set-up, and before the forwards DDP syncs them in.

[Note: buffers as DDP syncs them]
Buffers are not chunked: every rank holds its own, and a BatchNorm's running statistics follow that rank's batches.
DDP (``broadcast_buffers=True``, Lightning's default) broadcasts rank 0's buffers at the start of a forward of the
wrapped model, but only when the forward before it ran with gradients enabled outside ``no_sync``: after an
evaluation forward, or a micro-batch that does not step (Lightning's ``block_backward_sync``), the next forward
keeps each rank's own. Lightning wraps the model in DDP only to fit, so ``validate``/``test``/``predict`` sync
nothing. Without this every rank but 0 evaluated with its own running statistics (0.12 from DDP's on a 2-rank
BatchNorm model, and other validation losses); with it each rank's buffers and losses are DDP's, bit for bit.
``broadcast_buffers=False`` keeps each rank's own, as the same DDP argument does. The broadcast is one collective
per dtype (DDP coalesces too), of every buffer, since which buffers a forward changed is not known.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class BufferSync:
    def __init__(self, module: torch.nn.Module, comm: Any) -> None:
        self.module = module
        self.comm = comm
        self.enabled = False  # set by the caller: DDP's broadcast_buffers while fitting
        self.due = True  # a new DDP wrapper syncs at its first forward

    def broadcast(self, when: str = "at set-up") -> None:
        """Every buffer takes rank 0's value (one broadcast per dtype)."""
        if self.comm.all_size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = collections.defaultdict(list)
        for buf in self.module.buffers():
            by_dtype[buf.dtype].append(buf.data)
        with torch.no_grad():
            for bufs in by_dtype.values():
                what = f"the broadcast of rank 0's buffers {when}"
                flat = self.comm.broadcast(_flatten_dense_tensors(bufs), what=what)
                for buf, value in zip(bufs, _unflatten_dense_tensors(flat, bufs), strict=True):
                    buf.copy_(value)

    def before_forward(self, *, accumulating: bool) -> None:
        """At the start of a micro-batch or evaluation step ([Note: buffers as DDP syncs them])."""
        if self.enabled and self.due:
            self.broadcast("before a forward (broadcast_buffers=True)")
        self.due = torch.is_grad_enabled() and not accumulating
