"""Placement policies: pure functions from chunk views and the trace to a plan.

A policy never touches a tensor and keeps no state between calls (Gemini's
``AutoPlacementPolicy`` moves data itself and carries hidden state; we do not).
It answers two questions and the manager carries the answers out:

1. ``shard_tiers``: which tier each chunk's shard (master, gradient, optimizer
   state) lives on. Asked before the warm-up step and again once its trace exists.
2. ``plan``: at a moment that needs some chunks, which resident payloads to evict
   and which to prefetch, given a budget of device bytes.

Eviction order: the payload whose next use (from the trace) is farthest goes
first (Belady's rule, which is optimal for a known sequence); without a trace,
the least recently used goes first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ..chunks.chunk import Tier
from ..config import ChunkConfig, format_bytes
from .tracer import BACKWARD, FORWARD, Trace


@dataclass(slots=True)
class ChunkView:
    """What a policy may know about a chunk: a value, never written once made (``dataclasses.replace`` for another).
    Not frozen: a plan under a limit reads a view of every resident chunk at every moment, and a frozen dataclass's
    ``__init__`` (``object.__setattr__`` a field) took 1.1 us of a view's 1.7; with slots 0.2 (a view 0.8)."""

    chunk_id: int
    payload_bytes: int
    device_shard_bytes: int  # bytes its shard would hold on the device tier (payload included when aliased)
    resident: bool
    evictable: bool
    shard_tier: Tier
    last_used: int = -1
    grad_payload_bytes: int = 0  # several ranks: the whole-chunk gradient buffer backward needs on the device
    disk_bytes: int = 0  # bytes of its shard that go to files on the disk tier (all but a compute-dtype copy)

    @property
    def host_bytes_on_disk(self) -> int:
        """Bytes its shard keeps in host memory when it lives on the disk tier (its compute-dtype copy)."""
        return max(self.device_shard_bytes - self.disk_bytes, 0) if self.disk_bytes else self.device_shard_bytes


@dataclass(frozen=True)
class Plan:
    evict: tuple[int, ...] = ()
    prefetch: tuple[int, ...] = ()
    for_room: bool = False  # some of ``evict`` went for memory: payloads the plan would otherwise have kept


def working_set_bytes(chunks: Sequence[ChunkView], trace: Trace, held: Iterable[int] = ()) -> int:
    """The most payload bytes any one moment of the trace needs at once: its module's chunks, the root module's
    (in use through the whole step), and at an activation recomputation's moment those the backward it runs inside
    keeps in use. ``held``: chunks whose payload a device shard already holds (``device_shards``)."""
    held = set(held)
    size = {c.chunk_id: 0 if c.chunk_id in held else c.payload_bytes for c in chunks}
    root = trace.root_chunks
    return max(
        (
            sum(size.get(i, 0) for i in {*m.chunk_ids, *m.pinned_chunks, *root})
            for m in trace.moments
            if m.kind in (FORWARD, BACKWARD)
        ),
        default=max(size.values(), default=0),
    )


def smallest_working_limit(
    chunks: Sequence[ChunkView], trace: Trace | None, held: Iterable[int] = ()
) -> tuple[int, int]:
    """(largest working set of payload bytes, traced non-model peak): with the device shards (``device_shards``),
    their sum is the smallest limit that works."""
    grads = max((c.grad_payload_bytes for c in chunks), default=0)
    if trace is None:
        return max((c.payload_bytes for c in chunks), default=0) + grads, 0
    return working_set_bytes(chunks, trace, held) + grads, trace.nonmodel_peak_bytes


def device_shards(chunks: Sequence[ChunkView], tiers: dict[int, Tier], world_size: int) -> tuple[int, frozenset[int]]:
    """Bytes of the shards ``tiers`` keeps on the device, and the chunks whose payload they hold: on one rank a
    device shard *is* its payload (aliased), on several each payload is gathered beside the shards.

    [Note: the shards a placement keeps on the device]
    ``static`` and ``device`` keep shards on the device whatever the limit; ``auto`` keeps them only in the room
    the working set and the activations leave. Every limit check counts them beside the payloads a moment needs:
    once they were counted only against one host payload, so ``static`` on two ranks under 1.3x the parameter
    bytes passed set-up and stopped in the sanity check's first forward (naming a smallest limit below the one
    given), and the check after the warm-up passed a limit that held the working set and the activations but not
    the shards beside them."""
    on = [c for c in chunks if tiers[c.chunk_id] is Tier.DEVICE]
    return sum(c.device_shard_bytes for c in on), frozenset(c.chunk_id for c in on) if world_size == 1 else frozenset()


