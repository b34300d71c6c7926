"""A sharded save written by a thread of its own while training goes on.

[Note: training beside a save]
A synchronous save of the 99.5M example GPT (1.2 GB of masters and Adam moments) holds training for about 6 s on
the 2-core benchmark machine, most of it in ``write`` and ``fsync``: several training steps. Lightning's
``AsyncCheckpointIO`` (what selects this path, see ``checkpointing.py``) writes on a thread after cloning every
tensor of the checkpoint, which for this strategy would be a second copy of the whole training state in host
memory. Here a save is *staged* on the training thread: the ranks agree on what is written, the meta (loop state,
buffers, optimizer scalars, the layout) is copied, and a ``SaveJob`` holds, for each shard, a function that reads
it when the writer reaches it. A thread then runs the whole save, DCP's collectives and the agreements included,
on a gloo group of its own (``RankGroup.beside``), so that none of them pairs with a chunk collective.

Host shards need no copy as long as they do not change, and nothing changes them until the next optimizer step,
EMA update or load. Each of those first calls ``ShardReaders.before_change``. The writer takes the items of the
save (a chunk's master, each of its optimizer states, its average) one at a time and copies each out of the
training state before writing it (``PENDING`` -> ``READING`` -> ``READ``), so training waits for an item only
while that copy runs. Every item the writer has not reached when training is about to change its chunk is copied
aside by training (``PENDING`` -> ``READ``), and the writer takes the copy; where ``host_memory_limit`` bounds host
memory, training waits for the writer to read it instead. A step then stalls only for the copy of what the writer
has not reached, and a save costs extra host memory only for that copy and the item being written. Shards off the
host (the device tier on a GPU) are copied aside when the save starts, into host memory pinned as the host shards
are (``pin_memory``), as the copy has to happen anyway. A repack, a load, another save and teardown ``settle``: they
wait until the save is over, and a save that failed raises there, on every rank at the same point (the ranks
agreed on the failure in the thread). The directory is still swapped into place only once every rank wrote its
shards, so a kill at any moment leaves the previous checkpoint or the new one; removing an older checkpoint
(``top_k``) waits for the new one to be complete (``when_saved``), and does not happen when it fails.
"""

from __future__ import annotations

import enum
import functools
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..chunks.chunk import Tier
from ..system.threads import enter_rank
from .shard_writer import chunk_of

if TYPE_CHECKING:  # only a type here: save.py builds the jobs and starts the saves
    from .save import SaveJob


class ItemRead(enum.Enum):
    """Where the writer is with one item of the save (a chunk's master, one of its optimizer states, its average)."""

    PENDING = "pending"  # not reached: training must copy it aside or wait before changing its chunk
    READING = "reading"  # being copied out of the training state by the writer
    READ = "read"  # copied by the writer or aside by training (or the save is over): the chunk may change


