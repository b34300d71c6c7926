"""The disk tier's I/O thread: the one thread its reads and write-backs run on, in the order they were asked for,
the pool of ``O_DIRECT`` pieces, the write-backs in flight, and the bytes and seconds they cost.

``DiskStorage`` (``disk_storage.py``) and its helpers ask; this object runs and waits.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from .disk import MappedFile

DIRECT_REQUESTS = 32  # O_DIRECT pieces in flight at once (threads waiting on the disk, not computing)


class DiskIO:
    """One I/O thread, the write-backs it owes, and the counters of what moved."""

    def __init__(self, *, direct: bool) -> None:
        self.direct = direct  # [Note: O_DIRECT where the page cache cannot hold the files]
        self._thread: ThreadPoolExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None  # the O_DIRECT pieces in flight
        self._writes: list[Future] = []  # write-backs not yet known to have succeeded
        self._grad_writes: dict[int, Future] = {}  # id(file) -> its gradient write-back
        self.read_bytes = 0  # paged in from the files (page-cache hits included)
        self.write_bytes = 0  # written back to the files
        self.wait_s = 0.0  # time spent waiting for pages to come in

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn`` on the I/O thread, after everything asked before it."""
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_chunk-disk")
        return self._thread.submit(fn, *args, **kwargs)

    def pieces(self) -> ThreadPoolExecutor | None:
        """The pool an ``O_DIRECT`` transfer's pieces go to (None when the transfers are buffered: through the page
        cache each is a CPU copy, and more threads would take the cores the compute runs on)."""
        if not self.direct:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(DIRECT_REQUESTS, thread_name_prefix="lightning_chunk-disk-direct")
        return self._pool

    def read_now(self, f: MappedFile, buf: torch.Tensor, *, buffered: bool = False) -> None:
        """Read ``f`` into ``buf`` on the calling thread, counted (through the page cache when ``buffered``)."""
        t0 = time.perf_counter()
        if buffered:
            f.read_into(buf)
        else:
            f.read_into(buf, direct=self.direct, pool=self.pieces())
        self.wait_s += time.perf_counter() - t0
        self.read_bytes += f.nbytes

    def wait_for(self, work: Future) -> None:
        """Wait for the thread's ``work`` (raising what it raised), counted in ``wait_s``."""
        t0 = time.perf_counter()
        work.result()
        self.wait_s += time.perf_counter() - t0

    def write_back(self, work: Callable[[], Any], nbytes: int) -> None:
        """Write ``nbytes`` with ``work`` on the thread; ``settle`` or ``flush`` waits for it."""
        self.write_bytes += nbytes
        self._writes.append(self.submit(work))

    def write_grads(self, f: MappedFile, buf: torch.Tensor) -> Future:
        """Write a gradient buffer to its file on the thread; a use of ``f`` waits for it (``after_grad_write``)."""
        self.write_bytes += f.nbytes
        writing = self._grad_writes[id(f)] = self.submit(f.write_from, buf, direct=self.direct, pool=self.pieces())
        return writing

    def after_grad_write(self, f: MappedFile) -> None:
        """A use of ``f`` through the mapping sees its gradient write-back: wait for it if one is in flight."""
        writing = self._grad_writes.pop(id(f), None)
        if writing is not None:
            self.wait_for(writing)

    def settle(self) -> None:
        """Wait for the write-backs in flight (raising what one of them raised)."""
        writes = [*self._grad_writes.values(), *self._writes]
        self._grad_writes, self._writes = {}, []
        for w in writes:
            self.wait_for(w)

    def flush(self) -> None:
        """Wait for every read and write the thread was given (raising what one of them raised)."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.submit(lambda: None).result()
            writes = [*self._writes, *self._grad_writes.values()]
            self._grad_writes, self._writes = {}, []
            for w in writes:
                w.result()
            self.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        for pool in (self._thread, self._pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._thread = self._pool = None
        self._grad_writes.clear()


@contextlib.contextmanager
def beside_io() -> Iterator[None]:
    """Run the block with torch's intra-op threads lowered so that they and the I/O thread fit the cores this
    process may use; restored after.

    [Note: a core for the I/O thread] Copying through the page cache is CPU work (``preadv`` and
    ``pwritev`` copy 13-19 GB/s on one core here), so while the optimizer steps disk chunks the
    I/O thread needs a core of its own. With torch's threads on every core the fused Adam's
    OpenMP workers (which spin a while after each parallel region) and the I/O thread take
    turns on the cores: on a 2-core machine the 85M GPT's disk chunks stepped in 0.35-0.38 s,
    against 0.28-0.31 s with one torch thread beside the I/O thread (``benchmarks/disk.py``).
    Adam's update is element-wise and torch's fused kernel splits its work at cache-line
    boundaries, so its bits do not depend on the number of threads; other kernels split loops
    anywhere, where a scalar tail may round otherwise than the vector body, so the step lowers the
    threads for fused Adam(W) only (``split_at_cache_lines`` in ``optim/steppers.py``). Where the
    cores outnumber torch's threads, nothing changes.
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
