"""Tier storage: where a chunk's shard buffers live, one object per tier.

Each object allocates a chunk's shard buffers (``alloc``), keeps the optimizer state the
optimizer creates next to them (``keep_state``), says when a chunk is about to be used
(``prefetch``) and brackets each use (``reading`` / ``writing``), and frees a chunk's
buffers (``free``). Device and host memory need nothing around a use; the disk tier pages
the chunk's files in and out there ([Note: the disk tier] in ``disk.py``).

The manager decides which tier a chunk lives on and keeps the ledger; these objects only
hold bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator, Optional

import torch

from .chunk import Chunk, Tier
from .disk import POPULATE_READ, POPULATE_WRITE, MappedFile, ScratchDir, check_room
from .errors import DiskTierError

_HOST = torch.device("cpu")
ROLES = ("master", "grad", "optim")  # the buffers of a disk shard that live in files


class TierStorage:
    tier: Tier

    def alloc(self, chunk: Chunk, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def reserve_state(self, chunk: Chunk, nbytes: int) -> None:
        """Optimizer state of ``nbytes`` will be kept next to the chunk's master (the optimizer creates it)."""

    def keep_state(self, chunk: Chunk, view: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """Where the optimizer's per-element state ``value`` of the master view ``view`` is kept: itself, here."""
        return value

    def state_region(self, chunk: Chunk, key: str) -> Optional[torch.Tensor]:
        """Per-element state ``key`` of the whole shard where this tier keeps it laid out like the master shard
        (zeros where a parameter has none), so a checkpoint can write it without a copy; else ``None``."""
        return None

    def page_out(self) -> None:
        """Drop every page of this tier from the process (after a pass over all of it, such as a checkpoint)."""

    def prefetch(self, chunk: Chunk, roles: tuple[str, ...] = ROLES) -> None:
        """The chunk's ``roles`` buffers will be used soon."""

    @contextlib.contextmanager
    def reading(self, chunk: Chunk, roles: tuple[str, ...] = ROLES) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def writing(self, chunk: Chunk, roles: tuple[str, ...] = ROLES) -> Iterator[None]:
        yield

    def hold(self, chunk: Chunk, roles: tuple[str, ...]) -> None:
        """Keep the chunk's ``roles`` buffers in memory for writing until ``let_go`` (a stretch of uses, such as the
        gradients of one chunk arriving parameter by parameter)."""

    def let_go(self, chunk: Chunk) -> None:
        """End what ``hold`` began."""

    def free(self, chunk: Chunk) -> None:
        """The chunk's buffers are no longer used (the manager frees what it allocated)."""

    def close(self) -> None:
        """End of the run."""


class DeviceStorage(TierStorage):
    tier = Tier.DEVICE

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc(self, chunk: Chunk, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)


class HostStorage(TierStorage):
    tier = Tier.HOST

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned

    def alloc(self, chunk: Chunk, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=_HOST, pin_memory=self.pinned)


class DiskStorage(TierStorage):
    """Masters, gradient shards and optimizer state in files; compute-dtype copies in host memory."""

    tier = Tier.DISK

    def __init__(self, root: Optional[str], rank: int, host: HostStorage) -> None:
        self.root = None if root is None else Path(root)
        self.rank = rank
        self.host = host
        self._dir: Optional[ScratchDir] = None
        self._files: dict[int, dict[str, MappedFile]] = {}  # id(chunk) -> role -> file
        self._state_at: dict[int, dict[str, int]] = {}  # id(chunk) -> optimizer state key -> byte offset in its file
        self._used: dict[int, int] = {}  # id(chunk) -> bytes of its optimizer-state file given to keys
        self._state_dtype: dict[tuple[int, str], torch.dtype] = {}
        self._depth: dict[tuple[int, str], int] = {}  # nested uses page in and out once
        self._held: dict[int, contextlib.ExitStack] = {}  # id(chunk) -> a use ``hold`` began
        self._reader: Optional[ThreadPoolExecutor] = None  # the read-ahead thread
        self._ahead: dict[int, tuple[bool, Future]] = {}  # id(file) -> (writable, its read-ahead)
        self._serial = 0
        self.read_bytes = 0  # paged in from the files (page-cache hits included)
        self.write_bytes = 0  # written back to the files
        self.wait_s = 0.0  # time spent waiting for pages to come in

    # ------------------------------------------------------------ directory
    @property
    def directory(self) -> ScratchDir:
        if self._dir is None:
            if self.root is None:
                raise DiskTierError("shards must go to the disk tier but no disk_dir is set; pass disk_dir=PATH "
                                    "(a directory on a fast local disk) or raise host_memory_limit.")
            self._dir = ScratchDir(self.root, self.rank)
        return self._dir

    def check_room(self, nbytes: int, what: str) -> None:
        """Before a layout is built: its disk bytes must fit on the directory's filesystem."""
        if nbytes > 0:
            check_room(self.directory.root, nbytes + self.bytes_held(), what)

    def bytes_held(self) -> int:
        return sum(f.nbytes for files in self._files.values() for f in files.values())

    # ----------------------------------------------------------------- bytes
    def _file(self, chunk: Chunk, role: str, nbytes: int) -> MappedFile:
        self._serial += 1
        f = MappedFile(self.directory.path / f"chunk{chunk.chunk_id}-{self._serial}-{role}.bin", nbytes)
        self._files.setdefault(id(chunk), {})[role] = f
        return f

    def alloc(self, chunk: Chunk, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if role not in ROLES:  # the compute-dtype copy: read by every gather, it stays in host memory
            return self.host.alloc(chunk, role, numel, dtype)
        return self._file(chunk, role, numel * torch.empty((), dtype=dtype).element_size()).tensor(numel, dtype)

    def reserve_state(self, chunk: Chunk, nbytes: int) -> None:
        files = self._files.setdefault(id(chunk), {})
        nbytes = nbytes + 256 if nbytes else 0  # each key's region starts 16-byte aligned
        if "optim" in files and files["optim"].nbytes == nbytes:
            return
        if "optim" in files:
            files.pop("optim").close()
        self._state_at.pop(id(chunk), None)
        self._used.pop(id(chunk), None)
        if nbytes:
            self._file(chunk, "optim", nbytes)

    def keep_state(self, chunk: Chunk, view: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        f = self._files.get(id(chunk), {}).get("optim")
        if f is None or not torch.is_tensor(value) or value.dim() == 0 or value.numel() != view.numel():
            return value
        assert chunk.master is not None
        at = self._state_at.setdefault(id(chunk), {})
        esz = value.element_size()
        if key not in at:
            base = -(-self._used.get(id(chunk), 0) // 16) * 16
            if base + chunk.shard_numel * esz > f.nbytes:
                raise DiskTierError(
                    f"chunk {chunk.chunk_id}'s optimizer state {key!r} ({value.dtype}) does not fit the "
                    f"{f.nbytes} bytes reserved for it on the disk tier: the optimizer keeps more state than its "
                    "probe step showed.")
            at[key] = base
            self._state_dtype[(id(chunk), key)] = value.dtype
            self._used[id(chunk)] = base + chunk.shard_numel * esz
        piece = (view.data_ptr() - chunk.master.data_ptr()) // chunk.master.element_size()
        slot = f.tensor(value.numel(), value.dtype, offset=at[key] + piece * esz).view(value.shape)
        if slot.data_ptr() != value.data_ptr():
            slot.copy_(value)
        return slot

    def state_region(self, chunk: Chunk, key: str) -> Optional[torch.Tensor]:
        f = self._files.get(id(chunk), {}).get("optim")
        at = self._state_at.get(id(chunk), {})
        if f is None or key not in at:
            return None
        dtype = self._state_dtype[(id(chunk), key)]
        return f.tensor(chunk.shard_numel, dtype, offset=at[key])

    def page_out(self) -> None:
        for files in self._files.values():
            for f in files.values():
                f.advise(mmap.MADV_DONTNEED)

    def hold(self, chunk: Chunk, roles: tuple[str, ...]) -> None:
        if id(chunk) not in self._held and self._of(chunk, roles):
            stack = contextlib.ExitStack()
            stack.enter_context(self.writing(chunk, roles))
            self._held[id(chunk)] = stack

    def let_go(self, chunk: Chunk) -> None:
        stack = self._held.pop(id(chunk), None)
        if stack is not None:
            stack.close()

    def free(self, chunk: Chunk) -> None:
        self.let_go(chunk)
        for f in self._files.get(id(chunk), {}).values():
            ahead = self._ahead.pop(id(f), None)
            if ahead is not None:
                ahead[1].result()
        for f in self._files.pop(id(chunk), {}).values():
            f.close()
        self._state_at.pop(id(chunk), None)
        self._used.pop(id(chunk), None)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._ahead.clear()
        for files in self._files.values():
            for f in files.values():
                f.close()
        self._files.clear()
        if self._dir is not None:
            self._dir.remove()
            self._dir = None

    # ---------------------------------------------------------------- paging
    def _of(self, chunk: Chunk, roles: tuple[str, ...]) -> list[tuple[str, MappedFile]]:
        files = self._files.get(id(chunk), {})
        return [(r, files[r]) for r in roles if r in files]

    def prefetch(self, chunk: Chunk, roles: tuple[str, ...] = ROLES, *, write: bool = False) -> None:
        """Fault the chunk's ``roles`` files in on the read-ahead thread (writable when ``write``)."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_chunk-disk")
        for _, f in self._of(chunk, roles):
            if id(f) not in self._ahead:
                advice = POPULATE_WRITE if write else POPULATE_READ
                self._ahead[id(f)] = (write, self._reader.submit(f.advise_unlocked, advice))

    @contextlib.contextmanager
    def reading(self, chunk: Chunk, roles: tuple[str, ...] = ROLES) -> Iterator[None]:
        with self._use(chunk, roles, write=False):
            yield

    @contextlib.contextmanager
    def writing(self, chunk: Chunk, roles: tuple[str, ...] = ROLES) -> Iterator[None]:
        with self._use(chunk, roles, write=True):
            yield

    @contextlib.contextmanager
    def _use(self, chunk: Chunk, roles: tuple[str, ...], *, write: bool) -> Iterator[None]:
        entered = []
        for role, f in self._of(chunk, roles):
            key = (id(f), "w" if write else "r")
            self._depth[key] = self._depth.get(key, 0) + 1
            if self._depth[key] == 1:
                entered.append((key, f))
        t0 = time.perf_counter()
        for _, f in entered:
            ahead = self._ahead.pop(id(f), None)
            if ahead is not None:
                ahead[1].result()
            if ahead is None or (write and not ahead[0]):
                f.advise(POPULATE_WRITE if write else POPULATE_READ)
            self.read_bytes += f.nbytes
        self.wait_s += time.perf_counter() - t0
        try:
            yield
        finally:
            for key, f in entered:
                self._depth.pop(key, None)
                if write:
                    self.write_bytes += f.nbytes
                if not any(self._depth.get((id(f), m)) for m in ("r", "w")):
                    f.advise(mmap.MADV_DONTNEED)

    def stats(self) -> dict[str, float]:
        by_role = {f"disk_{r}_bytes": sum(files[r].nbytes for files in self._files.values() if r in files)
                   for r in ROLES}
        return {"disk_read_bytes": self.read_bytes, "disk_write_bytes": self.write_bytes, "disk_wait_s": self.wait_s,
                **by_role}
