"""The disk tier's two staging sets: a chunk's files read into reused host buffers for its optimizer step on the I/O
thread, and written back after it ([Note: staged optimizer steps]).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..chunks.chunk import Chunk, Role
from .disk import MappedFile, aligned_empty
from .disk_io import DiskIO
from .storage import ROLES

FilesOf = Callable[[Chunk, tuple[Role, ...]], dict[Role, MappedFile]]  # a chunk's files of these roles, in order


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


class StagingSets:
    """Two sets of host buffers that take turns: one stepped on while the I/O thread reads the next into the other.

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

    def __init__(self, io: DiskIO, files_of: FilesOf) -> None:
        self.io = io
        self._files_of = files_of
        self._sets: list[dict[Role, torch.Tensor]] = [{}, {}]
        self._holders: list[Staged | None] = [None, None]  # each set's staged files until written back or let go
        self._next_set = 0
        # the disk chunks this backward will still step, in the order expected, and their roles: staged at their
        # gather or before ([Note: staging at the backward gather])
        self._will_step: list[Chunk] = []
        self._will_step_roles: tuple[Role, ...] = ()
        # each chunk's files staged in a set that still holds them, until the next flush: a gather may copy the
        # master from there ([Note: a gather from the staging set] in ``disk_storage.py``)
        self._now: list[Staged] = []
        self.staged = 0  # chunks stepped on staged copies

    def stage_in(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> Staged | None:
        """Start reading the chunk's ``roles`` files into one of the two sets, on the I/O thread."""
        files = self._files_of(chunk, roles)
        if not files:
            return None
        index = self._free_set()
        if index is None:  # both sets hold files no step took: the older gives way
            index = self._next_set
            self.let_go(self._holders[index])
        buffers = self._sets[index]
        self._next_set = index ^ 1
        # the set is read into anew: what it held is gone
        self._now = [s for s in self._now if s.set_index != index and s.chunk is not chunk]
        bufs = {}
        for role, f in files.items():
            b = buffers.get(role)
            if b is None or b.numel() < f.nbytes:
                b = buffers[role] = aligned_empty(f.nbytes)
            bufs[role] = b
        io = self.io
        io.read_bytes += sum(f.nbytes for f in files.values())
        self.staged += 1
        # the kernel queues every read at once, here: the I/O thread may still be writing the chunk before last
        # back, and the reads then go on beside that write ([Note: the gathers' reads ahead of use])
        direct, pool = io.direct, io.pieces()
        if not direct:
            for f in files.values():
                f.will_need()
        master = (
            io.submit(files[Role.MASTER].read_into, bufs[Role.MASTER], direct=direct, pool=pool)
            if Role.MASTER in files
            else None
        )
        ready = io.submit(
            lambda: [f.read_into(bufs[r], direct=direct, pool=pool) for r, f in files.items() if r != Role.MASTER]
        )
        staged = Staged(chunk, files, bufs, ready, master, index)
        self._now.append(staged)
        self._holders[index] = staged
        return staged

    def _free_set(self) -> int | None:
        """A staging set no step still needs (the next in turn first), or None."""
        return next((i for i in (self._next_set, self._next_set ^ 1) if self._holders[i] is None), None)

    def can_stage(self) -> bool:
        """A set is free: ``stage_in`` would let go of no staged files."""
        return self._free_set() is not None

    def held(self, chunk: Chunk) -> Staged | None:
        """The chunk's files staged and not yet written back or let go, or None."""
        return next((s for s in self._holders if s is not None and s.chunk is chunk), None)

    def staged_now(self, chunk: Chunk) -> Staged | None:
        """The chunk's files still in a set since the last flush, written back or not."""
        return next((s for s in self._now if s.chunk is chunk), None)

    def let_go(self, staged: Staged | None) -> None:
        """No step will use ``staged``: its set may be read into again once its reads are done."""
        if staged is not None and self._holders[staged.set_index] is staged:
            self.wait(staged)
            self._holders[staged.set_index] = None

    def wait(self, staged: Staged) -> None:
        if staged.master_ready is not None:
            self.io.wait_for(staged.master_ready)
        self.io.wait_for(staged.ready)

    def stage_out(self, staged: Staged, roles: tuple[Role, ...]) -> None:
        """Write the staged ``roles`` back to their files, on the I/O thread."""
        files = {r: f for r, f in staged.files.items() if r in roles}
        if self._holders[staged.set_index] is staged:  # the thread writes it back before it reads into the set again
            self._holders[staged.set_index] = None
        direct, pool = self.io.direct, self.io.pieces()
        self.io.write_back(
            lambda: [f.write_from(staged.bufs[r], direct=direct, pool=pool) for r, f in files.items()],
            sum(f.nbytes for f in files.values()),
        )

    def forget(self) -> None:
        """After a flush: no set holds files a gather may copy from."""
        self._now = []

    def expect_steps(self, chunks: Sequence[Chunk], roles: tuple[Role, ...]) -> None:
        """This backward steps ``chunks``, in this order as far as can be told, from their staged ``roles`` ([] when
        it is over); ``stepped`` takes each off.

        [Note: staging at the backward gather] Stepping in backward ([Note: stepping disk chunks in backward] in
        ``optim/disk_in_backward.py``), a disk chunk's master is read three times a step: by its forward gather, by its
        backward gather and by the staging for its step. The staging of the chunk expected next started when the
        one before stepped, which the hooks' gathers ahead of use mostly precede: two thirds of the backward gathers
        read the file again, on the main thread. So the staging starts earlier: when the hooks ask for a chunk's
        master ahead of its backward gather (``read_ahead_master``), or at that gather, and the gather copies the
        master from the set. Two sets bound it, and the chunks are gathered in another order than they finish
        (a model used in another order than registered; reduce-scatters landing): a gather takes the last free
        set only for the chunk expected to step next, so that set is never held by one that steps later while
        the next waits (a wrong guess, read twice). A gather that finds no set for it reads the file as before."""
        self._will_step = list(chunks)
        self._will_step_roles = roles

    def stepped(self, chunk: Chunk) -> None:
        """This backward stepped ``chunk`` (a later read of its master is no step's)."""
        self._will_step = [c for c in self._will_step if c is not chunk]

    def for_step(self, chunk: Chunk) -> Staged | None:
        """``chunk``'s files staged for its step in this backward: the staging that holds them, one started now if
        a set is free, else None."""
        if not any(c is chunk for c in self._will_step):
            return None
        staged = self.held(chunk)
        free = sum(h is None for h in self._holders)
        held = [h.chunk for h in self._holders if h is not None]
        next_up = next((c for c in self._will_step if not any(c is h for h in held)), None)
        if staged is None and (free == 2 or (free == 1 and next_up is chunk)):
            staged = self.stage_in(chunk, self._will_step_roles)
        return staged
