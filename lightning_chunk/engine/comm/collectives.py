"""Collectives over the data-parallel group, and their one-rank degenerate forms.

With one rank every collective is a local copy or a no-op, so the rest of the
engine is written once for any world size. With several ranks they go through
``torch.distributed`` (NCCL on GPU, gloo on CPU); ``all_gather_single`` and
``reduce_scatter_single`` are used where the installed torch has them, with a
fallback to the older ``*_into_tensor`` / ``*_tensor`` names. What the group is (ranks, peers, devices, the gloo
groups beside it) is ``group.py``'s; how a wait is bounded and what a failed one leaves, ``waits.py``'s.

[Note: ranks that disagree]
Collectives are matched by order: if one rank skips a module that another runs,
the next all-gathers pair different chunks. With gloo, two chunks of different
sizes abort the process (SIGABRT, nothing to catch) and two of the same size
silently swap data. So before each chunk collective the ranks exchange a
fixed-size *tag* ``[op, chunk, module]`` (``verify``; on by default with gloo;
optional on NCCL, where reading it back syncs the stream) and raise
``CollectiveMismatchError`` on every rank that sees a difference, naming each
rank's chunk and module. On gloo the tags are compared when the collective is
waited for, not before it is issued ([Note: agreeing without a barrier] in
``agreement.py``). Every wait is bounded by
``timeout_s``: a rank left waiting for a peer that raised or went elsewhere gets
``CollectiveTimeoutError`` naming the chunk and module it waited in, not a hang.


[Note: reduce-scatter on gloo]
gloo has no reduce-scatter of its own: torch's ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``
clones the whole input in the calling thread, all-reduces the clone in a worker thread and copies this
rank's slice out on ``wait``. For a gradient payload that is a payload-sized allocation (page faults
included) and a copy on the compute thread at every launch, many times the cost of launching the all-reduce
itself. The engine's
reduce-scatters write in place (``out`` is this rank's slice of ``full``, and ``full`` is freed after), so
on gloo with host tensors they all-reduce ``full`` in place instead: the same all-reduce on the same
values, hence the same bits, without the clone or the copy. NCCL keeps its real reduce-scatter.

"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import ChunkError
from .agreement import Check, CollectiveMismatchError, first_difference
from .group import GLOO_AS_NCCL, CollectiveDeviceError, RankGroup, _all_gather
from .waits import CollectiveTimeoutError, Pending, refuse_if_broken_now

__all__ = [
    "GLOO_AS_NCCL",
    "CollectiveDeviceError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "Collectives",
    "Pending",
    "PeerFailedError",
    "first_difference",
]

T = TypeVar("T")


class PeerFailedError(ChunkError):
    """What a rank raises where a step every rank takes together failed on other ranks (``on_every_rank``)."""


class Collectives(RankGroup):
    """The collectives the engine issues over its ``RankGroup``; with one rank each is a local copy or a no-op."""

    # ---------------------------------------------------------------- checks

    def agree_on_value(self, value: int, *, what: str) -> bool:
        """True when every rank passed the same ``value`` (one fixed-size all-gather)."""
        values = self.values_of_ranks(value, what=what)
        return all(v == values[0] for v in values)

    def values_of_ranks(self, value: int, *, what: str) -> list[int]:
        """Every rank's ``value``, rank by rank (one fixed-size all-gather; every rank must call it together)."""
        if self.all_size == 1:
            return [value]
        refuse_if_broken_now(f"[rank {self.all_rank}] {what}")
        if self.agreement is not None and self.agreement.mode == "batch":  # the value rides on the check's exchange
            return self.agreement.verify_batch(value, what)
        if self.agreement is not None:  # a disagreement on a chunk collective is the better error
            self.agreement.verify_through()
        out, work = self.gather_ints([value], group=self.all_group)
        Pending(out, work, lambda: f"[rank {self.all_rank}] {what}", self.timeout_s, self.why_stuck, self.clock).wait()
        return [int(v) for v in out.tolist()]

    def verify_issued(self) -> None:
        """Check now that every rank issued the same chunk collectives so far (``CollectiveMismatchError`` if not).
        Every rank must call it at the same point: before a result leaves the engine or is kept
        ([Note: checking once a micro-batch]). Nothing to do with one rank, the check off, or ``"each"``, where
        each result was checked before it was used."""
        if self.agreement is not None and self.agreement.mode == "batch":
            self.agreement.verify_through()

    def failed_ranks(self, ok: bool, *, what: str) -> list[int]:
        """Every rank says whether its part of ``what`` worked; the ranks whose part failed (a bounded barrier)."""
        if self.all_size == 1:
            return [] if ok else [0]
        refuse_if_broken_now(f"[rank {self.all_rank}] {what}")
        out, work = self.gather_ints([int(bool(ok))], group=self.all_group)
        Pending(out, work, lambda: f"[rank {self.all_rank}] {what}", self.timeout_s, self.why_stuck, self.clock).wait()
        return [r for r, v in enumerate(out.tolist()) if not v]

    def on_every_rank(self, fn: Callable[[], T], *, what: str) -> T:
        """``fn()`` on this rank, then the ranks agree: where it raised on some, it raises there and the others raise
        ``PeerFailedError`` naming them, where they would have gone on into a collective the failed ranks never
        issue (a hang on NCCL, a warning of data-dependent control flow on gloo)."""
        try:
            out = fn()
        except Exception:
            self.failed_ranks(False, what=what)
            raise
        failed = self.failed_ranks(True, what=what)
        if failed:
            raise PeerFailedError(f"[rank {self.all_rank}] {what} failed on rank(s) {failed}; see their errors.")
        return out

    # ----------------------------------------------------------- collectives
    def all_gather(
        self, out: torch.Tensor, shard: torch.Tensor, *, chunk: int = -1, module: int = -1, async_op: bool = False
    ) -> Pending:
        """Fill ``out`` (world_size * shard.numel()) with every rank's ``shard``."""
        if self.world_size == 1:  # the copy from the shard's tier is the whole "gather"
            with self.clock.measure("tier_copy") if self.clock is not None else contextlib.nullcontext():
                out.copy_(shard, non_blocking=True)
            return Pending(out, None)
        refuse_if_broken_now(lambda: f"[rank {self.all_rank}] all_gather of {self.names(chunk, module)}")
        self._check_device(lambda: f"all_gather of {self.names(chunk, module)}", out, shard)
        nbytes = out.numel() * out.element_size()
        check, group = self._agree("all_gather", chunk, module, ("all_gather", nbytes))
        work = _all_gather(out, shard, group=group, async_op=True)
        self.moved["all_gather_bytes"] += nbytes
        return self._pending(out, work, "all_gather", chunk, module, async_op, check)

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, *, chunk: int = -1, module: int = -1, async_op: bool = False
    ) -> Pending:
        """Sum ``full`` over ranks and leave this rank's slice in ``out``."""
        if self.world_size == 1:
            with self.clock.measure("tier_copy") if self.clock is not None else contextlib.nullcontext():
                out.copy_(full, non_blocking=True)
            return Pending(out, None)
        refuse_if_broken_now(lambda: f"[rank {self.all_rank}] reduce_scatter of {self.names(chunk, module)}")
        self._check_device(lambda: f"reduce_scatter of {self.names(chunk, module)}", out, full)
        in_place = self.gloo and full.device.type == "cpu" and self._is_own_slice(out, full)
        kind = ("all_reduce" if in_place else "reduce_scatter", full.numel() * full.element_size())
        check, group = self._agree("reduce_scatter", chunk, module, kind)
        self.moved["reduce_scatter_bytes"] += kind[1]
        if in_place:
            work = dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group, async_op=True)
        else:
            fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            work = fn(out, full, op=dist.ReduceOp.SUM, group=group, async_op=True)
        return self._pending(out, work, "reduce_scatter", chunk, module, async_op, check)

    def _agree(self, op: str, chunk: int, module: int, kind: tuple[str, int]) -> tuple[Check, Any]:
        """The agreement check of a chunk collective (see [Note: ranks that disagree]) and the group it goes on."""
        if self.agreement is None:
            return None, self._op_groups.get(op, self.group)
        return self.agreement.before(op, chunk, module, kind)

    def _is_own_slice(self, out: torch.Tensor, full: torch.Tensor) -> bool:
        """``out`` is this rank's slice of ``full``, in place: ``full[rank * n : (rank + 1) * n]``."""
        n = out.numel()
        return (
            full.is_contiguous()
            and out.is_contiguous()
            and out.dtype == full.dtype
            and n * self.world_size == full.numel()
            and out.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
            and out.storage_offset() == full.storage_offset() + self.rank * n
        )

    def _pending(
        self, out: torch.Tensor, work: Any, op: str, chunk: int, module: int, async_op: bool, check: Check = None
    ) -> Pending:
        p = Pending(
            out,
            work,
            lambda: f"[rank {self.all_rank}] {op} of {self.names(chunk, module)}",
            self.timeout_s,
            self.why_stuck,
            self.clock,
            "gather_wait" if op == "all_gather" else "reduce_wait",
            check,
        )
        if not async_op:
            p.wait()
        return p

    def all_reduce(
        self, t: torch.Tensor, op: str = "sum", *, what: str = "all_reduce", shards: bool = False
    ) -> torch.Tensor:
        return self.all_reduce_async(t, op, what=what, shards=shards).wait()

    def all_reduce_async(
        self, t: torch.Tensor, op: str = "sum", *, what: str = "all_reduce", on_host: bool = False, shards: bool = False
    ) -> Pending:
        """``t`` reduced over every rank in place, once the returned ``Pending`` is waited for: a vote or an agreement.
        ``shards``: over the shard group only, for a sum of what each rank's shards hold ([Note: replicas of the shard
        group]). ``on_host``: ``t`` is a host tensor, reduced over a gloo group (on NCCL a twin): a vote taken in
        backward neither copies to the device nor reads back from it, either of which would wait for the compute
        stream."""
        if (self.world_size if shards else self.all_size) == 1:
            return Pending(t, None)
        refuse_if_broken_now(f"[rank {self.all_rank}] {what}")
        if not on_host:
            self._check_device(what, t)
        if on_host:
            group = self.host_group() if shards else self.all_host_group()
        else:
            group = self.group if shards else self.all_group
        work = dist.all_reduce(
            t,
            op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
            group=group,
            async_op=True,
        )
        return Pending(t, work, lambda: f"[rank {self.all_rank}] {what}", self.timeout_s, self.why_stuck, self.clock)

    def replicate(self, shard: torch.Tensor, *, chunk: int = -1) -> None:
        """Sum a reduced gradient shard over the ranks holding the same shard, in place ([Note: replicas of the shard
        group]); nothing without replicas."""
        if self.replicas is None:
            return
        refuse_if_broken_now(lambda: f"[rank {self.all_rank}] the all-reduce of {self.names(chunk, -1)} over replicas")
        work = dist.all_reduce(shard, op=dist.ReduceOp.SUM, group=self.replicas, async_op=True)
        self.moved["replica_all_reduce_bytes"] += shard.numel() * shard.element_size()
        self._pending(shard, work, "all_reduce over replicas", chunk, -1, async_op=False)

    def broadcast(
        self, t: torch.Tensor, src: int = 0, *, what: str = "the broadcast of initial values"
    ) -> torch.Tensor:
        """Rank ``src``'s ``t`` on every rank (in place; a timeout names ``what``)."""
        if self.all_size > 1:
            refuse_if_broken_now(f"[rank {self.all_rank}] {what}")
            buf = t.to(self._tag_device)
            work = dist.broadcast(buf, src, group=self.all_group, async_op=True)
            Pending(
                buf, work, lambda: f"[rank {self.all_rank}] {what}", self.timeout_s, self.why_stuck, self.clock
            ).wait()
            t.copy_(buf)
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (``all_group``'s ranks)."""
        return self.all_gather_object_on(obj, self.all_group)
