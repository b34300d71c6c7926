"""The agreement check before each chunk collective: which collective every rank is about to issue.

[Note: agreeing without a barrier]
[Note: ranks that disagree] in ``collectives.py`` says why ranks exchange a tag ``[op, chunk, module]``
before each chunk collective: with gloo, two ranks that pair different collectives either swap data
silently (same size) or abort the process (different sizes, SIGABRT, nothing to catch). Checked as a
barrier (issue the tag, wait for it, compare, then issue the collective) the check made every chunk
collective a rendezvous: a rank that got ahead waited for the other at each prefetch, so the ranks
could not drift within the prefetch window, and these waits were 9 to 16% of a resident 2-rank step on
the peers model (1.21 to 1.48x DDP with the check, 1.00 to 1.29x without it, the same runs).

So on gloo the tag is issued and the collective right after it, without waiting, and the tags are
compared when the collective is *waited for*, before its result is used: every wait first checks every
tag issued up to its own. That keeps both promises of the barrier:

- Nothing wrong is used. A result is read only after every tag up to its collective agreed, i.e. after
  every rank is known to have issued the same collectives in the same order up to it.
- Nothing aborts. Each collective's *key* (chunk collective, gloo operation, bytes) has a process group
  of its own, and the tags one more. A collective goes without a barrier only when its key was checked
  with a barrier before; the first of a key is checked with a barrier, which creates the key's group on
  every rank at the same point. Up to the first disagreement every rank has issued the same collectives,
  so every rank knows the same keys; after it every barrier fails, so no rank learns another. A group
  therefore only ever carries collectives of its one size and operation: ranks that disagree pair two
  of them at worst (a silent swap, which the tags catch before anyone reads the result), or leave one
  waiting for a partner that never comes (a hang the tags end, or the bounded wait); they never abort.
  A layout has a few sizes of chunk (the chunk size, a small param group's chunks, the trimmed tail),
  so a run pays a few barriers, once. Past ``MAX_KEYS`` keys of one collective, the others are checked
  with a barrier every time, on a group that carries nothing else.

A disagreement found at a wait leaves collectives of the other kinds issued and never matched; the
process must not wait for them at exit, so it is handled as a failed collective ([Note: naming a lost
rank]): the error is raised on this rank, later collectives are refused, and the process exits after
Lightning's teardown. With NCCL (where the check is optional, and reading a tag back syncs the stream)
the barrier form stays: its collectives are stream-ordered, and the size rule above is a gloo rule.

[Note: checking once a micro-batch]
A tag before every chunk collective is one more gloo collective each: 88 a step on the peers model with
everything resident, 131 with host placement; resident on 2 ranks that was 1.12x DDP against 1.06x checked as
below (docs/benchmarks.md). So by default
(``verify_collectives=None`` on gloo, ``"batch"``) the tags are not exchanged one by one: each rank keeps the
collectives it issued since the last check (and a CRC of them), and the ranks compare the CRCs at the points where
a result would leave the micro-batch or be kept:

- the end of every backward (in one exchange with the module sequence's CRC, ``sequence.py``),
- before every optimizer step, and before a chunk steps during backward (``step_in_backward``),
- before an evaluation step returns its outputs, and before a synchronous collective's result is handed back
  (``full_parameters``, a full checkpoint, the teardown's gather),
- at the first collective of every key (the barrier the Note above needs to make the key's group), and every
  ``BATCH_CAP`` collectives (a bound on what is kept; forwards outside any step, such as a generation loop).

Each point is a place in the program every rank reaches in the same order, so the checks pair as the tags did.
What the keyed groups promise is unchanged: a collective of a known key goes unchecked on a group that carries
only its size and operation, so ranks that disagree never abort. What changes is *when* a disagreement is seen:
ranks that pair two different collectives of one size (a silent swap) compute with wrong values until the next
check, which raises ``CollectiveMismatchError`` naming the first collective where they differ, before any
optimizer step reads a gradient and before an evaluation step's outputs are returned; ranks left waiting on
collectives of different sizes see ``CollectiveTimeoutError`` once ``collective_timeout_s`` runs out (naming the
chunk and module each waited in) instead of the mismatch at once. ``verify_collectives=True`` (``"each"``) keeps a
tag before every collective, for debugging such a run; the check costs the same as before there.
"""

from __future__ import annotations

import collections
import datetime
import struct
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import torch
import torch.distributed as dist

from ..errors import ChunkError

if TYPE_CHECKING:  # the group builds its agreement; no import at run time, so no cycle
    from .group import RankGroup

OPS = ("all_gather", "reduce_scatter", "all_reduce")


class CollectiveMismatchError(ChunkError):
    """Ranks issued different collectives at the same point."""


