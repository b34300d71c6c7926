"""How much the page cache could hold for this process, and so whether the disk tier's files can stay cached.

[Note: O_DIRECT where the page cache cannot hold the files]
Where memory can hold the disk tier's files, the page cache keeps them and every "disk" read and write is a memory
copy: buffered ``preadv``/``pwritev`` are the fastest there is. Where it cannot (the machine the disk tier is for),
buffered I/O pays twice: each read allocates page-cache pages the kernel must first reclaim, each write leaves
dirty pages that reclaim waits on, all charged to the process's memory cgroup. ``O_DIRECT`` moves the bytes between
the staging buffers and the disk with no page cache, and since the copies are the disk's DMA, several requests can
be in flight at little CPU cost: each staged transfer goes in ``DIRECT_PIECE`` pieces on a pool of
``DIRECT_REQUESTS`` threads (32 pieces of 1 MiB stepped the disk benchmark's GPT fastest in a 1 GiB cgroup; see
docs/benchmarks.md).

So ``disk_io="auto"`` goes past the page cache exactly where it could not hold the files: when the disk bytes
of the ranks on this host exceed what the page cache could use once their host limits are resident
(``page_cache_room``: ``MemAvailable``, bounded by every memory cgroup above the process, less the anonymous
memory each holds). It is decided when a layout is placed, from the memory free then. ``"direct"`` and
``"buffered"`` fix the choice. What ``O_DIRECT`` moves must be whole pages at page-aligned addresses: the files
are whole pages long and the staging and gradient buffers page-aligned (``aligned_empty``); a transfer whose
buffer is not (a gather's read into its payload) and a filesystem that refuses ``O_DIRECT`` go through the page
cache. The kernel keeps the two ways coherent: a direct read first writes back the range's dirty cached pages,
a direct write drops the range's cached pages, and the tier never has both in flight on one file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

DiskIO = Literal["auto", "direct", "buffered"]
IO_MODES: tuple[str, ...] = get_args(DiskIO)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_rooms(proc: Path, sys_cgroup: Path) -> list[int]:
    """For every memory cgroup limit above this process: the limit less the anonymous memory charged to it."""
    try:
        lines = (proc / "self/cgroup").read_text().splitlines()
    except OSError:
        return []
    rooms = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers, rel = parts[1].split(","), parts[2].lstrip("/")
        if "memory" in controllers:  # cgroup v1: the hierarchy's limit is in memory.stat
            stat = _stat(sys_cgroup / "memory" / rel / "memory.stat")
            limit = stat.get("hierarchical_memory_limit") or _read_int(
                sys_cgroup / "memory" / rel / "memory.limit_in_bytes"
            )
            if limit is not None and limit < 1 << 60:
                rooms.append(limit - stat.get("total_rss", stat.get("rss", 0)))
        elif parts[0] == "0" and parts[1] == "":  # cgroup v2: every ancestor's memory.max applies
            d = sys_cgroup / rel
            while True:
                limit = _read_int(d / "memory.max")  # "max" (no limit) reads as None
                if limit is not None:
                    rooms.append(limit - _stat(d / "memory.stat").get("anon", 0))
                if d == sys_cgroup or d.parent == d:
                    break
                d = d.parent
    return rooms


def page_cache_room(proc: Path = Path("/proc"), sys_cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the page cache could hold for this process now: ``MemAvailable``, bounded by its memory cgroups'
    limits less their anonymous memory; None where neither can be read (not Linux)."""
    rooms = [r for r in (_meminfo_available(proc), *_cgroup_rooms(proc, sys_cgroup)) if r is not None]
    return max(0, min(rooms)) if rooms else None


def files_stay_cached(disk_bytes: int, resident_bytes: int, room: int | None) -> bool:
    """Whether ``disk_bytes`` of files can stay in a page cache of ``room`` bytes once ``resident_bytes`` more of
    the process's own memory is in use (unknown room: assume they can, the kernel's default)."""
    return room is None or disk_bytes <= room - resident_bytes


def use_direct(mode: str, disk_bytes: int, resident_bytes: int, room: int | None) -> bool:
    """``disk_io``'s choice ([Note: O_DIRECT where the page cache cannot hold the files])."""
    if mode == "auto":
        return not files_stay_cached(disk_bytes, resident_bytes, room)
    return mode == "direct"