def shards_note(placement: str, shard_bytes: int, tiers: Iterable[Tier]) -> tuple[str, str]:
    """(the shards on the device as a limit error names them, the remedy), for chunks on ``tiers``; empty where no
    shard stays there, and no remedy under ``auto``, which keeps only those that fit."""
    tiers = list(tiers)
    if not shard_bytes:
        return "", ""
    count = sum(t is Tier.DEVICE for t in tiers)
    return (
        f"{format_bytes(shard_bytes)} of shards placement={placement!r} keeps on the device ({count} of "
        f"{len(tiers)} chunks)",
        "raise offload_fraction (static) or use placement='auto' or 'host'" if placement != "auto" else "",
    )


class PlacementPolicy:
    """Base policy: shards where ``shard_tiers`` says, payloads kept until room is needed."""

    name = "base"
    evict_after_use = False

    @property
    def keeps_for_backward(self) -> bool:  # only a policy that releases after use has anything to keep for backward
        return False

    def __init__(self, config: ChunkConfig) -> None:
        self.config = config
        self.beside_backward = False  # host chunks step beside backward ([Note: which chunks the host gets])

    # --------------------------------------------------------------- tiers
    def shard_tiers(self, chunks: Sequence[ChunkView], trace: Trace | None, limit: int | None) -> dict[int, Tier]:
        raise NotImplementedError

    # -------------------------------------------------------------- budget
    def budget(self, limit: int | None, trace: Trace | None, position: int) -> int | None:
        """Device bytes chunks may use at ``position``: the hard limit (the manager enforces it anyway)."""
        return limit

    def pool_room(self, limit: int | None, trace: Trace | None, position: int, device_bytes: int) -> int | None:
        """Bytes the payload pool may keep at ``position`` beside ``device_bytes`` of chunks; ``None``: no bound.

        [Note: the pool under a limit]
        On a CPU device released payload blocks stay in a pool for the next gather of their size ([Note: a pool of
        payload blocks] in pool.py): device memory the ledger does not count. The pool never holds more than the
        most payload bytes alive at once less those alive now, so pool and payloads together stay at the step's
        payload peak. That peak is reached where activations are few (in backward), and it stayed through the next
        forward while the activations grew beside it, past the limit (the disk benchmark's GPT went 30 MiB over a
        160 MiB limit). So under a limit the pool keeps at most what the limit, less the chunks and the activations
        the trace saw at this moment and the next (``activation_room``), leaves; the hooks trim it at every moment.
        Without a limit only the payload peak bounds it. The price is a fresh block where a kept one would have
        served, with no run-time change the README's job could show."""
        room = activation_room(limit, trace, position)
        return None if room is None else max(room - device_bytes, 0)

    # ---------------------------------------------------------------- plan
    def upcoming(self, position: int, trace: Trace | None) -> frozenset[int]:
        """The chunks ``plan`` may prefetch at ``position``, when prefetching: those of the trace's next moment that
        uses any, and the first chunk used after them.

        [Note: how far ahead to gather]
        A prefetch issued one moment ahead overlaps its gather with one module's compute: where a chunk holds a
        transformer block, the next block's gather started at the block's last module (its MLP's output
        projection) and the step then waited for most of it at the next block's first (a quarter of a
        host-placement step on two gloo ranks). So the window reaches one chunk past the next moment's: the next
        chunk's gather starts where the current chunk's stretch of use begins (FSDP2 prefetches one module
        ahead, and its module is a block; DeepSpeed prefetches by a bucket of 5e7 elements), which holds at most
        one more payload at a time. Under a limit the plan prefetches only into room (nearest use first), so the
        deeper window never evicts anything; the one prefetch ``AutoPlacement`` reserves room for covers it.
        Releasing after use keeps what the window holds, so the chunk used before the last in forward now stays
        through the turn into backward instead of being released and gathered again a moment later.
        On gloo the gathers' bytes cost the cores the compute runs on, so what the earlier start buys is the time
        the main thread sat idle waiting, not the transfer (`9990e32`: 0.89x the step with everything resident,
        0.945x with host placement, on two gloo ranks).
        A disk-tier chunk is gathered ahead one moment only, as before: on a CPU device its gather reads or copies
        its master on the calling thread, so starting it earlier overlaps nothing, and the two staging sets of a
        backward that steps disk chunks ([Note: staging at the backward gather] in ``disk_staging.py``) are timed
        to that gather: gathered a chunk earlier, it found both sets still held and read the file again."""
        return (
            frozenset(trace.prefetch_window(position)) if (trace is not None and self.config.prefetch) else frozenset()
        )

    def idle(self, *, all_resident: bool, budget_bytes: int | None, device_bytes: int) -> bool:
        """Whether ``plan`` would return an empty plan, known without a single view: nothing is released after
        use, the needed and upcoming chunks are all resident (``all_resident``: nothing to gather or prefetch),
        and the device is within its budget (nothing to evict). The hooks ask this first at every moment: with
        a limit, most moments find their chunks resident, and building views to learn that was most of the
        hooks' time on a Hugging Face model ([Note: the views a plan reads])."""
        return not self.evict_after_use and all_resident and (budget_bytes is None or device_bytes <= budget_bytes)

    def plan(
        self,
        *,
        position: int,
        needed: frozenset[int],
        chunks: Sequence[ChunkView],
        trace: Trace | None,
        budget_bytes: int | None,
        device_bytes: int,
    ) -> Plan:
        """What to evict and prefetch at ``position``.

        [Note: the views a plan reads]
        A plan reads the resident chunks (to evict, or keep), the ``needed`` ones and the ``upcoming`` ones
        (to gather); a chunk that is none of these cannot appear in it. So the hooks hand it only those
        (``ChunkManager.views(include=...)``): building a view of every chunk at every module was 5% of a
        2-rank host step on a 44-chunk model, where a handful are resident at a time."""
        by_id = {c.chunk_id: c for c in chunks}
        upcoming = self.upcoming(position, trace)
        evict: list[int] = []
        extra: frozenset[int] = frozenset()  # kept for backward beyond what releasing after use keeps
        if self.evict_after_use:
            # [Note: releasing after use] Releasing every payload the next moment does not
            # need re-gathers chunks that come back a moment later: a chunk of one param group's
            # small tensors (norms, biases) is used by every block, between the blocks' weight
            # chunks, and was all-gathered again at almost every module (2.2x the gathered bytes
            # of one gather per use on a two-group GPT). So a payload stays while it is used
            # again before the next gather of a chunk that is not resident: that costs no memory
            # beyond what the step holds until then, and it is gathered once per stretch of use.
            keep = upcoming
            if trace is not None:
                resident = frozenset(c.chunk_id for c in chunks if c.resident) | needed
                keep = keep | trace.reused_before_gather(position, resident)
                if self.keeps_for_backward:  # [Note: keeping payloads for backward]
                    extra = frozenset(i for i in resident if trace.used_later(i, position)) - keep
                    keep = keep | extra
            evict = [c.chunk_id for c in chunks if c.evictable and c.chunk_id not in needed and c.chunk_id not in keep]
        freed = sum(by_id[i].payload_bytes for i in evict)
        missing = sum(by_id[i].payload_bytes for i in needed if not by_id[i].resident)

        for_room = False

        def evict_down_to(bound: int | None, victims: Iterable[ChunkView]) -> None:
            """Evict ``victims``, farthest next use first, until the device holds at most ``bound``."""
            nonlocal freed, for_room
            if bound is None or device_bytes - freed + missing <= bound:
                return
            for c in sorted(victims, key=lambda c: self._eviction_rank(c, position, trace), reverse=True):
                if device_bytes - freed + missing <= bound:
                    break
                evict.append(c.chunk_id)
                freed += c.payload_bytes
                for_room = True

        if extra:  # kept beyond what releasing after use keeps: only while the traced activations have room beside
            # them, and never at the cost of a payload that releasing would have kept
            evict_down_to(
                activation_room(budget_bytes, trace, position),
                [by_id[i] for i in extra if by_id[i].evictable and i not in needed],
            )
        evict_down_to(
            budget_bytes, [c for c in chunks if c.evictable and c.chunk_id not in needed and c.chunk_id not in evict]
        )
        prefetch: list[int] = []
        room = math.inf if budget_bytes is None else budget_bytes - (device_bytes - freed + missing)
        assert trace is not None or not upcoming, "a prefetch window comes from a trace"
        for i in sorted(upcoming, key=lambda i: (trace.next_use(i, position), i)):  # type: ignore[union-attr]
            c = by_id.get(i)
            if c is None or c.resident or i in needed or i in evict:
                continue
            if c.shard_tier is Tier.DISK and i not in trace.next_chunks(position):  # type: ignore[union-attr]  # [Note: how far ahead to gather]
                continue
            if c.payload_bytes <= room:
                prefetch.append(i)
                room -= c.payload_bytes
        return Plan(evict=tuple(evict), prefetch=tuple(prefetch), for_room=for_room)

    @staticmethod
    def _eviction_rank(c: ChunkView, position: int, trace: Trace | None) -> tuple[float, int]:
        """Larger means evict first: farthest next use, then least recently used."""
        if trace is not None:
            return (trace.next_use(c.chunk_id, position), -c.last_used)
        return (0.0, -c.last_used)


