"""Replay a trace through a placement policy with simulated residency: an estimate, not a measurement.

``plan`` uses it to say before training how much chunk memory a step needs on the device. It runs
the same pure ``PlacementPolicy.plan`` the hooks run, over the trace's moments, with the chunks of
the moment in use (never evicted) and every other resident payload evictable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..chunks.chunk import Tier
from .placement import ChunkView, PlacementPolicy
from .tracer import POST_FORWARD, Trace


def simulate_step(
    policy: PlacementPolicy, views: Sequence[ChunkView], trace: Trace, limit: int | None, world_size: int = 1
) -> tuple[int, int]:
    """Over one step of ``trace``: the peak of chunk bytes on the device tier, and the peak of chunk bytes
    plus the non-model bytes traced at the same moment (the two peaks rarely coincide: placement evicts
    where activations peak)."""
    aliased = {v.chunk_id for v in views if v.shard_tier is Tier.DEVICE and world_size == 1}
    shards = sum(v.device_shard_bytes for v in views if v.shard_tier is Tier.DEVICE)
    size = {v.chunk_id: v.payload_bytes for v in views}
    resident: set[int] = set(aliased)
    last_used: dict[int, int] = {}
    peak = device = shards
    peak_total = shards
    for position, m in enumerate(trace.moments):
        needed = frozenset() if m.kind == POST_FORWARD else frozenset(m.chunk_ids)
        if m.kind == POST_FORWARD and not policy.evict_after_use:
            continue
        now = [
            dataclasses.replace(
                v,
                resident=v.chunk_id in resident,
                evictable=v.chunk_id in resident and v.chunk_id not in aliased and v.chunk_id not in needed,
                last_used=last_used.get(v.chunk_id, -1),
            )
            for v in views
        ]
        plan = policy.plan(
            position=position,
            needed=needed,
            chunks=now,
            trace=trace,
            budget_bytes=policy.budget(limit, trace, position),
            device_bytes=device,
        )
        for c in plan.evict:
            resident.discard(c)
            device -= size[c]
        for c in list(needed) + list(plan.prefetch):
            if c not in resident:
                resident.add(c)
                device += size[c]
        for c in needed:
            last_used[c] = position
        peak = max(peak, device)
        peak_total = max(peak_total, device + m.nonmodel_bytes)
    return peak, peak_total
