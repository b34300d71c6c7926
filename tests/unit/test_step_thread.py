"""``HostStepThread``: the worker that steps host chunks beside backward ([Note: the host Adam beside backward])."""

import ctypes
import glob
import os
import threading
import time

import pytest
import torch

from lightning_chunk.engine.optim.step_thread import HostStepThread


def test_chunks_step_in_order_on_one_worker_and_at_most_max_pending_wait():
    worker = HostStepThread(torch.device("cpu"), max_pending=2)
    ran, done, threads = [], [], set()
    waiting = []

    def step(i):
        def run():
            threads.add(threading.current_thread().name)
            time.sleep(0.01)
            ran.append(i)

        return run

    for i in range(6):
        worker.submit(i, step(i), done.append)
        waiting.append(len(worker._pending))
    worker.join(done.append)
    assert ran == done == list(range(6)) and worker.stepped == 6 and worker.seconds > 0
    assert max(waiting) <= 2  # a third hand-over waited for the oldest
    assert len(threads) == 1 and threading.current_thread().name not in threads
    worker.close()


def test_a_failed_step_is_raised_at_the_join_after_the_others_finished():
    worker = HostStepThread(torch.device("cpu"), max_pending=4)
    done, ran = [], []

    def ok(i):
        return lambda: (time.sleep(0.01), ran.append(i))

    def fails():
        raise RuntimeError("the host step failed")

    worker.submit(0, ok(0), done.append)
    worker.submit(1, fails, done.append)
    worker.submit(2, ok(2), done.append)
    with pytest.raises(RuntimeError, match="the host step failed"):
        worker.join(done.append)
    assert ran == [0, 2] and done == [0, 2]  # the chunk that failed gives nothing back; the rest were waited for
    assert not worker._pending
    worker.close()


def test_the_worker_s_openmp_team_is_the_rank_s_share_of_the_cores():
    """A new thread's OpenMP regions take every core, whatever ``torch.set_num_threads`` said elsewhere: the worker
    sets its own to the rank's share, which the one-pass kernel's ``#pragma omp parallel`` then uses."""
    found = glob.glob(os.path.join(torch.__path__[0], "lib", "libgomp*"))
    if not found or (os.cpu_count() or 1) < 2:
        pytest.skip("needs torch's libgomp and two cores")
    gomp = ctypes.CDLL(found[0])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bare: list[int] = []
        t = threading.Thread(target=lambda: bare.append(gomp.omp_get_max_threads()))
        t.start()
        t.join()
        if bare[0] <= 1:  # the premise: a plain thread's team is larger than the rank's
            pytest.skip("OMP_NUM_THREADS holds every thread's team to one here")
        worker, seen = HostStepThread(torch.device("cpu")), []
        worker.submit(0, lambda: seen.append(gomp.omp_get_max_threads()), lambda c: None)
        worker.join(lambda c: None)
        worker.close()
        assert seen == [1]
    finally:
        torch.set_num_threads(before)