class DevicePlacement(PlacementPolicy):
    """Everything resident: every shard on the device."""

    name = "device"

    def shard_tiers(self, chunks, trace, limit):
        return {c.chunk_id: Tier.DEVICE for c in chunks}


def activation_room(limit: int | None, trace: Trace | None, position: int) -> int | None:
    """The limit less the activations the trace saw at ``position`` and at the next moment: a plan's payloads stay
    until the next moment plans again, while the module that runs in between adds its outputs (on a CPU device
    nothing else charges them to this moment; see [Note: peaks between moments] for CUDA)."""
    if limit is None or trace is None:
        return limit
    return max(limit - max(trace.nonmodel_at(position), trace.nonmodel_at(position + 1)), 0)


def untraced_budget(limit: int, known: Trace | None) -> int:
    """The device bytes chunks may keep in a step no trace describes: an evaluation step, the warm-up, a micro-batch
    traced again after its inputs grew.

    [Note: steps without a trace]
    A traced training step keeps chunks only where the activations the trace saw at that moment have room beside
    them. A step without a trace once had the whole limit for chunks: in every validation step, in the warm-up and
    in a re-traced micro-batch the payloads kept or prefetched filled the limit (8 of 8 MiB on one rank), and the
    activations got only the margin left below the device's memory (on CUDA, 10% of the free memory): an
    out-of-memory error waiting for a large validation batch. So such a step keeps what the training trace's
    activation peak leaves (an evaluation forward saves no activations, but its largest transient, the logits, is
    the training step's too), and where no trace exists yet (the warm-up) as little as it needs: each module's
    chunks while it runs, gathered again when used again."""
    return max(limit - known.nonmodel_peak_bytes, 0) if known is not None else 0


