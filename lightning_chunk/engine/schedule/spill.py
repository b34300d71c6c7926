"""Which host shards go to the disk tier under ``host_memory_limit`` ([Note: spilling to disk])."""

from __future__ import annotations

from collections.abc import Sequence

from ..chunks.chunk import Tier
from ..config import format_bytes
from ..errors import HostMemoryLimitError
from .placement import ChunkView


def disk_window_bytes(chunks: Sequence[ChunkView]) -> int:
    """Host bytes of disk shards paged in at once: the chunk being used and the one being read ahead."""
    return 2 * max((c.disk_bytes for c in chunks), default=0)


def spill_to_disk(
    chunks: Sequence[ChunkView],
    tiers: dict[int, Tier],
    host_limit: int | None,
    *,
    device_is_host: bool = False,
    chunk_numel_chosen: bool = True,
) -> dict[int, Tier]:
    """Move host-tier shards to the disk tier until the host holds at most ``host_limit`` bytes of them; with
    ``device_is_host`` (a CPU device, whose tier is host memory too) device-tier shards count and spill as well.
    ``chunk_numel_chosen``: the user set ``chunk_numel`` (a limit too small may then name it as a remedy).

    [Note: spilling to disk] Every disk shard costs the same per byte at the optimizer step (its
    master, gradient and optimizer state read and written once a step); an fp32 one also has its
    master read at every gather (there is no compute copy to keep in host memory). After the
    warm-up's repack, chunk ids follow first use, and the chunks used last in forward are the ones
    the host placement keeps resident across the turn into backward: each is gathered once a step,
    the others twice. So chunks spill in id order, which leaves the once-gathered ones in host
    memory. What stays on the host: the host-tier shards, the compute copies of disk shards, and
    a window of two disk shards in memory at once (the one in use and the one being read ahead).
    """
    if host_limit is None:
        return tiers
    out = dict(tiers)
    in_memory = {Tier.HOST, Tier.DEVICE} if device_is_host else {Tier.HOST}
    host = sorted((c for c in chunks if out[c.chunk_id] in in_memory), key=lambda c: c.chunk_id)
    used = sum(c.device_shard_bytes for c in host)
    spilled: list[ChunkView] = []
    for c in host:
        if used + disk_window_bytes(spilled) <= host_limit:
            break
        out[c.chunk_id] = Tier.DISK
        spilled.append(c)
        used -= c.device_shard_bytes - c.host_bytes_on_disk
    need = used + disk_window_bytes(spilled)
    if need > host_limit:
        raise HostMemoryLimitError(
            f"host_memory_limit={format_bytes(host_limit)} is too small: with every host shard's master, gradient and "
            f"optimizer state on the disk tier, the host still holds {used} bytes of shards (compute-dtype copies) "
            f"and pages in up to {disk_window_bytes(spilled)} bytes of disk shards at once. The smallest limit that "
            f"works is {format_bytes(need)}"
            + (
                "; or lower chunk_numel."
                if chunk_numel_chosen
                else "; chunk_numel=None already keeps two disk shards "
                "within half the limit where the model's largest parameter allows it."
            )
        )
    return out
