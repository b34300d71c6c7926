"""The data-parallel group as the engine sees it (``RankGroup``): this rank, the world size, the device its tensors
live on, every rank's process and host, the gloo groups beside it, and whether a collective failed. ``Collectives``
(``collectives.py``) issues the collectives over it.

[Note: a gloo group per kind of collective]
A gloo process group runs its collectives on its own few worker threads. With every chunk collective on the
data-parallel group, a reduce-scatter launched during backward queued behind the all-gathers of host
placement's re-gathers (and the other way round). With the agreement check on, each size of all-gather and
reduce-scatter has a group of its own anyway ([Note: agreeing without a barrier]); with it off, all-gathers
and reduce-scatters still get one group each, made at set-up (a few percent of a host-placement step on the
peers model).


[Note: gloo as NCCL]
NCCL runs every collective of a process group on one communicator, in issue order, and the agreement check is off
by default there: ranks that issue different sequences hang, or pair two same-size collectives of different chunks
and mix their data. On gloo the engine has two safety nets NCCL lacks (a group per kind of collective, and the
check), so a CPU test could pass where 8 GPUs fail. With ``LIGHTNING_CHUNK_GLOO_AS_NCCL=1`` gloo runs as NCCL does:
every collective on the data-parallel group, the check off unless ``verify_collectives`` asks for it; waits stay
bounded, so a divergence fails the test with an error instead of hanging it. The multi-rank parity suite runs so.


[Note: replicas of the shard group]
With ``shard_size`` (FSDP's HYBRID_SHARD, DeepSpeed's MiCS) each chunk is sharded over a group of ``shard_size``
consecutive ranks, a node's devices, and every such group holds the same shards: a replica. Forward's all-gathers
and backward's reduce-scatters stay in the shard group, on the node's fast links; the only collective that crosses
groups is one all-reduce of each gradient shard over its replicas a step (``Collectives.replicate``; [Note: replicas
summed once a step] in ``replicas.py``), and the payload is scaled by one over every rank, so the shard ends as
DDP's mean. ``rank`` and ``world_size`` are within the shard group, and the layout, the optimizer and checkpoints
see only it: a checkpoint is a ``shard_size``-rank one, written by the first group alone. What must be the same on
every rank is agreed over all of them (``all_group``): the memory limits (they set the layout), the votes on which
parameters got gradients, the agreement check's tags, the order of reduces, saves' outcomes; a sum of what each
rank's shards hold (the gradient norm) stays in the shard group (``shards=True``).
"""

from __future__ import annotations

import copy
import datetime
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import ChunkError
from ..system.host_id import host_number
from . import waits
from .agreement import OPS, Agreement, gloo_group_over
from .waits import Pending, refuse_if_broken_now

GLOO_AS_NCCL = "LIGHTNING_CHUNK_GLOO_AS_NCCL"  # [Note: gloo as NCCL]
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # older torch: the old name


class CollectiveDeviceError(ChunkError, ValueError):
    """A tensor handed to a collective is not on the device its process group works on."""


_FORWARD_ADVICE = (
    "Each forward gathers parameters from every rank, as under ZeRO-3 and FSDP, so every rank must run it: one under "
    "`if trainer.is_global_zero:` waits for ranks that never come. Run it on every rank; print or save on one."
)


def _own_timeout_s(group: Any) -> float:
    """The process group's own timeout in seconds (``init_process_group(timeout=...)``), or 30 minutes where torch does
    not say."""
    try:
        pg: Any = group if group is not None else dist.group.WORLD
        return float(pg._get_backend(torch.device("cuda")).options._timeout.total_seconds())
    except (AttributeError, RuntimeError, ValueError):
        return 1800.0


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


# the bytes of each kind of chunk collective this rank took part in: the whole gathered or reduced chunk, and the
# shard all-reduced over replicas ([Note: replicas of the shard group]); what crosses nodes with node shard groups
MOVED = ("all_gather_bytes", "reduce_scatter_bytes", "replica_all_reduce_bytes")

G = TypeVar("G", bound="RankGroup")


