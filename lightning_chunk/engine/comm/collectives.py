"""Collectives over the data-parallel group, and their one-rank degenerate forms.

With one rank every collective is a local copy or a no-op, so the rest of the
engine is written once for any world size. With several ranks they go through
``torch.distributed`` (NCCL on GPU, gloo on CPU); ``all_gather_single`` and
``reduce_scatter_single`` are used where the installed torch has them, with a
fallback to the older ``*_into_tensor`` / ``*_tensor`` names.

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

[Note: naming a lost rank]
A rank that dies (SIGKILL, the OOM killer, a crash in native code) sends no message. With gloo its
peers see the connection close at once; a rank that is alive but stuck is seen only when the bounded
wait runs out. Either way the survivor's error should say *which* rank is gone, not only that a
socket closed. At set-up every rank learns every rank's pid and host (one fixed-size all-gather);
when a wait fails, each peer on this host is looked up in ``/proc`` (a killed child of Lightning's
launcher stays a zombie until it is reaped, so "exists" is not "alive"), and the error names the
ranks that are gone, or says that the peers on other hosts could not be checked from here.
After a failed wait the process must still be able to exit: gloo joins its worker threads at interpreter
exit, and one still receiving from a live but stuck peer never returns (aborting the group does not
release it). So the first failed wait registers an ``atexit`` handler that ends the process with
``os._exit(1)`` once the error has been reported and Lightning has torn down; this is what torch's NCCL
watchdog does on a timeout, too. Every collective after the first failed one fails at once without being
issued (a forward hook that runs while the error unwinds would otherwise wait out a second timeout).
On NCCL the waits stay stream-ordered (no host sync) and the process group's
``timeout`` bounds them through NCCL's watchdog.

[Note: memory a failed collective may still use]
When one wait fails, the collectives issued after it (a forward's prefetched gathers, the reduce-scatters
of a backward) are still queued on gloo's worker threads. Each is run when a thread takes it up: it copies
this rank's input into its output before its first message fails. The work holds its tensors, but not
their memory: a storage resized to nothing (a dropped chunk) or swapped out (the payload pool) takes the
memory from under it, and the copy lands in freed memory, a segmentation fault in gloo's thread or a
corrupted heap that crashed Python later. ``tests/faults/test_rank_dies.py``'s rank killed in the optimizer
step did this in 4 of 25 runs beside a busy loop: the survivor died in Lightning's teardown, after the
engine's teardown had freed every chunk. So once a collective failed (``Collectives.broken``) the engine
frees nothing explicitly: its teardown only lets go of its references, and each buffer goes with its last
holder, the gloo work included, or at the exit that follows.

[Note: reduce-scatter on gloo]
gloo has no reduce-scatter of its own: torch's ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``
clones the whole input in the calling thread, all-reduces the clone in a worker thread and copies this
rank's slice out on ``wait``. For a gradient payload that is a payload-sized allocation (page faults
included) and a copy on the compute thread at every launch: 35 to 90 ms for a 37.7 MB payload on 2 ranks
of the 2-core benchmark machine, against 1.5 to 3 ms to launch the all-reduce itself. The engine's
reduce-scatters write in place (``out`` is this rank's slice of ``full``, and ``full`` is freed after), so
on gloo with host tensors they all-reduce ``full`` in place instead: the same all-reduce on the same
values, hence the same bits, without the clone or the copy (measured: 40 ms for the whole collective
where gloo's reduce-scatter took 105). NCCL keeps its real reduce-scatter.

[Note: a gloo group per kind of collective]
A gloo process group runs its collectives on its own few worker threads. With every chunk collective on the
data-parallel group, a reduce-scatter launched during backward queued behind the all-gathers of host
placement's re-gathers (and the other way round). With the agreement check on, each size of all-gather and
reduce-scatter has a group of its own anyway ([Note: agreeing without a barrier]); with it off, all-gathers
and reduce-scatters still get one group each, made at set-up: on the peers model with host placement the
step was 2.87 and 3.05 s with one group for all, 2.74 and 2.47 s with the two (2026-11-24, two runs each).

[Note: gloo as NCCL]
NCCL runs every collective of a process group on one communicator, in issue order, and the agreement check is off
by default there: ranks that issue different sequences hang, or pair two same-size collectives of different chunks
and mix their data. On gloo the engine has two safety nets NCCL lacks (a group per kind of collective, and the
check), so a CPU test could pass where 8 GPUs fail. With ``LIGHTNING_CHUNK_GLOO_AS_NCCL=1`` gloo runs as NCCL does:
every collective on the data-parallel group, the check off unless ``verify_collectives`` asks for it; waits stay
bounded, so a divergence fails the test with an error instead of hanging it. The multi-rank parity suite runs so.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..errors import ChunkError
from ..system.host_id import host_number
from .agreement import (  # noqa: F401 (re-exported)
    OPS,
    Agreement,
    Check,
    CollectiveMismatchError,
    first_difference,
    gloo_group_over,
)

GLOO_AS_NCCL = "LIGHTNING_CHUNK_GLOO_AS_NCCL"  # [Note: gloo as NCCL]
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # older torch: the old name


class CollectiveTimeoutError(ChunkError):
    """A collective did not complete within the bounded wait."""


class CollectiveDeviceError(ChunkError, ValueError):
    """A tensor handed to a collective is not on the device its process group works on."""


class Pending(NamedTuple):
    """A buffer and the work that fills it travel together (FSDP2's habit)."""

    buffer: torch.Tensor
    work: Any | None
    describe: Callable[[], str] | None = None
    timeout_s: float | None = None
    diagnose: Callable[[], str] | None = None
    clock: Any | None = None  # a StepClock: the wait is charged to ``cause``
    cause: str = "sync_wait"
    before: Check = None  # the agreement check this wait must pass first

    def wait(self) -> torch.Tensor:
        if self.before is not None:
            self.before()
        if self.work is not None:
            with self.clock.measure(self.cause) if self.clock is not None else contextlib.nullcontext():
                self._wait()
        return self.buffer

    def _wait(self) -> None:
        if self.work is not None:
            try:
                if self.timeout_s is not None:
                    self.work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
                else:
                    self.work.wait()
            except RuntimeError as e:
                _exit_after_a_failed_collective()
                what = self.describe() if self.describe else "a collective"
                lost = self.diagnose() if self.diagnose else ""
                reason = (
                    f"{lost}. "
                    if lost
                    else "Another rank stopped or issued a different collective: a module ran "
                    "on some ranks and not on others (data-dependent control flow; verify_collectives=True "
                    "names the first collective where the ranks differ), or another rank failed; "
                    "see its error. "
                )
                error = CollectiveTimeoutError(
                    f"{what} did not complete (waited at most {self.timeout_s} s). {reason}"
                    f"[{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}]"
                )
                _broken.append(str(error))
                raise error from None


def _host_id() -> int:
    return host_number()  # [Note: telling hosts apart] in host_id.py


def process_state(pid: int) -> str:
    """``"gone"`` once ``pid`` has exited, been killed, or is a zombie waiting to be reaped; ``"stopped"`` for a
    stopped process (SIGSTOP, a debugger); ``"alive"`` otherwise, or when this host cannot tell."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "alive"
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        state, flags = fields[0], int(fields[6])
    except (OSError, IndexError, ValueError):
        return "alive"
    if state in (b"Z", b"X") or flags & _PF_EXITING:  # a killed process closes its sockets while it exits
        return "gone"
    return "stopped" if state in (b"T", b"t") else "alive"


_PF_EXITING = 0x4  # the kernel's flag for a task that is exiting (field 9 of /proc/<pid>/stat)
_exit_armed = False
_broken: list[str] = []  # the first failed wait of this process: no collective is attempted after it


def _refuse_if_broken(what: str | Callable[[], str]) -> None:
    """After one failed wait the group is unusable (a peer is gone, or stuck in an earlier collective): fail at
    once instead of waiting out another timeout, e.g. in a forward hook that runs while the error unwinds.
    ``what`` may be a callable, so that a chunk collective names itself only when it fails."""
    if _broken:
        what = what() if callable(what) else what
        raise CollectiveTimeoutError(f"{what} was not attempted: an earlier collective failed ({_broken[0]})")


def _exit_after_a_failed_collective() -> None:
    """See [Note: naming a lost rank]: gloo joins its worker threads at interpreter exit, and a thread still
    waiting on a live peer never returns, so the process would hang after it reported its error."""
    global _exit_armed
    if _exit_armed:
        return
    _exit_armed = True

    def leave() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    atexit.register(leave)


class Collectives:
    def __init__(
        self, group: Any | None = None, *, timeout_s: float | None = 300.0, verify: bool | str | None = None
    ) -> None:
        self.group = group
        self.timeout_s = timeout_s
        self.planning_only = False  # Collectives.planning: describes ranks, never communicates
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            backend = dist.get_backend(group)
        else:
            self.rank, self.world_size, backend = 0, 1, None
        # [Note: gloo as NCCL]: one communicator for everything and no check, as NCCL runs by default
        self.as_nccl = backend == "gloo" and os.environ.get(GLOO_AS_NCCL, "0") not in ("", "0")
        # [Note: checking once a micro-batch]: None is "batch" on gloo and off on NCCL; True is "each"
        if verify is None:
            mode = "batch" if backend == "gloo" and not self.as_nccl else None
        else:
            mode = {True: "each", False: None}.get(verify, verify)  # type: ignore[arg-type]
        self.verify = mode is not None
        self.gloo = backend == "gloo"  # [Note: reduce-scatter on gloo]
        if backend == "nccl":
            # an NCCL wait with a timeout may block the host; plain waits are stream-ordered and the
            # process group's own timeout (NCCL's watchdog) bounds them instead
            self.timeout_s = None
        self._tag_device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        self.names: Callable[[int, int], str] = lambda chunk, module: f"chunk {chunk}"
        self.peers: list[tuple[int, int]] = []
        self.clock: Any | None = None  # the engine's StepClock, once it has one
        self.agreement: Agreement | None = None
        self._op_groups: dict[str, Any] = {}
        if self.world_size > 1:
            self._learn_peers()
            if mode is not None:
                self.agreement = Agreement(self, lazy=self.gloo, mode=mode)
            elif self.gloo and not self.as_nccl:  # [Note: a gloo group per kind of collective]
                self._op_groups = {op: gloo_group_over(group) for op in OPS[:2]}

    def _learn_peers(self) -> None:
        """Every rank's ``(pid, host id)``; see [Note: naming a lost rank]."""
        out, work = self.gather_ints([os.getpid(), _host_id()], group=self.group)
        Pending(out, work, lambda: f"[rank {self.rank}] the start-up exchange of process ids", self.timeout_s).wait()
        self.peers = [tuple(r) for r in out.view(self.world_size, 2).tolist()]

    def ranks_on_this_host(self) -> int:
        """How many ranks (this one included) run on this host, as the start-up exchange told."""
        here = _host_id()
        return max(1, sum(1 for _, host in self.peers if host == here))

    def why_stuck(self) -> str:
        """Why a wait timed out, as far as can be told: a rank gone or stopped, else ranks that issued different
        chunk collectives ([Note: explaining a stuck wait]); "" when neither can be told."""
        lost = self.lost_peers()
        if lost or self.agreement is None:
            return lost
        return self.agreement.explain_stuck()

    def lost_peers(self) -> str:
        """Which other ranks are gone, as far as this host can tell ("" when it cannot tell). A peer whose
        connection just closed may still be exiting: look again for up to a second before saying none is."""
        if not self.peers:
            return ""
        deadline = time.monotonic() + 1.0
        while True:
            found = self._look_for_lost_peers()
            if found.startswith(("lost", "rank")) or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def _look_for_lost_peers(self) -> str:
        if not self.peers:
            return ""
        here = _host_id()
        gone: list[str] = []
        stopped: list[str] = []
        remote: list[int] = []
        for r, (pid, host) in enumerate(self.peers):
            if r == self.rank:
                continue
            if host != here:
                remote.append(r)
                continue
            state = process_state(pid)
            if state != "alive":
                (gone if state == "gone" else stopped).append(f"rank {r} (pid {pid})")
        where = f"; ranks {remote} on other hosts could not be checked from here" if remote else ""
        if gone:
            # a rank that raised first (its own timeout, a check) exits too: its error is the cause, and the
            # usual one is a module that ran on some ranks and not on others
            return (
                f"lost {', '.join(gone)}: the process exited or was killed{where}; if it raised an error first, "
                "that error names the cause (often a module that ran on some ranks and not on others: "
                "data-dependent control flow)"
            )
        if stopped:
            return f"{', '.join(stopped)} is stopped (SIGSTOP, or a debugger) and did not take part{where}"
        if remote:
            return (
                f"every rank on this host is alive; ranks {remote} run on other hosts: one of them failed or "
                "stopped (see its log)"
            )
        return ""

    @classmethod
    def local(cls) -> Collectives:
        """One rank, whether or not a process group exists."""
        c = cls.__new__(cls)
        c.group, c.rank, c.world_size, c.timeout_s, c.verify = None, 0, 1, None, False
        c.gloo = c.as_nccl = False
        c.planning_only = False
        c._tag_device = torch.device("cpu")
        c.names = lambda chunk, module: f"chunk {chunk}"
        c.peers = []
        c.clock = None
        c.agreement = None
        c._op_groups = {}
        return c

    @classmethod
    def planning(cls, world_size: int) -> Collectives:
        """Describes ``world_size`` ranks (this one rank 0) for sizing shards; it must not communicate."""
        c = cls.local()
        c.world_size = world_size
        c.planning_only = True
        return c

    # ---------------------------------------------------------------- checks
    def _check_device(self, what: str | Callable[[], str], *tensors: torch.Tensor) -> None:
        """Every tensor of a collective must be on the group's device: NCCL rejects host tensors (and gloo
        device ones) with an error that names neither the tensor nor the caller. Comparing device types
        costs nothing next to the collective, so the check is always on (``what`` named only when it fails)."""
        want = self._tag_device.type
        for t in tensors:
            if t.device.type != want:
                what = what() if callable(what) else what
                raise CollectiveDeviceError(
                    f"[rank {self.rank}] {what} was handed a tensor on {t.device}, but this process group works on "
                    f"{want} tensors; move it with .to(comm.tensor_device()) first."
                )

    def refuse_if_broken(self, what: str) -> None:
        _refuse_if_broken(what)

    @property
    def broken(self) -> bool:
        """A collective of this process failed: collectives still queued may use any buffer handed to one, so
        nothing may be freed explicitly ([Note: memory a failed collective may still use])."""
        return bool(_broken)

    def mark_broken(self, error: str) -> None:
        """The group can no longer be trusted (ranks disagreed with collectives left unmatched): refuse every later
        collective and leave the process at exit without joining gloo's threads ([Note: naming a lost rank])."""
        _exit_after_a_failed_collective()
        _broken.append(error)

    def gather_ints(self, values: Sequence[int], *, group: Any) -> tuple[torch.Tensor, Any]:
        """Every rank's ``values`` (the same count on each), in one all-gather issued on ``group`` without waiting:
        the output (``world_size * len(values)`` int64s, rank by rank) and its work."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self._tag_device)
        out = torch.empty(self.world_size * len(mine), dtype=torch.int64, device=self._tag_device)
        return out, _all_gather(out, mine, group=group, async_op=True)

    def wait_for(self, work: Any, what: str) -> None:
        """A bounded wait for a small collective (charged to ``sync_wait``)."""
        Pending(None, work, lambda: what, self.timeout_s, self.why_stuck, self.clock).wait()  # type: ignore[arg-type]

    def agree_on_value(self, value: int, *, what: str) -> bool:
        """True when every rank passed the same ``value`` (one fixed-size all-gather)."""
        if self.world_size == 1:
            return True
        _refuse_if_broken(f"[rank {self.rank}] {what}")
        if self.agreement is not None and self.agreement.mode == "batch":  # the value rides on the check's exchange
            values = self.agreement.verify_batch(value)
            return all(v == values[0] for v in values)
        if self.agreement is not None:  # a disagreement on a chunk collective is the better error
            self.agreement.verify_through()
        out, work = self.gather_ints([value], group=self.group)
        Pending(out, work, lambda: f"[rank {self.rank}] {what}", self.timeout_s, self.why_stuck, self.clock).wait()
        return bool((out == out[0]).all())

    def verify_issued(self) -> None:
        """Check now that every rank issued the same chunk collectives so far (``CollectiveMismatchError`` if not).
        Every rank must call it at the same point: before a result leaves the engine or is kept
        ([Note: checking once a micro-batch]). Nothing to do with one rank, the check off, or ``"each"``, where
        each result was checked before it was used."""
        if self.agreement is not None and self.agreement.mode == "batch":
            self.agreement.verify_through()

    def failed_ranks(self, ok: bool, *, what: str) -> list[int]:
        """Every rank says whether its part of ``what`` worked; the ranks whose part failed (a bounded barrier)."""
        if self.world_size == 1:
            return [] if ok else [0]
        _refuse_if_broken(f"[rank {self.rank}] {what}")
        out, work = self.gather_ints([int(bool(ok))], group=self.group)
        Pending(out, work, lambda: f"[rank {self.rank}] {what}", self.timeout_s, self.why_stuck, self.clock).wait()
        return [r for r, v in enumerate(out.tolist()) if not v]

    # ----------------------------------------------------------- collectives
    def all_gather(
        self, out: torch.Tensor, shard: torch.Tensor, *, chunk: int = -1, module: int = -1, async_op: bool = False
    ) -> Pending:
        """Fill ``out`` (world_size * shard.numel()) with every rank's ``shard``."""
        if self.world_size == 1:  # the copy from the shard's tier is the whole "gather"
            with self.clock.measure("tier_copy") if self.clock is not None else contextlib.nullcontext():
                out.copy_(shard, non_blocking=True)
            return Pending(out, None)
        _refuse_if_broken(lambda: f"[rank {self.rank}] all_gather of {self.names(chunk, module)}")
        self._check_device(lambda: f"all_gather of {self.names(chunk, module)}", out, shard)
        check, group = self._agree("all_gather", chunk, module, ("all_gather", out.numel() * out.element_size()))
        work = _all_gather(out, shard, group=group, async_op=True)
        return self._pending(out, work, "all_gather", chunk, module, async_op, check)

    def reduce_scatter(
        self, out: torch.Tensor, full: torch.Tensor, *, chunk: int = -1, module: int = -1, async_op: bool = False
    ) -> Pending:
        """Sum ``full`` over ranks and leave this rank's slice in ``out``."""
        if self.world_size == 1:
            with self.clock.measure("tier_copy") if self.clock is not None else contextlib.nullcontext():
                out.copy_(full, non_blocking=True)
            return Pending(out, None)
        _refuse_if_broken(lambda: f"[rank {self.rank}] reduce_scatter of {self.names(chunk, module)}")
        self._check_device(lambda: f"reduce_scatter of {self.names(chunk, module)}", out, full)
        in_place = self.gloo and full.device.type == "cpu" and self._is_own_slice(out, full)
        kind = ("all_reduce" if in_place else "reduce_scatter", full.numel() * full.element_size())
        check, group = self._agree("reduce_scatter", chunk, module, kind)
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
            lambda: f"[rank {self.rank}] {op} of {self.names(chunk, module)}",
            self.timeout_s,
            self.why_stuck,
            self.clock,
            "gather_wait" if op == "all_gather" else "reduce_wait",
            check,
        )
        if not async_op:
            p.wait()
        return p

    def all_reduce(self, t: torch.Tensor, op: str = "sum", *, what: str = "all_reduce") -> torch.Tensor:
        if self.world_size > 1:
            _refuse_if_broken(f"[rank {self.rank}] {what}")
            self._check_device(what, t)
            work = dist.all_reduce(
                t,
                op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op],
                group=self.group,
                async_op=True,
            )
            Pending(t, work, lambda: f"[rank {self.rank}] {what}", self.timeout_s, self.why_stuck, self.clock).wait()
        return t

    def broadcast(
        self, t: torch.Tensor, src: int = 0, *, what: str = "the broadcast of initial values"
    ) -> torch.Tensor:
        """Rank ``src``'s ``t`` on every rank (in place; a timeout names ``what``)."""
        if self.world_size > 1:
            _refuse_if_broken(f"[rank {self.rank}] {what}")
            buf = t.to(self._tag_device)
            work = dist.broadcast(buf, src, group=self.group, async_op=True)
            Pending(buf, work, lambda: f"[rank {self.rank}] {what}", self.timeout_s, self.why_stuck, self.clock).wait()
            t.copy_(buf)
        return t

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.all_gather_object_on(obj, self.group)

    def all_gather_object_on(self, obj: Any, group: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def tensor_device(self) -> torch.device:
        return self._tag_device

    def host_group(self) -> Any:
        """A process group over the same ranks that takes host tensors (for checkpoints written from the host):
        the group itself on gloo; on NCCL a gloo twin, made on first use. Every rank must call it together."""
        if self._tag_device.type == "cpu":
            return self.group if self.group is not None else dist.group.WORLD
        if getattr(self, "_host_group", None) is None:
            self._host_group = gloo_group_over(self.group)
        return self._host_group