class _Tag(NamedTuple):
    seq: int
    out: torch.Tensor
    work: Any
    what: str


def gloo_group_over(group: Any, timeout_s: float | None = None) -> Any:
    """A new gloo group over the ranks of ``group`` (``None``: every rank); each of them must create it at the same
    point. Chunk collectives get groups of their own ([Note: a gloo group per kind of collective])."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(ranks=ranks, timeout=timeout, backend="gloo", use_local_synchronization=ranks is not None)


Check = Callable[[], None] | None  # what a collective's wait must run first (None: checked already)
MAX_KEYS = 4  # process groups per chunk collective (each holds gloo's connections and worker threads)
BATCH_CAP = 4096  # "batch" checks at least this often (collectives), whatever else happens
EXPLAIN_S = 30.0  # "batch": how long a rank whose wait timed out waits for the others to say what they issued
MODES = ("each", "batch")


class Agreement:
    """Issues and checks the tags of one ``Collectives``; see [Note: agreeing without a barrier]."""

    def __init__(self, comm: RankGroup, *, lazy: bool, mode: str = "each") -> None:
        if mode not in MODES:
            raise ValueError(f"agreement mode {mode!r} is not allowed; it must be one of {MODES}")
        self.comm = comm
        self.lazy = lazy
        self.mode = mode
        self._issued: list[tuple[int, int, int]] = []  # "batch": (op, chunk, module) since the last check
        self._crc = 0  # "batch": a CRC of ``_issued``
        self.tag_group = comm.all_group  # tags go to every rank: replicas issue the same collectives as their shards
        self._groups: dict[tuple[str, str, int], Any] = {}  # (op, gloo operation, bytes) -> its group
        self._checked_every_time: dict[str, Any] = {}  # op -> the group of its keys past MAX_KEYS
        if lazy:
            self.tag_group = comm.gloo_group(over_all=True)
        self._open: collections.deque[_Tag] = collections.deque()  # issued, not yet compared
        self._seq = 0
        self.barriers = 0  # chunk collectives checked with a barrier (the tests count them)
        # "batch" on gloo: a group of its own for explaining a timed-out wait ([Note: explaining a stuck wait])
        self._explain_group = (
            comm.gloo_group(min(EXPLAIN_S, comm.timeout_s or EXPLAIN_S), over_all=True)
            if lazy and mode == "batch"
            else None
        )

    def before(self, op: str, chunk: int, module: int, kind: tuple[str, int]) -> tuple[Check, Any]:
        """Note the collective about to be issued (``"each"``: issue its tag). Returns the check its wait must run
        first (``None`` when it was checked here, with a barrier, or is checked later, ``"batch"``) and the group
        to issue it on. ``kind``: its gloo operation and size in bytes."""
        key = (op, *kind)
        if self.mode == "batch":  # [Note: checking once a micro-batch]
            self._note(op, chunk, module)
            known = key in self._groups or not self.lazy  # NCCL: one stream-ordered group, none to make
            if len(self._issued) >= BATCH_CAP or not known:
                self.barriers += not known
                self.verify_through()
            if known:
                return None, self._groups.get(key, self.comm.group)
        else:
            seq = self._issue(op, chunk, module)
            if key in self._groups:
                return (lambda: self.verify_through(seq)), self._groups[key]
            self.barriers += 1
            self.verify_through(seq)
        if not self.lazy:
            return None, self.comm.group
        # every rank is here (the barrier passed): make the key's group, or the one for keys past the cap
        if sum(k[0] == op for k in self._groups) < MAX_KEYS:
            self._groups[key] = self.comm.gloo_group()
            return None, self._groups[key]
        if op not in self._checked_every_time:
            self._checked_every_time[op] = self.comm.gloo_group()
        return None, self._checked_every_time[op]

    def _note(self, op: str, chunk: int, module: int) -> None:
        entry = (OPS.index(op), chunk, module)
        self._issued.append(entry)
        self._crc = zlib.crc32(struct.pack("<3q", *entry), self._crc)

    def _issue(self, op: str, chunk: int, module: int) -> int:
        comm = self.comm
        what = f"the agreement check before {op} of {comm.names(chunk, module)}"
        comm.refuse_if_broken(f"[rank {comm.all_rank}] {what}")
        out, work = comm.gather_ints([OPS.index(op), chunk, module], group=self.tag_group)
        self._seq += 1
        self._open.append(_Tag(self._seq, out, work, what))
        return self._seq

    def verify_through(self, seq: int | None = None) -> None:
        """Wait for and compare every open tag up to ``seq`` (all of them when ``None``); on a difference raise
        ``CollectiveMismatchError`` naming what each rank was about to do."""
        comm = self.comm
        if self.mode == "batch":
            self.verify_batch()
            return
        while self._open and (seq is None or self._open[0].seq <= seq):
            tag = self._open.popleft()
            comm.wait_for(tag.work, f"[rank {comm.all_rank}] {tag.what}")
            tags = tag.out.view(comm.all_size, 3).tolist()
            if any(t != tags[0] for t in tags):
                self._open.clear()
                lines = "; ".join(f"rank {r}: {OPS[t[0]]} of {comm.names(t[1], t[2])}" for r, t in enumerate(tags))
                self._disagree(f"on the next collective ({lines})")

    def verify_batch(self, value: int = 0, purpose: str = "") -> list[int]:
        """ "batch": compare the CRC of the collectives every rank issued since the last check; on a difference,
        gather the lists to name the first collective where they differ. A rank that issued none still takes part:
        the points that call this are the same on every rank, whatever each issued. ``value`` travels in the same
        fixed-size exchange (``Collectives.values_of_ranks``'s, named by ``purpose``); returns every rank's."""
        comm = self.comm
        issued, crc = self._issued, self._crc
        what = f"the agreement check of the {len(issued)} chunk collectives issued since the last one"
        what = f"{purpose} (riding on {what})" if purpose else what
        comm.refuse_if_broken(f"[rank {comm.all_rank}] {what}")
        out, work = comm.gather_ints([len(issued), crc, value], group=self.tag_group)
        comm.wait_for(work, f"[rank {comm.all_rank}] {what}")
        self._issued, self._crc = [], 0
        tags = out.view(comm.all_size, 3).tolist()
        if all(t[:2] == tags[0][:2] for t in tags):
            return [t[2] for t in tags]
        seqs = comm.all_gather_object_on(issued, self.tag_group)
        self._disagree(
            f"on a chunk collective ({self._first_difference(seqs, 'nothing more')})",
            " verify_collectives=True checks before each collective's result is used, to stop at the first.",
        )

    def _first_difference(self, seqs: list[Any], past_end: str) -> str:
        """Each rank's collective at the first position where the ranks' lists of issued ones differ."""
        i = first_difference(seqs)

        def at(r: int) -> str:
            if i >= len(seqs[r]):
                return past_end
            op, chunk, module = seqs[r][i]
            return f"{OPS[op]} of {self.comm.names(chunk, module)}"

        return "; ".join(f"rank {r}: {at(r)}" for r in range(len(seqs))) + f"; collective {i + 1} since the last check"

    def explain_stuck(self) -> str:
        """Why a wait timed out, when the ranks issued different chunk collectives; "" when that cannot be told.

        [Note: explaining a stuck wait]
        Checked once a micro-batch, ranks that issue different chunk collectives of different sizes wait on
        different groups, and neither wait ends before ``collective_timeout_s``; the check that would have named
        the difference never runs. So a rank whose wait timed out (with no rank gone or stopped) offers its list
        of what it issued since the last check on a group kept for this alone, with a bounded wait
        (``EXPLAIN_S``): the other ranks are stuck too, their own waits time out moments later, and they offer
        theirs, so each error names the first collective where the ranks differ, as the check would have. A rank
        that is not stuck in a chunk collective never offers: the exchange times out and the error says what it
        said before. Once a process: after a timeout the process is on its way out."""
        group, self._explain_group = self._explain_group, None
        if group is None:
            return ""
        seqs: list[Any] = [None] * self.comm.all_size
        try:
            dist.all_gather_object(seqs, list(self._issued), group=group)
        except Exception:  # noqa: BLE001 - a rank that never offers: nothing more to tell
            return ""
        if all(s == seqs[0] for s in seqs):
            return ""
        lines = self._first_difference(seqs, "nothing more (waiting at the next check)")
        return (
            f"the ranks issued different chunk collectives ({lines}): a "
            "module ran on some ranks and not on others (data-dependent control flow, or a module used outside "
            "its forward); every rank must run the same modules in the same order"
        )

    def _disagree(self, where: str, hint: str = "") -> NoReturn:
        comm = self.comm
        error = CollectiveMismatchError(
            f"[rank {comm.all_rank}] ranks disagree {where}. A module ran on some ranks and not on others "
            "(data-dependent control flow, or a module used outside its forward); every rank must run the same modules "
            f"in the same order.{hint}"
        )
        if self.lazy:  # collectives of the other kinds may stay unmatched: see the Note
            comm.mark_broken(str(error))
        raise error


def first_difference(seqs: Sequence[Sequence[Any]]) -> int:
    """Index of the first position where the sequences differ (or the shorter length)."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n