def shard_ranks(shard_size: int | str | None, world: int, per_node: int) -> int:
    """The ranks each chunk is sharded over among ``world`` ranks, ``per_node`` a node: ``world`` for ``None``
    ([Note: replicas of the shard group]). A size that does not tile the ranks is refused before any group is made."""
    size = per_node if shard_size == "node" else shard_size
    if size is None or isinstance(size, int) and not isinstance(size, bool) and size >= world:
        return world
    if isinstance(size, bool) or not isinstance(size, int) or size < 2 or world % size:
        raise ValueError(
            f"shard_size={shard_size!r} is not allowed with {world} ranks; it must divide the number of ranks and be "
            "at least 2 ('node': a node's devices; None: every rank)."
        )
    return size


class RankGroup:
    """This rank within the data-parallel group, and what the collectives over it need to know."""

    def __init__(
        self,
        group: Any | None = None,
        *,
        replicas: Any | None = None,
        timeout_s: float | None = 300.0,
        verify: bool | str | None = None,
    ) -> None:
        self.group = group  # the ranks each chunk is sharded over: ``rank`` and ``world_size`` are within it
        self.replicas = replicas  # [Note: replicas of the shard group]: the ranks holding this rank's shard too
        self.timeout_s = timeout_s
        self.planning_only = False  # Collectives.planning: describes ranks, never communicates
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            backend = dist.get_backend(group)
        else:
            self.rank, self.world_size, backend = 0, 1, None
        # the group every rank agrees over (votes, limits, saves): the shard group, or with replicas all ranks
        self.all_group = None if replicas is not None else group
        self.all_rank, self.all_size = (
            (dist.get_rank(), dist.get_world_size()) if replicas is not None else (self.rank, self.world_size)
        )
        self.replica_index = dist.get_rank(replicas) if replicas is not None else 0
        self.replica_count = dist.get_world_size(replicas) if replicas is not None else 1
        self.moved = dict.fromkeys(MOVED, 0)  # bytes of chunk collectives issued, by kind (``memory_stats()``)
        # [Note: gloo as NCCL]: one communicator for everything and no check, as NCCL runs by default
        self.as_nccl = backend == "gloo" and os.environ.get(GLOO_AS_NCCL, "0") not in ("", "0")
        # [Note: checking once a micro-batch]: None is "batch" on gloo and off on NCCL; True is "each"
        if verify is None:
            mode = "batch" if backend == "gloo" and not self.as_nccl else None
        else:
            mode = {True: "each", False: None}.get(verify, verify)  # type: ignore[arg-type]
        self.verify = mode is not None
        self.gloo = backend == "gloo"  # [Note: reduce-scatter on gloo]
        # [Note: a forward outside a step]: no sooner than NCCL's watchdog would end a wait on NCCL
        self.roll_call_s = _own_timeout_s(group) if backend == "nccl" else timeout_s
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
        self._roll_group: Any | None = None
        self.made: list[Any] = []  # the gloo groups made for this run, destroyed by ``close``
        if self.all_size > 1:
            self._learn_peers()
            self._roll_group = self.gloo_group(self.roll_call_s, over_all=True)
            if mode is not None:
                self.agreement = Agreement(self, lazy=self.gloo, mode=mode)
            elif self.gloo and not self.as_nccl:  # [Note: a gloo group per kind of collective]
                self._op_groups = {op: self.gloo_group() for op in OPS[:2]}

    def gloo_group(self, timeout_s: float | None = None, *, over_all: bool = False) -> Any:
        """A new gloo group over this group's ranks (``over_all``: ``all_group``'s), which each of them makes at the
        same point; ``close`` destroys it."""
        made = gloo_group_over(self.all_group if over_all else self.group, timeout_s)
        self.made.append(made)
        return made

    def close(self) -> None:
        """The end of the run: destroy the gloo groups made for it. Each holds sockets to every peer and threads, so a
        process that fits again and again gathered them (on two ranks with gloo's defaults 35 descriptors and 21
        threads a fit, until the descriptors ran out). After a failed collective they stay: a group's thread may be
        stuck on a live peer, and the process is on its way out ([Note: naming a lost rank] in ``waits.py``)."""
        made, self.made[:] = list(self.made), []
        self._roll_group, self._op_groups = None, {}
        for made_on_first_use in ("_host_group", "_all_host_group", "_beside"):
            self.__dict__.pop(made_on_first_use, None)
        if not waits.is_broken():
            for g in made:
                dist.destroy_process_group(g)

    def _learn_peers(self) -> None:
        """Every rank's ``(pid, host id)``; see [Note: naming a lost rank]."""
        out, work = self.gather_ints([os.getpid(), _host_id()], group=self.all_group)
        Pending(
            out, work, lambda: f"[rank {self.all_rank}] the start-up exchange of process ids", self.timeout_s
        ).wait()
        self.peers = [tuple(r) for r in out.view(self.all_size, 2).tolist()]

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
            if r == self.all_rank:
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
                "data-dependent control flow, such as a mixture of experts running only the chosen experts)"
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
    def over(cls: type[G], shard_size: int, **kwargs: Any) -> G:
        """Every rank of the default process group; with ``shard_size`` (``shard_ranks``'s) below their number, chunks
        are sharded over groups of that many consecutive ranks and replicated across the groups ([Note: replicas of
        the shard group]). Every rank calls it together."""
        world = dist.get_world_size()
        if shard_size >= world:
            return cls(**kwargs)
        rank, made = dist.get_rank(), []
        shards = replicas = None
        for first in range(0, world, shard_size):  # every rank makes every group, in the same order
            g = dist.new_group(list(range(first, first + shard_size)))
            made.append(g)
            shards = g if first <= rank < first + shard_size else shards
        for at in range(shard_size):
            g = dist.new_group(list(range(at, world, shard_size)))
            made.append(g)
            replicas = g if rank % shard_size == at else replicas
        c = cls(shards, replicas=replicas, **kwargs)
        c.made.extend(made)
        return c

    @classmethod
    def local(cls: type[G]) -> G:
        """One rank, whether or not a process group exists."""
        c = cls.__new__(cls)
        c.group, c.rank, c.world_size, c.timeout_s, c.verify = None, 0, 1, None, False
        c.replicas, c.all_group, c.all_rank, c.all_size, c.replica_index, c.replica_count = None, None, 0, 1, 0, 1
        c.moved = dict.fromkeys(MOVED, 0)
        c.roll_call_s, c._roll_group, c.made = None, None, []
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
    def planning(cls: type[G], world_size: int) -> G:
        """Describes ``world_size`` ranks (this one rank 0) for sizing shards; it must not communicate."""
        c = cls.local()
        c.world_size = world_size
        c.planning_only = True
        return c

    def _check_device(self, what: str | Callable[[], str], *tensors: torch.Tensor) -> None:
        """Every tensor of a collective must be on the group's device: NCCL rejects host tensors (and gloo
        device ones) with an error that names neither the tensor nor the caller. Comparing device types
        costs nothing next to the collective, so the check is always on (``what`` named only when it fails)."""
        want = self._tag_device.type
        for t in tensors:
            if t.device.type != want:
                what = what() if callable(what) else what
                raise CollectiveDeviceError(
                    f"[rank {self.all_rank}] {what} was handed a tensor on {t.device}, but this process group works on "
                    f"{want} tensors; move it with .to(comm.tensor_device()) first."
                )

    def refuse_if_broken(self, what: str) -> None:
        refuse_if_broken_now(what)

    @property
    def broken(self) -> bool:
        """A collective of this process failed: collectives still queued may use any buffer handed to one, so
        nothing may be freed explicitly ([Note: memory a failed collective may still use])."""
        return waits.is_broken()

    def mark_broken(self, error: str) -> None:
        """The group can no longer be trusted (ranks disagreed with collectives left unmatched): refuse every later
        collective and leave the process at exit without joining gloo's threads ([Note: naming a lost rank])."""
        waits.mark_broken(error)

    def gather_ints(self, values: Sequence[int], *, group: Any) -> tuple[torch.Tensor, Any]:
        """Every rank's ``values`` (the same count on each), in one all-gather issued on ``group`` without waiting:
        the output (``len(values)`` int64s for each of ``group``'s ranks, rank by rank) and its work."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self._tag_device)
        out = torch.empty(dist.get_world_size(group) * len(mine), dtype=torch.int64, device=self._tag_device)
        return out, _all_gather(out, mine, group=group, async_op=True)

    def tensor_device(self) -> torch.device:
        return self._tag_device

    def host_group(self) -> Any:
        """A process group over the same ranks that takes host tensors (for checkpoints written from the host):
        the group itself on gloo; on NCCL a gloo twin, made on first use. Every rank must call it together."""
        if self._tag_device.type == "cpu":
            return self.group if self.group is not None else dist.group.WORLD
        if getattr(self, "_host_group", None) is None:
            self._host_group = self.gloo_group()
        return self._host_group

    def all_host_group(self) -> Any:
        """``host_group()`` over ``all_group``'s ranks: the same group without replicas."""
        if self.replicas is None:
            return self.host_group()
        if self._tag_device.type == "cpu":
            return self.all_group if self.all_group is not None else dist.group.WORLD
        if getattr(self, "_all_host_group", None) is None:
            self._all_host_group = self.gloo_group(over_all=True)
        return self._all_host_group

    def beside(self: G) -> G:
        """This group's ranks over a gloo group of their own, made on first use (every rank calls it together):
        for the collectives of a thread that runs beside training, such as a save written in the background,
        which must never pair with the chunk collectives. No agreement tags and no step clock (the training
        thread's)."""
        if self.world_size == 1:
            return self
        side = getattr(self, "_beside", None)
        if side is None:
            side = copy.copy(self)
            side.group = side._host_group = self.gloo_group(self.timeout_s)
            side.all_group = side._all_host_group = (
                side.group if self.replicas is None else self.gloo_group(self.timeout_s, over_all=True)
            )
            side._tag_device = torch.device("cpu")
            side.agreement, side._op_groups, side.clock = None, {}, None
            self._beside = side
        return side

    def roll_call(
        self,
        where: str | None = None,
        *,
        what: str = "a forward outside a training or evaluation step",
        advice: str = _FORWARD_ADVICE,
    ) -> None:
        """[Note: a forward outside a step]
        In a step every rank runs the same forwards: Lightning calls ``training_step`` on each, and every rank runs as
        many batches ([Note: the same number of batches on every rank]). Outside one (a callback drawing samples at
        the end of an epoch, ``if trainer.is_global_zero:`` around it, as works under DDP) a forward's gathers
        waited for ranks that were already in the next batch's collectives: on NCCL a hang until its watchdog ended
        the job, on gloo a timeout that blamed data-dependent control flow. So the first forward after a step
        (or before the first) runs a roll call: ``monitored_barrier`` on a gloo group of its own, made at set-up,
        which pairs with nothing else; a save begins with one too (``ChunkCheckpoints``, whose object exchange
        waited unbounded). Where every rank comes it costs one small exchange; where one does not, the ranks that
        came raise ``CollectiveTimeoutError`` naming the caller's hook (``where``), the ranks missing and the way
        out, after ``collective_timeout_s`` on gloo and the process group's own timeout on NCCL (so a rank that is
        merely slow, finishing work of its own first, fails no sooner than NCCL would have failed it)."""
        if self._roll_group is None:
            return
        what += f" (in {where})" if where else ""
        refuse_if_broken_now(what)
        try:
            timeout = None if self.roll_call_s is None else datetime.timedelta(seconds=self.roll_call_s)
            dist.monitored_barrier(group=self._roll_group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as e:
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            error = f"[rank {self.all_rank}] {what} did not find every rank running one ({detail}). {advice}"
            waits.mark_broken(error)
            raise waits.CollectiveTimeoutError(error) from None

    def wait_for(self, work: Any, what: str) -> None:
        """A bounded wait for a small collective (charged to ``sync_wait``)."""
        Pending(None, work, lambda: what, self.timeout_s, self.why_stuck, self.clock).wait()  # type: ignore[arg-type]

    def all_gather_object_on(self, obj: Any, group: Any) -> list[Any]:
        if self.all_size == 1:
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out
