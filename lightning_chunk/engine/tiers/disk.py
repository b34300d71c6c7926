"""The disk tier's files: a scratch directory per process, one preallocated, memory-mapped file per buffer.

[Note: the disk tier]
A chunk whose shard lives on the disk tier keeps its master, its gradient shard and its optimizer
state in files under ``disk_dir`` (its compute-dtype copy, when it has one, stays in host memory:
gathers read it twice a step, the optimizer state once). Each buffer is a file, preallocated with
``posix_fallocate`` (a full disk or a filesystem that cannot hold the state fails then, before
training, never as a SIGBUS in the middle of a step) and mapped ``MAP_SHARED``: the tensors the
optimizer, the gathers and the checkpoints use are views of the mapping, so every path that reads
or writes a shard works unchanged, and bit for bit as with the shard in memory.

The hot paths do not go through the mapping: every step's optimizer reads each disk shard into
one of two staging buffers with ``preadv`` and writes it back with ``pwritev`` on an I/O thread
while the chunk before steps ([Note: staged optimizer steps] in ``disk_staging.py``); backward's gradients
gather in a host buffer written to the file when a chunk's are all in; a gather on a CPU device
reads the master's file straight into the payload. Faulting pages in and out of the mapping had
cost more than the bytes themselves (page faults, and ext4's ``page_mkwrite`` for each written
4 KiB page): the disk chunks' optimizer steps of an 85M GPT took 0.40-0.58 s against 0.05 s in
memory. The other paths (clipping, checkpoints, repacks, the compute-dtype copy's write-back, a
gather to a CUDA device) use the mapping with the paging discipline of ``DiskStorage``:
- before a use the pages are faulted in (``MADV_POPULATE_READ``/``_WRITE``; the wait is counted in
  ``disk_wait_s``), on the I/O thread ahead of time where the next chunk is known;
- after it the mapping drops them (``MADV_DONTNEED``: for a shared file mapping the data stays in
  the file and the page cache). Dirty pages reach the disk through the kernel's own writeback, in
  the background: starting it at once (``sync_file_range``) made the next step's writes to the
  same pages wait for it (an 85M GPT's step took 3.3 s instead of 1.4-2.0 s).
The mapping and the read/write calls share the one page cache, so each sees what the other wrote
once the I/O thread's work is done (``DiskStorage.flush``, at the end of every optimizer step).
So a rank's resident set holds the chunks in use, not the disk tier. The files are scratch: the
directory is removed when the engine is torn down or the process exits, and a run removes what a
dead run on the same host left (``ScratchDir``). Checkpoints never point into it.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import shutil
import socket
import time
import uuid
import weakref
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import format_bytes
from ..errors import DiskTierError
from ..system.host_id import host_identity
from ..system.libc import libc

PREFIX = "lightning_chunk-scratch-"


_PAGE = mmap.PAGESIZE
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every transfer goes through the page cache
DIRECT_PIECE = 1 << 20  # an O_DIRECT transfer's pieces: one request each to the disk (max_sectors_kb is 1280 here)
_MADV_POPULATE_READ = 22  # Linux 5.14+; older kernels answer EINVAL and the pages fault in on first touch
_MADV_POPULATE_WRITE = 23


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(owner: dict) -> bool:
    if owner.get("machine") != host_identity():
        # another machine's run (a shared filesystem), or another pid namespace's (a container with this hostname):
        # its pid means nothing here, so it is not ours to judge ([Note: telling hosts apart] in host_id.py)
        return True
    pid = owner.get("pid")
    return isinstance(pid, int) and _start_time(pid) == owner.get("start")


class ScratchDir:
    """This process's directory under ``root``, removed at teardown or exit; dead runs' directories are removed."""

    def __init__(self, root: str | os.PathLike[str], rank: int) -> None:
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise DiskTierError(f"disk_dir={str(self.root)!r} is not a directory.")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DiskTierError(f"disk_dir={str(self.root)!r} cannot be created: {e.strerror}.") from None
        self.removed = self.clean_dead(self.root)
        self.path = self.root / f"{PREFIX}{socket.gethostname()}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
        try:
            self.path.mkdir()
            owner = {
                "host": socket.gethostname(),
                "machine": host_identity(),
                "pid": os.getpid(),
                "start": _start_time(os.getpid()),
                "rank": rank,
            }
            (self.path / "owner.json").write_text(json.dumps(owner))
        except OSError as e:
            shutil.rmtree(self.path, ignore_errors=True)
            raise DiskTierError(f"disk_dir={str(self.root)!r} is not writable: {e.strerror}.") from None
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    @staticmethod
    def clean_dead(root: Path) -> list[Path]:
        """Remove the scratch directories under ``root`` whose process (on this host) is gone."""
        removed = []
        for d in root.glob(PREFIX + "*"):
            try:
                owner = json.loads((d / "owner.json").read_text())
            except (OSError, ValueError):
                owner = {}
                if time.time() - d.stat().st_mtime < 60:
                    continue  # being created right now by another process
            if not _alive(owner):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed

    def remove(self) -> None:
        self._finalizer()

    @property
    def exists(self) -> bool:
        return self.path.exists()


def check_room(root: Path, nbytes: int, what: str, ranks: int = 1) -> None:
    """Refuse, before anything is written, a directory whose filesystem has fewer than ``nbytes`` free (what
    ``ranks`` ranks of this host need together)."""
    try:
        st = os.statvfs(root)
    except OSError as e:
        raise DiskTierError(f"disk_dir={str(root)!r}: {e.strerror}.") from None
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        who = f" (for the {ranks} ranks of this host, which share it)" if ranks > 1 else ""
        raise DiskTierError(
            f"the disk tier needs {format_bytes(nbytes)} in disk_dir={str(root)!r}{who} for {what}, but its "
            f"filesystem has {format_bytes(free)} free; free space, choose another disk_dir, or raise "
            "host_memory_limit so fewer shards go to disk."
        )


@dataclass(eq=False)
class MappedFile:
    """One preallocated file, mapped shared; tensors are views of the mapping."""

    path: Path
    nbytes: int
    mm: mmap.mmap = field(init=False, repr=False)

    def __post_init__(self) -> None:
        size = aligned(max(self.nbytes, 1))  # whole pages, so that O_DIRECT may move the file's last page too
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                os.unlink(self.path)
                if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise DiskTierError(
                        f"the disk tier could not reserve {size} bytes for {self.path.name} in "
                        f"{str(self.path.parent.parent)!r}: {e.strerror} (the filesystem cannot hold the shards that "
                        "go to disk; free space, choose another disk_dir or raise host_memory_limit)."
                    ) from None
                raise DiskTierError(f"the disk tier could not create {str(self.path)!r}: {e.strerror}.") from None
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def tensor(self, numel: int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=dtype, count=numel, offset=offset)

    def advise(self, advice: int) -> bool:
        try:
            self.mm.madvise(advice)
            return True
        except OSError:
            return False

    @property
    def base(self) -> int:
        """The address the file is mapped at (tensors viewing it point into ``[base, base + nbytes)``)."""
        if not hasattr(self, "_addr"):
            self._addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        return self._addr

    def advise_unlocked(self, advice: int) -> bool:
        """``advise`` through ctypes, which lets other Python threads run meanwhile (``mmap.madvise`` holds the
        GIL): what a read-ahead thread uses to fault the next chunk in while the main thread computes."""
        c = libc()
        if c is None:
            return self.advise(advice)
        return c.madvise(ctypes.c_void_p(self.base), ctypes.c_size_t(len(self.mm)), ctypes.c_int(advice)) == 0

    def will_need(self) -> None:
        """Ask the kernel to start reading the whole file into the page cache (``POSIX_FADV_WILLNEED``): it queues
        the reads and returns; a ``read_into`` after them copies from memory. Where the pages are cached it is a
        lookup; where the call is unsupported it does nothing."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.posix_fadvise(fd, 0, self.nbytes, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)

    def read_into(self, buf: torch.Tensor, *, direct: bool = False, pool: Executor | None = None) -> bool:
        """The file's bytes into ``buf`` (a contiguous uint8 host tensor of ``nbytes``), with ``preadv``: a copy
        from the page cache, without mapping a page (the GIL is released). ``direct``: past the page cache where
        ``buf`` allows it ([Note: O_DIRECT where the page cache cannot hold the files]), in pieces on ``pool``
        when one is given; returns whether it went past the page cache."""
        return self._io(buf, write=False, direct=direct, pool=pool)

    def write_from(self, buf: torch.Tensor, *, direct: bool = False, pool: Executor | None = None) -> bool:
        """``buf`` into the file with ``pwritev``; a mapping of the file sees it (one page cache; a ``direct``
        write drops the range's cached pages, so the mapping reads it from the file). ``direct`` and ``pool`` as
        in ``read_into``."""
        return self._io(buf, write=True, direct=direct, pool=pool)

    def direct_ok(self, buf: torch.Tensor) -> bool:
        """``buf`` can take an ``O_DIRECT`` transfer of the whole file: page-aligned, with room for its last page
        (the file is whole pages long; the bytes past ``nbytes`` are padding)."""
        storage = buf.untyped_storage()
        room = storage.nbytes() - (buf.data_ptr() - storage.data_ptr())
        return bool(_O_DIRECT) and buf.data_ptr() % _PAGE == 0 and room >= aligned(self.nbytes)

    def _io(self, buf: torch.Tensor, *, write: bool, direct: bool, pool: Executor | None) -> bool:
        # a view of the tensor's memory through ctypes: ``Tensor.numpy()`` would make the storage unresizable for
        # good, and a payload's storage is resized at every gather and release
        assert buf.is_contiguous() and buf.device.type == "cpu" and buf.numel() * buf.element_size() >= self.nbytes
        flags = os.O_RDWR if write else os.O_RDONLY
        fd = -1
        if direct and self.direct_ok(buf):
            try:
                fd = os.open(self.path, flags | _O_DIRECT)
            except OSError:  # a filesystem that refuses O_DIRECT (tmpfs on older kernels): through the page cache
                pass
        went_direct = fd >= 0
        total = aligned(self.nbytes) if went_direct else self.nbytes
        if not went_direct:
            fd = os.open(self.path, flags)
        view = memoryview((ctypes.c_char * total).from_address(buf.data_ptr())).cast("B")
        try:
            if went_direct and pool is not None and total > DIRECT_PIECE:
                works = [
                    pool.submit(self._move, fd, view, a, min(a + DIRECT_PIECE, total), write=write)
                    for a in range(0, total, DIRECT_PIECE)
                ]
                for w in works:  # every piece finishes before the descriptor closes, failed or not
                    w.exception()
                for w in works:
                    w.result()
            else:
                self._move(fd, view, 0, total, write=write)
        finally:
            os.close(fd)
        return went_direct

    def _move(self, fd: int, view: memoryview, start: int, end: int, *, write: bool) -> None:
        done = start
        while done < end:
            part = view[done:end]
            n = os.pwritev(fd, [part], done) if write else os.preadv(fd, [part], done)
            if n <= 0:
                raise DiskTierError(
                    f"the disk tier could not {'write' if write else 'read'} {str(self.path)!r} "
                    f"at byte {done} of {end - start} from {start}."
                )
            done += n

    def close(self) -> None:
        """Drop the pages and the file; the mapping itself goes with the last tensor that views it."""
        self.advise(mmap.MADV_DONTNEED)
        try:
            os.unlink(self.path)
        except OSError:
            pass


def aligned(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


def aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 host buffer of ``aligned(nbytes)`` bytes starting on a page boundary: what ``O_DIRECT`` moves."""
    raw = torch.empty(aligned(nbytes) + _PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % _PAGE
    return raw[skip : skip + aligned(nbytes)]


POPULATE_READ = _MADV_POPULATE_READ
POPULATE_WRITE = _MADV_POPULATE_WRITE
