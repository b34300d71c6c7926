"""Chunks stepped on a thread of their own while backward goes on (``step_in_backward``).

[Note: the host Adam beside backward]
Stepped in backward on the autograd thread, a host chunk's Adam (30 bytes a parameter through host memory: 24 ms
for a 16M-element chunk at 20 GB/s) holds the thread that launches backward's next kernels, so on a GPU the
device idles through every host step and a step costs the sum of backward and the host Adam. Here
``EarlyStep`` hands such a chunk to ``HostStepThread``: a single worker runs its clip and its step while the
autograd thread goes on with backward, and the step costs the longer of the two. A device-tier chunk goes to the
worker too (its step only launches kernels): stepped on the autograd thread, each would first wait for every host
step handed over before it, and under a device limit, where the tiers alternate, the overlap would be lost. Only a
disk chunk steps on the autograd thread, after a join. What keeps it exact and safe:

- The chunk's gradients are complete in its shard before it is handed over (the gradient offload's copies
  drained, [Note: gradient offload] in ``tiers/offload.py``); backward never reads nor writes that shard again
  (its gradients are final) and the step touches that chunk's master, moments and compute copy alone, which
  backward does not read either (its payload was gathered before its last use). A device chunk's kernels go to the
  worker's current stream, the device's default one, where backward produced its gradients.
- One worker, steps in the order backward finished the chunks: the same kernels on the same bits as on the
  autograd thread. Everything else that narrows the optimizer's param groups (a disk chunk's step, the steps after
  backward) runs only once the worker is idle (``join``).
- What the manager owns (the pool, the ledger, the clock) is touched on the autograd thread alone: a finished
  chunk gives its gradient shard back to the pool when the autograd thread next hands one over or joins
  (``reap``), in order.
- At most ``max_pending`` chunks wait for the worker; one more makes the autograd thread wait for the oldest, so
  the gradient shards held stay a few chunks' worth when the host Adam is the slower of the two.
- The worker runs its kernels on the rank's share of the cores and on the rank's GPU (``_start``): a new thread
  starts with OpenMP teams as large as the machine and on GPU 0.
- The worker's error is raised on the autograd thread at the next hand-over or join; the end of backward joins,
  so nothing steps past the backward that produced its gradients, and the vote and the steps after backward
  (``step_rest``) see every chunk stepped. A backward that raises ends without that join: a save joins first
  (Lightning's ``OnExceptionCheckpoint`` saves then), and the engine's teardown waits for the worker.

``step_thread`` (``OffloadOptions``) turns it on; ``None`` does so when the compute device is a GPU. On a CPU device
the worker shares the cores with backward's own kernels, so there it is a test of the schedule rather than a
speed-up.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..system.threads import enter_rank


class HostStepThread:
    """One worker thread stepping chunks in the order they are handed over ([Note: the host Adam beside
    backward])."""

    def __init__(self, device: torch.device, max_pending: int = 4) -> None:
        self.device = device
        self.threads = torch.get_num_threads()  # the rank's share of the cores (``take_rank_threads``)
        self.max_pending = max_pending
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Any, Future[float]]] = deque()
        self.stepped = 0  # chunks stepped on the worker since set-up
        self.seconds = 0.0  # the worker's time in those steps (beside backward)

    def submit(self, chunk: Any, step: Callable[[], None], done: Callable[[Any], None]) -> None:
        """Step ``chunk`` on the worker (``step``); ``done(chunk)`` runs on this thread once it has stepped."""
        if len(self._pending) >= self.max_pending:
            self._reap(done, block=1)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lightning_chunk host step", initializer=self._start
            )
        self._pending.append((chunk, self._pool.submit(_timed, step)))
        self._reap(done, block=0)

    def join(self, done: Callable[[Any], None]) -> None:
        """Wait for every chunk handed over; ``done`` for each, in order; raise the first error."""
        self._reap(done, block=len(self._pending))

    def wait_for(self, chunk: Any, done: Callable[[Any], None]) -> None:
        """Wait until ``chunk`` has stepped (with every chunk handed over before it); ``done`` for each, in order."""
        for i, (pending, _) in enumerate(self._pending):
            if pending is chunk:
                self._reap(done, block=i + 1)
                return

    def _reap(self, done: Callable[[Any], None], *, block: int) -> None:
        """``done`` for the finished chunks at the head of the queue, waiting for the first ``block`` of them."""
        error: BaseException | None = None
        while self._pending and (block > 0 or self._pending[0][1].done()):
            chunk, fut = self._pending.popleft()
            block -= 1
            try:
                self.seconds += fut.result()
            except BaseException as e:  # noqa: BLE001 - the rest is waited for before the error is raised
                error = error or e
                block = max(block, len(self._pending))
                continue
            self.stepped += 1
            done(chunk)
        if error is not None:
            raise error

    def _start(self) -> None:
        """The worker takes the rank's share of the cores and its GPU ([Note: the engine's own threads])."""
        enter_rank(self.device, self.threads)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start
