"""The disk tier's storage: a chunk's master, gradient shard and optimizer state in files, and the I/O thread
that moves them (``DiskStorage``); the compute-dtype copies stay in host memory.

The files themselves (preallocation, the shared mapping, ``preadv``/``pwritev``, the scratch directory)
are ``disk.py``'s ([Note: the disk tier]); this object decides when their bytes move: staged
optimizer steps, gradient write-backs, reads asked ahead, and the paging around every other use.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..chunks.chunk import Chunk, Role, Tier
from ..errors import DiskTierError
from ..system.page_cache import page_cache_room, use_direct
from .disk import POPULATE_READ, POPULATE_WRITE, MappedFile, ScratchDir, aligned_empty, check_room
from .storage import ROLES, HostStorage, TierStorage

DIRECT_REQUESTS = 32  # O_DIRECT pieces in flight at once (threads waiting on the disk, not computing)


@dataclass(eq=False)
class Staged:
    """A disk chunk's files read into host buffers for one use (the optimizer step), written back after it."""

    chunk: Chunk
    files: dict[Role, MappedFile]
    bufs: dict[Role, torch.Tensor]  # role -> uint8 buffer whose first ``files[role].nbytes`` bytes are the file's
    ready: Future  # every role read (the I/O thread runs in order: ``master_ready`` is done first)
    master_ready: Future | None = None  # the master read, first
    set_index: int = -1  # which of the two staging sets holds it

    def holds(self, t: torch.Tensor, role: Role) -> bool:
        f = self.files.get(role)
        return f is not None and f.base <= t.data_ptr() < f.base + f.nbytes

    def like(self, t: torch.Tensor, role: Role) -> torch.Tensor:
        """The staged twin of ``t``, a view of ``role``'s file: same dtype, shape and offset, in the buffer."""
        off = t.data_ptr() - self.files[role].base
        return self.bufs[role][off : off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


@dataclass
class DiskChunk:
    """What the disk tier keeps for one chunk: its files by role, where each optimizer-state key starts in the state
    file and its dtype, the bytes of that file given out, and this backward's gradients until they are written."""

    files: dict[Role, MappedFile] = field(default_factory=dict)
    state_at: dict[str, int] = field(default_factory=dict)  # optimizer state key -> byte offset in the state file
    state_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    used: int = 0  # bytes of the state file given to keys
    grads: torch.Tensor | None = None  # the host buffer this backward's gradients gathered in, until written


class DiskStorage(TierStorage):
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
        self.io, self.ranks_here, self.host_limit = io, ranks_here, host_limit
        self.direct = io == "direct"  # [Note: O_DIRECT where the page cache cannot hold the files]
        self._pool: ThreadPoolExecutor | None = None  # the O_DIRECT pieces in flight
        self._dir: ScratchDir | None = None
        self._chunks: dict[int, DiskChunk] = {}  # id(chunk) -> what the tier keeps for it
        self._depth: dict[tuple[int, str], int] = {}  # nested uses page in and out once
        # gradient buffers kept for the next chunks, each with the write-back that may still be reading it
        self._spare: list[tuple[torch.Tensor, Future]] = []
        self._grad_writes: dict[int, Future] = {}  # id(file) -> its gradient write-back on the I/O thread
        self._hinted: set[int] = set()  # id(file) of master files the kernel was asked to read ahead
        self._reader: ThreadPoolExecutor | None = None  # the read-ahead thread
        self._ahead: dict[int, tuple[bool, Future]] = {}  # id(file) -> (writable, its read-ahead)
        self._sets: list[dict[str, torch.Tensor]] = [{}, {}]  # two staging sets: one in use, one being read
        self._holders: list[Staged | None] = [None, None]  # each set's staged files until written back or let go
        self._next_set = 0
        # id(chunk) of the disk chunks this backward will still step, in the order expected, and their roles: staged
        # at their gather or before ([Note: staging at the backward gather])
        self._will_step: list[int] = []
        self._will_step_roles: tuple[Role, ...] = ()
        self._writes: list[Future] = []  # write-backs not yet known to have succeeded
        # id(chunk) -> its files staged in a set that still holds them, until the next flush: a gather may copy
        # the master from there ([Note: a gather from the staging set])
        self._staged_now: dict[int, Staged] = {}
        self._serial = 0
        self.read_bytes = 0  # paged in from the files (page-cache hits included)
        self.write_bytes = 0  # written back to the files
        self.wait_s = 0.0  # time spent waiting for pages to come in
        self.staged = 0  # chunks stepped on staged copies
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
            self.direct = use_direct(
                self.io,
                nbytes * self.ranks_here,
                (self.host_limit or 0) * self.ranks_here,
                page_cache_room() if self.io == "auto" else None,
            )

    def _pieces(self) -> ThreadPoolExecutor | None:
        """The pool an ``O_DIRECT`` transfer's pieces go to (None when the transfers are buffered: through the page
        cache each is a CPU copy, and more threads would take the cores the compute runs on)."""
        if not self.direct:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DIRECT_REQUESTS, thread_name_prefix="lightning_chunk-disk-direct")
        return self._pool

    def bytes_held(self) -> int:
        return sum(f.nbytes for rec in self._chunks.values() for f in rec.files.values())

    def _record(self, chunk: Chunk) -> DiskChunk:
        rec = self._chunks.get(id(chunk))
        if rec is None:
            rec = self._chunks[id(chunk)] = DiskChunk()
        return rec

    def _file_of(self, chunk: Chunk, role: Role) -> MappedFile | None:
        rec = self._chunks.get(id(chunk))
        return None if rec is None else rec.files.get(role)

    # ----------------------------------------------------------------- bytes
    def _file(self, chunk: Chunk, role: Role, nbytes: int) -> MappedFile:
        self._serial += 1
        f = MappedFile(self.directory.path / f"chunk{chunk.chunk_id}-{self._serial}-{role}.bin", nbytes)
        self._record(chunk).files[role] = f
        return f

    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if role not in ROLES:  # the compute-dtype copy: read by every gather, it stays in host memory
            return self.host.alloc(chunk, role, numel, dtype)
        return self._file(chunk, role, numel * dtype.itemsize).tensor(numel, dtype)

    def reserve_state(self, chunk: Chunk, nbytes: int) -> None:
        rec = self._record(chunk)
        files = rec.files
        nbytes = nbytes + 256 if nbytes else 0  # each key's region starts 16-byte aligned
        if Role.OPTIM in files and files[Role.OPTIM].nbytes == nbytes:
            return
        if Role.OPTIM in files:
            files.pop(Role.OPTIM).close()
        rec.state_at.clear()
        rec.used = 0
        if nbytes:
            self._file(chunk, Role.OPTIM, nbytes)

    def keep_state(self, chunk: Chunk, view: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        f = self._file_of(chunk, Role.OPTIM)
        if f is None or not torch.is_tensor(value) or value.dim() == 0 or value.numel() != view.numel():
            return value
        assert chunk.master is not None
        return self.keep_piece(
            chunk, (view.data_ptr() - chunk.master.data_ptr()) // chunk.master.element_size(), key, value
        )

    def keep_piece(self, chunk: Chunk, offset: int, key: str, value: torch.Tensor) -> torch.Tensor:
        f = self._file_of(chunk, Role.OPTIM)
        if f is None or not torch.is_tensor(value) or value.dim() == 0:
            return value
        rec = self._record(chunk)
        at = rec.state_at
        esz = value.element_size()
        if key not in at:
            base = -(-rec.used // 16) * 16
            if base + chunk.shard_numel * esz > f.nbytes:
                raise DiskTierError(
                    f"chunk {chunk.chunk_id}'s optimizer state {key!r} ({value.dtype}) does not fit the "
                    f"{f.nbytes} bytes reserved for it on the disk tier: the optimizer keeps more state than its "
                    "probe step showed."
                )
            at[key] = base
            rec.state_dtype[key] = value.dtype
            rec.used = base + chunk.shard_numel * esz
        if value.dtype != rec.state_dtype[key] or offset + value.numel() > chunk.shard_numel:
            return value  # not laid out like the shard: stays where it is
        slot = f.tensor(value.numel(), value.dtype, offset=at[key] + offset * esz).view(value.shape)
        if slot.data_ptr() != value.data_ptr():
            slot.copy_(value)
        return slot

    def state_region(self, chunk: Chunk, key: str) -> torch.Tensor | None:
        rec = self._chunks.get(id(chunk))
        f = None if rec is None else rec.files.get(Role.OPTIM)
        if rec is None or f is None or key not in rec.state_at:
            return None
        return f.tensor(chunk.shard_numel, rec.state_dtype[key], offset=rec.state_at[key])

    def page_out(self, chunk: Chunk | None = None) -> None:
        recs = self._chunks.values() if chunk is None else [self._chunks.get(id(chunk), DiskChunk())]
        for rec in recs:
            for f in rec.files.values():
                f.advise(mmap.MADV_DONTNEED)

    def grad_target(self, chunk: Chunk) -> torch.Tensor:
        """A host buffer the gradients gather in (zeros, or the file's gradients when some are being accumulated);
        ``grads_done`` writes it to the file with ``pwritev``: no page of the mapping is touched."""
        f = self._file_of(chunk, Role.GRAD)
        if f is None:
            return super().grad_target(chunk)
        rec = self._record(chunk)
        buf = rec.grads
        if buf is None:
            spare = [s for s in self._spare if s[0].numel() >= f.nbytes]
            if spare:  # reused: no page faults anew, once its write-back has read it
                self._spare.remove(spare[0])
                buf, writing = spare[0]
                self._wait_for(writing)
            else:
                buf = aligned_empty(f.nbytes)
            buf = buf[: f.nbytes]
            assert chunk.grad is not None
            # accumulating: keep what is there. One rank: a parameter of the chunk got a gradient in an earlier
            # micro-batch. Several: this rank's shard was written by an earlier reduce-scatter (its parameters'
            # flags are already set by this backward's gradients, which are still in the gradient payload)
            accumulating = chunk.grad_written if chunk.world_size > 1 else any(t.has_grad for t in chunk.tensors)
            if accumulating:
                self.flush()
                t0 = time.perf_counter()
                f.read_into(buf, direct=self.direct, pool=self._pieces())
                self.wait_s += time.perf_counter() - t0
                self.read_bytes += f.nbytes
            else:
                buf.zero_()
            rec.grads = buf
        assert chunk.grad is not None
        return buf.view(chunk.grad.dtype)[: chunk.shard_numel]

    def grads_done(self, chunk: Chunk) -> None:
        """The chunk's gradients are all in its buffer: write it to the file on the I/O thread.

        [Note: gradient write-backs off the step] Written on the main thread, each disk chunk's gradient
        file held backward up for as long as the write took: 0.23 s a step on the 85M GPT of
        ``benchmarks/disk.py`` where memory could not cache the files. The I/O thread is idle in
        backward, so it writes them while backward goes on. The buffer is one of the two kept for the
        next chunks, so at most two are written at once, and taking one back waits for its write.
        What reads the file after it is ordered after the write: the optimizer's staged reads run on
        the same thread, in order; a use through the mapping (``_use``, ``prefetch``) and a read of
        the gradients being accumulated (``grad_target``, after ``flush``) wait for it first; the
        end of backward waits for all of them (``settle_grads``), before anything outside the engine
        can look at a gradient. A write that failed raises there, or at the latest in ``flush``."""
        buf = self._take_grads(chunk)
        if buf is not None:
            f = self._chunks[id(chunk)].files[Role.GRAD]
            self.write_bytes += f.nbytes
            writing = self._grad_writes[id(f)] = self._thread().submit(
                f.write_from, buf, direct=self.direct, pool=self._pieces()
            )
            kept = sorted([*self._spare, (buf, writing)], key=lambda s: -s[0].numel())
            self._spare = kept[:2]  # the largest two are kept
            for _, dropped in kept[2:]:
                self._wait_for(dropped)  # no more than two buffers a step may be writing

    def file(self, chunk: Chunk, role: Role) -> MappedFile:
        """The chunk's ``role`` file."""
        return self._chunks[id(chunk)].files[role]

    def _take_grads(self, chunk: Chunk) -> torch.Tensor | None:
        """This backward's gradient buffer of ``chunk``, no longer the chunk's."""
        rec = self._chunks.get(id(chunk))
        if rec is None:
            return None
        buf, rec.grads = rec.grads, None
        return buf

    def grads_in_memory(self, chunk: Chunk) -> torch.Tensor | None:
        """The uint8 host buffer this backward's gradients of ``chunk`` gathered in (``grad_target``), before
        ``grads_done`` writes it; ``None`` when there is none."""
        rec = self._chunks.get(id(chunk))
        f = None if rec is None else rec.files.get(Role.GRAD)
        return None if rec is None or f is None or rec.grads is None else rec.grads[: f.nbytes]

    def drop_grads(self, chunk: Chunk) -> None:
        """The chunk's gradients were used from memory and are gone ([Note: stepping disk chunks in backward] in
        ``early_step.py``): keep the buffer for the next chunks without writing it to the file."""
        buf = self._take_grads(chunk)
        if buf is not None:
            done: Future = Future()
            done.set_result(None)
            self._spare = sorted([*self._spare, (buf, done)], key=lambda s: -s[0].numel())[:2]

    def settle_grads(self) -> None:
        """At the end of backward: wait for the gradient write-backs in flight and for the write-backs of chunks
        stepped during it (raising what one of them raised)."""
        writes, self._grad_writes = list(self._grad_writes.values()), {}
        writes, self._writes = [*writes, *self._writes], []
        self._staged_now.clear()
        for w in writes:
            self._wait_for(w)

    def _wait_for(self, work: Future) -> None:
        """Wait for the I/O thread's ``work`` (raising what it raised), counted in ``wait_s``."""
        t0 = time.perf_counter()
        work.result()
        self.wait_s += time.perf_counter() - t0

    def _after_grad_write(self, f: MappedFile) -> None:
        """A use of ``f`` through the mapping sees its gradient write-back: wait for it if one is in flight."""
        writing = self._grad_writes.pop(id(f), None)
        if writing is not None:
            self._wait_for(writing)

    def keeps(self, chunk: Chunk, t: torch.Tensor) -> bool:
        """``t`` is a view of the chunk's optimizer-state file."""
        f = self._file_of(chunk, Role.OPTIM)
        return f is not None and f.base <= t.data_ptr() < f.base + f.nbytes

    def free(self, chunk: Chunk) -> None:
        self._take_grads(chunk)
        self.flush()
        rec = self._chunks.pop(id(chunk), DiskChunk())
        for f in rec.files.values():
            ahead = self._ahead.pop(id(f), None)
            if ahead is not None:
                ahead[1].result()
        for f in rec.files.values():
            self._hinted.discard(id(f))
            f.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._ahead.clear()
        self._grad_writes.clear()
        self._spare.clear()
        self._hinted.clear()
        for rec in self._chunks.values():
            for f in rec.files.values():
                f.close()
        self._chunks.clear()
        if self._dir is not None:
            self._dir.remove()
            self._dir = None

    # ---------------------------------------------------------------- paging
    def _of(self, chunk: Chunk, roles: tuple[Role, ...]) -> list[tuple[Role, MappedFile]]:
        files = self._chunks[id(chunk)].files if id(chunk) in self._chunks else {}
        return [(r, files[r]) for r in roles if r in files]

    def _thread(self) -> ThreadPoolExecutor:
        """The one I/O thread: its work runs in the order it was asked for."""
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_chunk-disk")
        return self._reader

    def prefetch(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES, *, write: bool = False) -> None:
        """Fault the chunk's ``roles`` files in on the read-ahead thread (writable when ``write``)."""
        for _, f in self._of(chunk, roles):
            self._after_grad_write(f)
            if id(f) not in self._ahead:
                advice = POPULATE_WRITE if write else POPULATE_READ
                self._ahead[id(f)] = (write, self._thread().submit(f.advise_unlocked, advice))

    # --------------------------------------------------------------- staging
    @contextlib.contextmanager
    def beside_io(self) -> Iterator[None]:
        """Run the block with torch's intra-op threads lowered so that they and the I/O thread fit the cores this
        process may use; restored after.

        [Note: a core for the I/O thread] Copying through the page cache is CPU work (``preadv`` and
        ``pwritev`` copy 13-19 GB/s on one core here), so while the optimizer steps disk chunks the
        I/O thread needs a core of its own. With torch's threads on every core the fused Adam's
        OpenMP workers (which spin a while after each parallel region) and the I/O thread take
        turns on the cores: on the 2-core benchmark machine the 85M GPT's disk chunks stepped in
        0.35-0.38 s, against 0.28-0.31 s with one torch thread beside the I/O thread (four
        alternated rounds, docs/benchmarks.md). Adam's update is element-wise and torch's fused
        kernel splits its work at cache-line boundaries, so its bits do not depend on the number of
        threads; other kernels split loops anywhere, where a scalar tail may round otherwise than
        the vector body, so the step lowers the threads for fused Adam(W) only
        (``_split_at_cache_lines`` in ``optim/binding.py``). Where the cores outnumber torch's threads,
        nothing changes.
        """
        threads = torch.get_num_threads()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or threads
        fewer = max(1, min(threads, cores - 1))
        if fewer == threads:
            yield
            return
        torch.set_num_threads(fewer)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def stage_in(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> Staged | None:
        """Start reading the chunk's ``roles`` files into one of two staging sets, on the I/O thread.

        [Note: staged optimizer steps] The optimizer step reads every byte of a disk shard and
        writes most of them back. Through the mapping that is a page fault for every 4 KiB page
        and, to write, a write fault that the filesystem handles page by page (ext4's
        ``page_mkwrite``): on the 85M GPT of ``benchmarks/disk.py`` the disk chunks' steps took
        0.40-0.58 s against 0.05 s in memory. Staged, the files are copied into two reused
        buffers with ``preadv`` and back with ``pwritev``, which copy from and into the page cache
        in large calls, on the I/O thread (the GIL is released), while the main thread steps the
        chunk before. The mapping and the calls share the one page cache, so every other use of
        the files sees what the step wrote, once ``flush`` returned. The two sets take turns: the
        thread runs its work in order, so a set is read into only after its last write-back.
        """
        files = dict(self._of(chunk, roles))
        if not files:
            return None
        index = self._free_set()
        if index is None:  # both sets hold files no step took: the older gives way
            index = self._next_set
            self.let_go(self._holders[index])
        buffers = self._sets[index]
        self._next_set = index ^ 1
        for cid, st in list(self._staged_now.items()):  # the set is read into anew: what it held is gone
            if st.set_index == index:
                del self._staged_now[cid]
        bufs = {}
        for role, f in files.items():
            b = buffers.get(role)
            if b is None or b.numel() < f.nbytes:
                b = buffers[role] = aligned_empty(f.nbytes)
            bufs[role] = b
        self.read_bytes += sum(f.nbytes for f in files.values())
        self.staged += 1
        # the kernel queues every read at once, here: the I/O thread may still be writing the chunk before last
        # back, and the reads then go on beside that write ([Note: the gathers' reads ahead of use])
        direct, pool = self.direct, self._pieces()
        if not direct:
            for f in files.values():
                f.will_need()
        master = (
            self._thread().submit(files[Role.MASTER].read_into, bufs[Role.MASTER], direct=direct, pool=pool)
            if Role.MASTER in files
            else None
        )
        ready = self._thread().submit(
            lambda: [f.read_into(bufs[r], direct=direct, pool=pool) for r, f in files.items() if r != Role.MASTER]
        )
        staged = Staged(chunk, files, bufs, ready, master, index)
        self._staged_now[id(chunk)] = staged
        self._holders[index] = staged
        return staged

    def _free_set(self) -> int | None:
        """A staging set no step still needs (the next in turn first), or None."""
        return next((i for i in (self._next_set, self._next_set ^ 1) if self._holders[i] is None), None)

    def can_stage(self) -> bool:
        """A staging set is free: ``stage_in`` would let go of no staged files."""
        return self._free_set() is not None

    def held(self, chunk: Chunk) -> Staged | None:
        """The chunk's files staged and not yet written back or let go, or None."""
        return next((s for s in self._holders if s is not None and s.chunk is chunk), None)

    def let_go(self, staged: Staged | None) -> None:
        """No step will use ``staged``: its set may be read into again once its reads are done."""
        if staged is not None and self._holders[staged.set_index] is staged:
            self.wait(staged)
            self._holders[staged.set_index] = None

    def expect_steps(self, chunks: Sequence[Chunk], roles: tuple[Role, ...]) -> None:
        """This backward steps ``chunks``, in this order as far as can be told, from their staged ``roles`` ([] when
        it is over); ``stepped`` takes each off.

        [Note: staging at the backward gather] Stepping in backward ([Note: stepping disk chunks in backward] in
        ``early_step.py``), a disk chunk's master is read three times a step: by its forward gather, by its
        backward gather and by the staging for its step. The staging of the chunk expected next started when the
        one before stepped, which the hooks' gathers ahead of use mostly precede: two thirds of the backward gathers
        read the file again, on the main thread. So the staging starts earlier: when the hooks ask for a chunk's
        master ahead of its backward gather (``read_ahead_master``), or at that gather, and the gather copies the
        master from the set. Two sets bound it, and the chunks are gathered in another order than they finish
        (a model used in another order than registered; reduce-scatters landing): a gather takes the last free
        set only for the chunk expected to step next, so that set is never held by one that steps later while
        the next waits (a wrong guess, read twice). A gather that finds no set for it reads the file as before."""
        self._will_step = [id(c) for c in chunks]
        self._will_step_roles = roles

    def stepped(self, chunk: Chunk) -> None:
        """This backward stepped ``chunk`` (a later read of its master is no step's)."""
        if id(chunk) in self._will_step:
            self._will_step.remove(id(chunk))

    def _stage_for_step(self, chunk: Chunk) -> Staged | None:
        """``chunk``'s files staged for its step in this backward: the staging that holds them, one started now if
        a set is free, else None."""
        if id(chunk) not in self._will_step:
            return None
        staged = self.held(chunk)
        free = sum(h is None for h in self._holders)
        held = {id(h.chunk) for h in self._holders if h is not None}
        next_up = next((cid for cid in self._will_step if cid not in held), None)
        if staged is None and (free == 2 or (free == 1 and next_up == id(chunk))):
            staged = self.stage_in(chunk, self._will_step_roles)
        return staged

    def read_ahead_master(self, chunk: Chunk) -> None:
        """The chunk's master file will be read by a gather soon (``read_master_into``): let the kernel start reading
        it now, once per use.

        [Note: the gathers' reads ahead of use] On a CPU device a gather reads an fp32 disk shard's
        master file into its payload on the main thread, twice a step (forward and backward). Where
        memory cannot cache the files that read waits for the disk: 0.41 s a step on the 85M GPT of
        ``benchmarks/disk.py`` in a 1 GiB memory cgroup. The hooks know the coming chunks from the
        trace, so at every moment they ask the kernel (``POSIX_FADV_WILLNEED``, which queues the
        reads and returns) for the masters of the next ``READ_AHEAD_CHUNKS`` chunks; the read then
        copies from the page cache. One chunk ahead was too late (a moment's compute is shorter than
        a 9 MB read); four halved the wait. The asking runs on the I/O thread: under memory
        pressure the kernel reclaims pages for the reads in the caller, which took 0.06-0.11 s a
        step from the main thread's hooks. The optimizer's staged reads ask the same of their
        files (``stage_in``), so the disk has the whole next chunk queued, not one request at a
        time; that asking stays on the main thread, where it starts the reads while the I/O thread
        is still writing the chunk before back (asked inside the thread's read, after that write,
        the step's disk waits were 1.46-1.61 s against 1.13-1.19). Where the files are cached
        both are page-cache lookups."""
        f = self._file_of(chunk, Role.MASTER)
        if f is not None and self._stage_for_step(chunk) is not None:
            return  # [Note: staging at the backward gather]
        if f is not None and id(f) not in self._hinted:
            self._hinted.add(id(f))
            self._thread().submit(f.will_need)

    def read_master_into(self, chunk: Chunk, dst: torch.Tensor) -> bool:
        """Copy the chunk's master file into ``dst`` (contiguous, on the host, as many bytes) with ``preadv``, not
        through the mapping: what a gather on a CPU device does with an fp32 disk shard. False if not on disk."""
        f = self._file_of(chunk, Role.MASTER)
        if f is None:
            return False
        self._hinted.discard(id(f))
        staged = self._stage_for_step(chunk) or self._staged_now.get(id(chunk))
        if staged is not None and staged.master_ready is not None:
            # [Note: a gather from the staging set] stepping in backward ([Note: stepping disk chunks in backward] in
            # early_step.py), a disk chunk's files are staged for its step while backward goes on, at its gather
            # or before where a set is free ([Note: staging at the backward gather]): the gather copies the master
            # the I/O thread read, and the file is read once for both
            self._wait_for(staged.master_ready)
            dst.view(-1).view(torch.uint8).copy_(staged.bufs[Role.MASTER][: f.nbytes])
            self.gathers_staged += 1
            return True
        self.gathers_read += 1
        t0 = time.perf_counter()
        f.read_into(dst.view(-1).view(torch.uint8))
        self.wait_s += time.perf_counter() - t0
        self.read_bytes += f.nbytes
        return True

    def wait(self, staged: Staged) -> None:
        if staged.master_ready is not None:
            self._wait_for(staged.master_ready)
        self._wait_for(staged.ready)

    def stage_out(self, staged: Staged, roles: tuple[Role, ...]) -> None:
        """Write the staged ``roles`` back to their files, on the I/O thread."""
        files = {r: f for r, f in staged.files.items() if r in roles}
        self.write_bytes += sum(f.nbytes for f in files.values())
        if self._holders[staged.set_index] is staged:  # the thread writes it back before it reads into the set again
            self._holders[staged.set_index] = None
        direct, pool = self.direct, self._pieces()
        self._writes.append(
            self._thread().submit(
                lambda: [f.write_from(staged.bufs[r], direct=direct, pool=pool) for r, f in files.items()]
            )
        )

    def flush(self) -> None:
        """Wait for every read and write the I/O thread was given (raising what one of them raised)."""
        self._staged_now.clear()
        if self._reader is not None:
            t0 = time.perf_counter()
            self._reader.submit(lambda: None).result()
            writes, self._writes = [*self._writes, *self._grad_writes.values()], []
            self._grad_writes = {}
            for w in writes:
                w.result()
            self.wait_s += time.perf_counter() - t0

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
        for _role, f in self._of(chunk, roles):
            key = (id(f), "w" if write else "r")
            self._depth[key] = self._depth.get(key, 0) + 1
            if self._depth[key] == 1:
                entered.append((key, f))
        for _, f in entered:
            self._after_grad_write(f)
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
        by_role = {
            f"disk_{r}_bytes": sum(rec.files[r].nbytes for rec in self._chunks.values() if r in rec.files)
            for r in ROLES
        }
        return {
            "disk_read_bytes": self.read_bytes,
            "disk_write_bytes": self.write_bytes,
            "disk_wait_s": self.wait_s,
            "disk_staged_steps": self.staged,
            "disk_direct_io": float(self.direct),
            "disk_gathers_from_staging": self.gathers_staged,
            "disk_gathers_from_file": self.gathers_read,
            **by_role,
        }
