"""The disk tier's storage: a chunk's master, gradient shard and optimizer state in files; the compute-dtype
copies stay in host memory.

The files themselves (preallocation, the shared mapping, ``preadv``/``pwritev``, the scratch directory)
are ``disk.py``'s ([Note: the disk tier]); ``DiskStorage`` decides when their bytes move, with three helpers:
the I/O thread (``disk_io.py``), the staging sets of the optimizer step (``disk_staging.py``) and the gradient
buffers of backward (``disk_grads.py``). Every other use pages the files in and out around it (``reading``,
``writing``).
"""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from ..chunks.chunk import Chunk, Role, Tier
from ..errors import DiskTierError
from ..system.page_cache import page_cache_room, use_direct
from .disk import POPULATE_READ, POPULATE_WRITE, MappedFile, ScratchDir, check_room
from .disk_chunk import DiskChunk
from .disk_grads import GradBuffers
from .disk_io import DiskIO
from .disk_staging import StagingSets
from .storage import ROLES, HostStorage


class DiskStorage:
    """Masters, gradient shards and optimizer state in files; compute-dtype copies in host memory."""

    tier = Tier.DISK

    def __init__(
        self,
        root: str | None,
        rank: int,
        host: HostStorage,
        *,
        io: str = "auto",
        ranks_here: int = 1,
        host_limit: int | None = None,
    ) -> None:
        self.root = None if root is None else Path(root)
        self.rank = rank
        self.host = host
        self.mode, self.ranks_here, self.host_limit = io, ranks_here, host_limit
        self.io = DiskIO(direct=io == "direct")  # [Note: O_DIRECT where the page cache cannot hold the files]
        self.staging = StagingSets(self.io, self.files_of)
        self.grads = GradBuffers(self.io, self.flush, self.record)
        self._dir: ScratchDir | None = None
        self._chunks: dict[int, DiskChunk] = {}  # id(chunk) -> what the tier keeps for it
        self._depth: dict[tuple[int, str], int] = {}  # nested uses page in and out once
        self._hinted: set[int] = set()  # id(file) of master files the kernel was asked to read ahead
        self._ahead: dict[int, tuple[bool, Future]] = {}  # id(file) -> (writable, its read-ahead)
        self._serial = 0
        self.gathers_staged = 0  # gathers on a CPU device that copied a master from a staging set
        self.gathers_read = 0  # ... that read it from its file

    # ------------------------------------------------------------ directory
    @property
    def directory(self) -> ScratchDir:
        if self._dir is None:
            if self.root is None:
                raise DiskTierError(
                    "shards must go to the disk tier but no disk_dir is set; pass disk_dir=PATH "
                    "(a directory on a fast local disk) or raise host_memory_limit."
                )
            self._dir = ScratchDir(self.root, self.rank)
        return self._dir

    def check_room(self, nbytes: int, what: str) -> None:
        """Before a layout is built: its disk bytes must fit on the directory's filesystem, for every rank of this
        host (they share it: with one rank's bytes counted each rank passed, then one failed mid-pack while the
        others waited for it in a collective); and whether they can stay in the page cache decides how they move
        (``disk_io``)."""
        if nbytes > 0:
            check_room(self.directory.root, (nbytes + self.bytes_held()) * self.ranks_here, what, self.ranks_here)
            self.io.direct = use_direct(
                self.mode,
                nbytes * self.ranks_here,
                (self.host_limit or 0) * self.ranks_here,
                page_cache_room() if self.mode == "auto" else None,
            )

    def bytes_held(self) -> int:
        return sum(f.nbytes for rec in self._chunks.values() for f in rec.files.values())

    # ---------------------------------------------------------------- records
    def record(self, chunk: Chunk) -> DiskChunk | None:
        """What the tier keeps for ``chunk``, or None when it keeps nothing."""
        return self._chunks.get(id(chunk))

    def files_of(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> dict[Role, MappedFile]:
        rec = self._chunks.get(id(chunk))
        return {} if rec is None else rec.of(roles)

    def _file(self, chunk: Chunk, role: Role, nbytes: int) -> MappedFile:
        self._serial += 1
        f = MappedFile(self.directory.path / f"chunk{chunk.chunk_id}-{self._serial}-{role}.bin", nbytes)
        self._chunks.setdefault(id(chunk), DiskChunk()).files[role] = f
        return f

    # ----------------------------------------------------------------- bytes
    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if role not in ROLES:  # the compute-dtype copy: read by every gather, it stays in host memory
            return self.host.alloc(chunk, role, numel, dtype)
        return self._file(chunk, role, numel * dtype.itemsize).tensor(numel, dtype)

    def alloc_beside(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer kept beside the chunk in a file whatever tier its shard lives on (the average of the weights
        under a host limit, [Note: a sharded EMA] in ``optim/ema.py``); ``drop`` lets it go. ``page_out`` and
        ``reading``/``writing`` with its role page it as the shard's own files."""
        self.drop(chunk, role)
        return self._file(chunk, role, numel * dtype.itemsize).tensor(numel, dtype)

    def drop(self, chunk: Chunk, role: Role) -> None:
        """The chunk's ``role`` file goes (a tensor viewing it stays readable: the mapping outlives the file)."""
        rec = self._chunks.get(id(chunk))
        if rec is None or role not in rec.files:
            return
        f = rec.files.pop(role)
        self.flush()
        ahead = self._ahead.pop(id(f), None)
        if ahead is not None:
            ahead[1].result()
        self._hinted.discard(id(f))
        f.close()
        if not rec.files:
            del self._chunks[id(chunk)]

    @property
    def holds_files(self) -> bool:
        """Some chunk has files: disk shards, or averages kept in files ([Note: the average under a host limit])."""
        return bool(self._chunks)

    def reserve_state(self, chunk: Chunk, nbytes: int) -> None:
        """Optimizer state of ``nbytes`` will be kept in a file beside the chunk's master."""
        rec = self._chunks.setdefault(id(chunk), DiskChunk())
        nbytes = nbytes + 256 if nbytes else 0  # each key's region starts 16-byte aligned
        f = rec.files.get(Role.OPTIM)
        if f is not None and f.nbytes == nbytes:
            return
        rec.drop_state_file()
        if nbytes:
            self._file(chunk, Role.OPTIM, nbytes)

    def page_out(self, chunk: Chunk | None = None) -> None:
        """Drop the pages of ``chunk`` (every chunk when ``None``) from the process (after a pass over it)."""
        recs = self._chunks.values() if chunk is None else [self._chunks.get(id(chunk), DiskChunk())]
        for rec in recs:
            for f in rec.files.values():
                f.advise(mmap.MADV_DONTNEED)

    def free(self, chunk: Chunk) -> None:
        rec = self._chunks.pop(id(chunk), None)
        if rec is None:
            return
        rec.grads = None
        self.flush()
        for f in rec.files.values():
            ahead = self._ahead.pop(id(f), None)
            if ahead is not None:
                ahead[1].result()
        for f in rec.files.values():
            self._hinted.discard(id(f))
            f.close()

    def close(self) -> None:
        self.io.close()
        self._ahead.clear()
        self.grads.clear()
        self._hinted.clear()
        for rec in self._chunks.values():
            for f in rec.files.values():
                f.close()
        self._chunks.clear()
        if self._dir is not None:
            self._dir.remove()
            self._dir = None

    # ---------------------------------------------------------------- paging
    def prefetch(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES, *, write: bool = False) -> None:
        """Fault the chunk's ``roles`` files in on the I/O thread (writable when ``write``)."""
        for f in self.files_of(chunk, roles).values():
            self.io.after_grad_write(f)
            if id(f) not in self._ahead:
                advice = POPULATE_WRITE if write else POPULATE_READ
                self._ahead[id(f)] = (write, self.io.submit(f.advise_unlocked, advice))

    def read_ahead_master(self, chunk: Chunk) -> None:
        """The chunk's master file will be read by a gather soon (``read_master_into``): let the kernel start reading
        it now, once per use.

        [Note: the gathers' reads ahead of use] On a CPU device a gather reads an fp32 disk shard's
        master file into its payload on the main thread, twice a step (forward and backward); where memory
        cannot cache the files that read waits for the disk. The hooks know the coming chunks from the
        trace, so at every moment they ask the kernel (``POSIX_FADV_WILLNEED``, which queues the reads and
        returns) for the masters of the next ``READ_AHEAD_CHUNKS`` chunks, and the read then copies from
        the page cache. One chunk ahead was too late (a moment's compute is shorter than a chunk's read);
        four halved the wait on ``benchmarks/disk.py``'s GPT in a 1 GiB cgroup. The asking runs on the I/O
        thread, since under memory pressure the kernel reclaims pages for the reads in the caller. The
        optimizer's staged reads ask the same of their files (``stage_in``) on the main thread, where it
        starts the reads while the I/O thread is still writing the chunk before back. Where the files are
        cached both are page-cache lookups."""
        f = self.files_of(chunk, (Role.MASTER,)).get(Role.MASTER)
        if f is not None and self.staging.for_step(chunk) is not None:
            return  # [Note: staging at the backward gather]
        if f is not None and id(f) not in self._hinted:
            self._hinted.add(id(f))
            self.io.submit(f.will_need)

    def read_master_into(self, chunk: Chunk, dst: torch.Tensor) -> bool:
        """Copy the chunk's master file into ``dst`` (contiguous, on the host, as many bytes) with ``preadv``, not
        through the mapping: what a gather on a CPU device does with an fp32 disk shard. False if not on disk."""
        f = self.files_of(chunk, (Role.MASTER,)).get(Role.MASTER)
        if f is None:
            return False
        self._hinted.discard(id(f))
        staged = self.staging.for_step(chunk) or self.staging.staged_now(chunk)
        if staged is not None and staged.master_ready is not None:
            # [Note: a gather from the staging set] stepping in backward ([Note: stepping disk chunks in backward]
            # in optim/disk_in_backward.py), a disk chunk's files are staged for its step while backward goes on, at
            # its gather or before where a set is free ([Note: staging at the backward gather]): the gather copies the
            # master the I/O thread read, and the file is read once for both
            self.io.wait_for(staged.master_ready)
            dst.view(-1).view(torch.uint8).copy_(staged.bufs[Role.MASTER][: f.nbytes])
            self.gathers_staged += 1
            return True
        self.gathers_read += 1
        self.io.read_now(f, dst.view(-1).view(torch.uint8), buffered=True)
        return True

    def flush(self) -> None:
        """Wait for every read and write the I/O thread was given (raising what one of them raised)."""
        self.staging.forget()
        self.io.flush()

    def settle_grads(self) -> None:
        """At the end of backward: wait for the gradient write-backs in flight and for the write-backs of chunks
        stepped during it (raising what one of them raised)."""
        self.staging.forget()
        self.io.settle()

    @contextlib.contextmanager
    def reading(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> Iterator[None]:
        with self._use(chunk, roles, write=False):
            yield

    @contextlib.contextmanager
    def writing(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> Iterator[None]:
        with self._use(chunk, roles, write=True):
            yield

    @contextlib.contextmanager
    def _use(self, chunk: Chunk, roles: tuple[Role, ...], *, write: bool) -> Iterator[None]:
        entered = []
        for f in self.files_of(chunk, roles).values():
            key = (id(f), "w" if write else "r")
            self._depth[key] = self._depth.get(key, 0) + 1
            if self._depth[key] == 1:
                entered.append((key, f))
        for _, f in entered:
            self.io.after_grad_write(f)
        t0 = time.perf_counter()
        for _, f in entered:
            ahead = self._ahead.pop(id(f), None)
            if ahead is not None:
                ahead[1].result()
            if ahead is None or (write and not ahead[0]):
                f.advise(POPULATE_WRITE if write else POPULATE_READ)
            self.io.read_bytes += f.nbytes
        self.io.wait_s += time.perf_counter() - t0
        try:
            yield
        finally:
            for key, f in entered:
                self._depth.pop(key, None)
                if write:
                    self.io.write_bytes += f.nbytes
                if not any(self._depth.get((id(f), m)) for m in ("r", "w")):
                    f.advise(mmap.MADV_DONTNEED)

    def stats(self) -> dict[str, float]:
        by_role = {
            f"disk_{r}_bytes": sum(rec.files[r].nbytes for rec in self._chunks.values() if r in rec.files)
            for r in ROLES
        }
        return {
            "disk_read_bytes": self.io.read_bytes,
            "disk_write_bytes": self.io.write_bytes,
            "disk_wait_s": self.io.wait_s,
            "disk_staged_steps": self.staging.staged,
            "disk_direct_io": float(self.io.direct),
            "disk_gathers_from_staging": self.gathers_staged,
            "disk_gathers_from_file": self.gathers_read,
            **by_role,
        }