class BackgroundSave:
    """One ``SaveJob`` run on a thread beside training; a ``ShardReader`` of the manager's
    ([Note: training beside a save])."""

    def __init__(self, job: SaveJob, comm: Any, *, copy_aside: bool) -> None:
        self.job, self.comm, self.copy_aside = job, comm, copy_aside
        self._cond = threading.Condition()
        self._names: dict[int, list[str]] = {}
        for name in job.make:
            self._names.setdefault(chunk_of(name) or 0, []).append(name)
        self._state = dict.fromkeys(job.make, ItemRead.PENDING)
        self._makers = dict(job.make)
        self._aside: dict[str, torch.Tensor] = {}
        job.make = {name: functools.partial(self._resolve, name) for name in job.make}
        self._then: list[Callable[[], None]] = []
        self.error: BaseException | None = None
        self.over = False
        self.aside_bytes = 0  # copied aside by training: at most the training state the writer had not reached
        self.waited_s = 0.0  # training's time in ``let_go``, copies aside included
        self._thread = threading.Thread(target=self._run, name=f"lightning_chunk save {job.path.name}")
        self._threads = torch.get_num_threads()  # the rank's share of the cores, for the writer

    def start(self) -> None:
        if self.copy_aside:  # shards off the host are copied now: the writer would copy them anyway
            self.let_go(c for c in self.job.mgr.chunks if c.shard_tier is Tier.DEVICE and _off_host(c))
        self._thread.start()

    # ------------------------------------------------------------------ training's side
    def let_go(self, chunks: Iterable[Any] | None) -> None:
        if self.over:  # nothing more is read: the steps until the next settle pay one attribute read
            return
        ids = self._names if chunks is None else [c.chunk_id for c in chunks]
        names = [n for cid in ids for n in self._names.get(cid, ())]
        start = time.perf_counter()
        with self._cond:
            if self.copy_aside:
                self._set_aside([n for n in names if self._state[n] is ItemRead.PENDING])
            self._cond.wait_for(lambda: all(self._state[n] is ItemRead.READ for n in names))
        self.waited_s += time.perf_counter() - start

    @property
    def done(self) -> bool:
        return self.over and self.error is None

    def finish(self) -> None:
        self._thread.join()
        if self.error is not None:
            raise self.error

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the save has succeeded (now if it has); never if it failed."""
        with self._cond:
            if not self.over:
                self._then.append(fn)
                return
        if self.error is None:
            fn()

    def _set_aside(self, names: list[str]) -> None:
        """Copy items ``names`` for the writer (under the lock: the writer waits for the copies).

        Beside a writing thread these copies ran at 0.6 to 0.8 GB/s on the 2-core benchmark machine, against 2.5 GB/s
        alone: the kernel's copies into the page cache share the cores and the memory bus. Holding the writer's file
        writes (16 MB slices behind a gate) while training copied changed nothing measurable (the first save's stall
        1.38 to 1.41 s with the gate, 1.38 to 1.39 s without, 2026-11-29), so the writer is left alone."""
        off_host = False
        for name in names:
            t = self._copy(name)
            off_host = off_host or t.is_pinned()
            self._aside[name] = t
            self._state[name] = ItemRead.READ
            self.aside_bytes += t.numel() * t.element_size()
        if off_host:
            torch.cuda.synchronize(self.job.mgr.device)

    def _copy(self, name: str) -> torch.Tensor:
        """Item ``name`` in host memory of its own (pinned, copied asynchronously, when it is on a GPU)."""
        t = self._makers.pop(name)()
        if t.device.type != "cpu":
            return self._host_like(t).copy_(t, non_blocking=True)
        return t if name in self.job.fresh else t.clone()

    def _host_like(self, t: torch.Tensor) -> torch.Tensor:
        """Host memory for a copy of device tensor ``t``, pinned as the host shards are (``pin_memory``)."""
        exact = self.job.mgr.tiers.host.exact
        if exact is not None:
            return exact.empty(t.numel(), t.dtype).view(t.shape)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.job.mgr.tiers.host.pinned)

    # ------------------------------------------------------------------ the writer's side
    def _resolve(self, name: str) -> torch.Tensor:
        """The item for the writer: copied aside already, or copied now (then training may change it)."""
        with self._cond:
            t = self._aside.pop(name, None)
            if t is not None:
                return t
            self._state[name] = ItemRead.READING
        try:
            t = self._copy(name)
            if t.is_pinned():
                torch.cuda.synchronize(self.job.mgr.device)  # this thread's current device is set in ``_run``
            return t
        finally:
            with self._cond:
                self._state[name] = ItemRead.READ
                self._cond.notify_all()

    def _run(self) -> None:
        """The writer: on the rank's GPU and its share of the cores, as training is ([Note: the engine's own
        threads]): its clones of large shards ran an OpenMP team as large as the machine."""
        enter_rank(self.job.mgr.device, self._threads)
        try:
            self.job.run(self.comm)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread where it settles the save
            self.error = e
        finally:
            with self._cond:
                self._state = dict.fromkeys(self._state, ItemRead.READ)  # nothing more is read
                self._aside.clear()
                self._makers.clear()
                self._cond.notify_all()
        while self.error is None:
            with self._cond:
                if not self._then:
                    self.over = True
                    return
                fn = self._then.pop(0)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - the save itself succeeded
                warnings.warn(f"after the save of {str(self.job.path)!r}: {type(e).__name__}: {e}", stacklevel=1)
        with self._cond:
            self.over = True


def _off_host(chunk: Any) -> bool:
    """Whether the chunk's master shard is outside host memory (on a GPU)."""
    return chunk.master_tensor_for_read().device.type != "cpu"
