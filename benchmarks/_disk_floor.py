"""The disk's own speed for benchmarks/disk.py: a plain loop of 64 MiB os.pwrite/os.preadv calls through one file
(buffered or O_DIRECT), and a memory cgroup that caps a child's resident set and page cache together."""

from __future__ import annotations

import os
import time
from pathlib import Path

BLOCK = 64 << 20


def disk_floor(directory: Path, read_bytes: int, write_bytes: int, *, direct: bool = False) -> float:
    """Seconds a plain loop takes to write ``write_bytes`` then read ``read_bytes`` through one file in
    ``directory``, 64 MiB a call (the file is as large as the larger of the two; reads wrap around). ``direct``:
    with ``O_DIRECT`` from a page-aligned buffer, so every byte goes to and comes from the disk itself (the
    floor of a machine whose page cache cannot hold the files)."""
    import mmap

    size = -(-max(read_bytes, write_bytes, BLOCK) // BLOCK) * BLOCK
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT needs
    buf.write(b"\x01" * BLOCK)
    path = directory / "floor.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o600)
    align = 4096 if direct else 1
    try:
        os.posix_fallocate(fd, 0, size)
        t0 = time.perf_counter()
        for total, io in ((write_bytes, "write"), (read_bytes, "read")):
            done = 0
            while done < total:
                n = -(-min(BLOCK, total - done) // align) * align
                part = memoryview(buf)[:n]
                os.pwrite(fd, part, done % size) if io == "write" else os.preadv(fd, [part], done % size)
                done += n
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)


def floors(directory: Path, read_bytes: int, write_bytes: int, *, with_direct: bool = True) -> dict:
    """The floor 5 times, each after ``os.sync()``, then (``with_direct``) 5 times with ``O_DIRECT`` where the
    filesystem allows it."""
    out: dict = {}
    for key, direct in (("", False), ("direct_", True))[: 2 if with_direct else 1]:
        runs = []
        try:
            for _ in range(5):
                os.sync()
                runs.append(disk_floor(directory, read_bytes, write_bytes, direct=direct))
        except OSError as e:
            out[f"{key}skipped"] = f"{e.strerror} ({'O_DIRECT' if direct else 'buffered'} I/O in {directory})"
            continue
        out[f"{key}seconds"], out[f"{key}all"] = sorted(runs)[2], runs
    return out


class MemoryCgroup:
    """A fresh memory cgroup below this process's own (cgroup v1 or v2), capping a child's resident set and page
    cache together; ``why_not`` says why one cannot be made here."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit, self.path, self.why_not, self.v1 = limit, None, None, False
        try:
            self.path = self._make(name)
        except OSError as e:
            self.why_not = f"no memory cgroup could be made here ({e.strerror}: {e.filename})"
        except (StopIteration, IndexError):
            self.why_not = "no memory cgroup could be made here (/proc/self/cgroup names no memory controller)"

    def _make(self, name: str) -> Path:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        v1 = [ln.split(":", 2)[2] for ln in lines if ln.split(":", 2)[1].split(",").count("memory")]
        if v1:
            self.v1 = True
            base, limit_file = Path("/sys/fs/cgroup/memory") / v1[0].lstrip("/"), "memory.limit_in_bytes"
        else:
            own = next(ln.split(":", 2)[2] for ln in lines if ln.startswith("0::"))
            base, limit_file = Path("/sys/fs/cgroup") / own.lstrip("/"), "memory.max"
        path = base / f"lightning_chunk-bench-{name}-{os.getpid()}"
        path.mkdir()
        try:
            (path / limit_file).write_text(str(self.limit))
        except OSError:
            path.rmdir()
            raise
        return path

    def enter(self) -> None:  # in the child, before it runs anything
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        f = "memory.max_usage_in_bytes" if self.v1 else "memory.peak"
        try:
            return int((self.path / f).read_text())
        except (OSError, ValueError):
            return 0

    def remove(self) -> None:
        if self.path is not None:
            try:
                self.path.rmdir()
            except OSError:
                pass
