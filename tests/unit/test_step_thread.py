"""``HostStepThread``: the worker that steps host chunks beside backward ([Note: the host Adam beside backward]), and
the GPU the engine's own threads take ([Note: the engine's own threads])."""

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


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom in backward")


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 64)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def forward(self, x, boom=False):
        h = self.first(x)
        if boom:  # backward reaches this after every later layer's gradients are final
            h = _Boom.apply(h)
        for layer in self.layers:
            h = layer(h)
        return h


def test_a_save_after_a_backward_that_raised_waits_for_the_host_steps_it_left_running(tmp_path, monkeypatch):
    """A backward that raises ends without joining the worker; a save then (Lightning's ``OnExceptionCheckpoint``)
    must not read shards the worker is still stepping."""
    from lightning_chunk.engine import ChunkConfig, ChunkEngine
    from lightning_chunk.engine.state import checkpoint

    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = ChunkConfig(placement="host", chunk_numel=4160, step_in_backward=True, step_thread=True)
    eng = ChunkEngine(model, [opt], config=config)

    def step(boom=False):
        opt.zero_grad()
        with eng.micro_batch(training=True):
            loss = model(torch.randn(4, 16), boom=boom).pow(2).mean()
        loss.backward()
        eng.after_backward()
        eng.prepare_step()
        eng.step(opt)
        eng.finish_step(stepped=True)

    step()  # the warm-up
    step()
    binding = eng.bindings[0]
    real = binding.step_chunk
    monkeypatch.setattr(binding, "step_chunk", lambda c, **kw: (time.sleep(0.2), real(c, **kw))[1])
    with pytest.raises(RuntimeError, match="boom in backward"):
        step(boom=True)
    assert eng.early.thread._pending  # host steps still running when the error left backward
    checkpoint.save_sharded(eng, tmp_path / "ckpt", {}, with_optimizer=True)
    assert not eng.early.thread._pending
    eng.teardown()


def test_a_bare_cuda_device_is_named_by_the_index_current_where_the_engine_is_built(monkeypatch):
    """The writer and the step worker take the engine's GPU by index; ``torch.cuda.set_device`` refused a bare
    ``cuda`` on an H200 (2026-12-04). Faked here (no GPU): rank 3's current GPU."""
    from lightning_chunk.engine.system.threads import indexed

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed("cuda") == torch.device("cuda", 3) and indexed(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert indexed("cpu") == torch.device("cpu")