class HostPlacement(PlacementPolicy):
    """Every shard on the host; payloads fetched on use, kept until their last use in the step while the
    budget has room, and released after use otherwise (with ``reshard_after_forward=True``: always).

    [Note: keeping payloads for backward]
    Released after use, a payload is all-gathered twice a step: for forward and again for backward
    (FSDP2's ``reshard_after_forward=True``). On a transport whose gathers cost the cores compute
    runs on (gloo) the second gather is most of what host placement pays over everything resident
    (docs/benchmarks.md). So where there is a budget a payload stays from its forward use until its
    last use in the step, read from the trace, and each chunk is gathered once a step. What is kept
    beyond what releasing after use would keep stays only while the activations the trace saw at this
    moment and the next have room beside it (``activation_room``); when not, the kept payload whose
    next use is farthest goes first. Keeping never evicts a payload that releasing would have kept
    (with the budget itself reduced by the activations, a tight limit evicted chunks reused a moment
    later; a 2-rank case in the suite holds the kept run to no more gathers than its released twin).
    Under a tight limit this is FSDP2's policy; with room, DeepSpeed ZeRO-3's default
    (``stage3_max_reuse_distance``), bounded by memory rather than by a count. Without a trace (the
    warm-up, evaluation) payloads are released after use.
    On a CPU device ``reshard_after_forward=True`` is the default (``resolve_reshard_after_forward``):
    - without a limit nothing bounds what keeping holds, and the kept payloads are one more copy of the
      model in the memory the sharding exists to save;
    - under a limit keeping fills the budget to the brim, and on a CPU device the budget does not see
      everything the step holds: the trace counts the tensors autograd saved, not backward's gradients
      nor the heap a step grows (CUDA's trace reads the allocator, which sees them all). Kept by default
      under a limit (``1b2d4c2``), the disk benchmark's GPT peaked 100 MiB over its limits, no faster.
    On an accelerator the budget is known and seen whole, and keeping uses memory that would otherwise
    stay idle: there it is the default.
    """

    name = "host"
    evict_after_use = True

    @property
    def keeps_for_backward(self) -> bool:
        return self.config.reshard_after_forward is not True

    def shard_tiers(self, chunks, trace, limit):
        return {c.chunk_id: Tier.HOST for c in chunks}


