"""Collectives over the data-parallel group, and their one-rank degenerate forms.

With one rank every collective is a local copy or a no-op, so the rest of the
engine is written once for any world size. With several ranks they go through
``torch.distributed`` (NCCL on GPU, gloo on CPU); ``all_gather_single`` and
``reduce_scatter_single`` are used where the installed torch has them, with a
fallback to the older ``*_into_tensor`` / ``*_tensor`` names.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist


class Pending(NamedTuple):
    """A buffer and the work that fills it travel together (FSDP2's habit)."""

    buffer: torch.Tensor
    work: Optional[Any]

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.buffer


class Collectives:
    def __init__(self, group: Optional[Any] = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1

    @classmethod
    def local(cls) -> "Collectives":
        c = cls.__new__(cls)
        c.group, c.rank, c.world_size = None, 0, 1
        return c

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Fill ``out`` (world_size * shard.numel()) with every rank's ``shard``."""
        if self.world_size == 1:
            out.copy_(shard, non_blocking=True)
            return Pending(out, None)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return Pending(out, fn(out, shard, group=self.group, async_op=async_op))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, *, async_op: bool = False) -> Pending:
        """Sum ``full`` over ranks and leave this rank's slice in ``out``."""
        if self.world_size == 1:
            out.copy_(full, non_blocking=True)
            return Pending(out, None)
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return Pending(out, fn(out, full, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op))

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.group)
        return t