class StaticPlacement(PlacementPolicy):
    """The first ``offload_fraction`` of the chunks (in use order) on the host, the rest on the device.

    The last chunks stay on the device: they are used twice in quick succession where
    forward turns into backward, so they gain the most from staying.
    """

    name = "static"

    def shard_tiers(self, chunks, trace, limit):
        n_host = math.ceil(self.config.offload_fraction * len(chunks))
        ids = sorted(c.chunk_id for c in chunks)
        return {cid: (Tier.HOST if k < n_host else Tier.DEVICE) for k, cid in enumerate(ids)}


class AutoPlacement(PlacementPolicy):
    """From the trace: as many shards on the device as the limit minus the traced non-model peak allows."""

    name = "auto"

    def budget(self, limit, trace, position):
        return activation_room(limit, trace, position)

    def shard_tiers(self, chunks, trace, limit):
        if limit is None:
            return {c.chunk_id: Tier.DEVICE for c in chunks}
        if trace is None:  # warm-up: the smallest footprint until we know the activations
            return {c.chunk_id: Tier.HOST for c in chunks}
        reserve = working_set_bytes(chunks, trace) + (
            max((c.payload_bytes for c in chunks), default=0) if self.config.prefetch else 0
        )
        reserve += 3 * max((c.grad_payload_bytes for c in chunks), default=0)  # one filling, two reducing
        room = limit - trace.nonmodel_peak_bytes - reserve
        tiers = {c.chunk_id: Tier.HOST for c in chunks}
        for c in device_first(chunks, beside_backward=self.beside_backward):
            if c.device_shard_bytes <= room:
                tiers[c.chunk_id] = Tier.DEVICE
                room -= c.device_shard_bytes
        return tiers


V = TypeVar("V", bound=ChunkView)


def device_first(views: Sequence[V], *, beside_backward: bool) -> list[V]:
    """The order in which ``auto`` gives shards the device's room, the rest staying on the host.

    [Note: which chunks the host gets]
    Chunk ids follow first use. Stepping after backward, the last chunks go to the device first: they are used twice
    in quick succession where forward turns into backward, so they gain the most from staying (PatrickStar's
    reasoning). Stepping beside backward on a worker ([Note: the host Adam beside backward]) the first chunks do: a
    host chunk's step can overlap backward only where backward finishes its gradients early, and backward finishes
    the last chunks' first. With the first chunks on the host (the embedding, the first blocks), their gradients were
    final only as backward ended, so every host step ran after it: on an H200 the 1.0B GPT's 0.112 s of host Adam
    stood between backward and the next forward, which needed those very chunks first (2026-12-04). With the last
    chunks on the host their steps run beside the rest of backward, and the next forward reaches them last, after
    their updated compute copies had the first chunks' compute to arrive in."""
    return sorted(views, key=lambda v: v.chunk_id, reverse=not beside_backward)


POLICIES: dict[str, type[PlacementPolicy]] = {
    "device": DevicePlacement,
    "host": HostPlacement,
    "static": StaticPlacement,
    "auto": AutoPlacement,
}


def make_policy(config: ChunkConfig, *, beside_backward: bool = False) -> PlacementPolicy:
    """``beside_backward``: host chunks step on a worker beside backward ([Note: which chunks the host gets])."""
    policy = POLICIES[config.placement](config)
    policy.beside_backward = beside_backward
    return policy
