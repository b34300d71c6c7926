"""Saves written beside training ([Note: training beside a save]): the checkpoint is the state at the save, whatever
the steps after it do, on one rank; two ranks are the ``resume`` case in tests/distributed/ and the ``+bg`` fault
tests (kills and failed writes) in tests/faults/."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine import ChunkConfig, ChunkEngine
from lightning_chunk.engine.chunks.chunk import Tier
from lightning_chunk.engine.runtime import engine as engine_module
from lightning_chunk.engine.state import background_save, checkpoint
from tests.engine_steps import step
from tests.faults.common import same_tensors, saved_tensors
from tests.models import fit


def engine(**config):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(40, 40) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return ChunkEngine(model, [opt], config=ChunkConfig(chunk_numel=1700, **config)), model, opt


def batches(n):
    return [torch.randn(4, 40, generator=torch.Generator().manual_seed(i)) for i in range(n)]


class HeldWriter:
    """Holds the writer before its first item until ``release``; counts the items it resolved."""

    def __init__(self, monkeypatch):
        self.gate = threading.Event()
        self.items = 0
        resolve = background_save.BackgroundSave._resolve

        def held(save, name):
            self.gate.wait(timeout=30)
            self.items += 1
            return resolve(save, name)

        monkeypatch.setattr(background_save.BackgroundSave, "_resolve", held)

    def release(self):
        self.gate.set()


@pytest.mark.parametrize("placement", ["host", "device"])
def test_steps_beside_a_held_save_copy_aside_what_it_has_not_written(tmp_path, monkeypatch, placement):
    eng, model, opt = engine(placement=placement)
    xs = batches(5)
    for x in xs[:2]:
        step(eng, model, opt, x)
    checkpoint.save_sharded(eng, tmp_path / "sync.ckpt", {"steps": 2}, with_optimizer=True)
    held = HeldWriter(monkeypatch)
    save = checkpoint.save_sharded(eng, tmp_path / "bg.ckpt", {"steps": 2}, with_optimizer=True, background=True)
    assert save is not None
    for x in xs[2:]:  # three steps while the writer has written nothing: each chunk is copied aside once
        step(eng, model, opt, x)
    held.release()
    eng.manager.readers.settle()
    state = sum(c.shard_numel * 4 * 3 for c in eng.manager.chunks)  # master and two moments a chunk, fp32
    assert save.aside_bytes == state
    assert same_tensors(saved_tensors(tmp_path / "bg.ckpt"), saved_tensors(tmp_path / "sync.ckpt"))
    assert checkpoint.read_meta(tmp_path / "bg.ckpt")["steps"] == 2
    eng.teardown()


@pytest.mark.parametrize("disk", [False, True], ids=["host", "disk_tier"])
def test_under_a_host_memory_limit_a_step_waits_for_the_writer_instead(tmp_path, monkeypatch, disk):
    tier = dict(host_memory_limit=100_000, disk_dir=tmp_path / "scratch") if disk else dict(host_memory_limit=10**9)
    eng, model, opt = engine(placement="host", **tier)
    assert bool(eng.manager.ledger[Tier.DISK]) == disk
    xs = batches(3)
    step(eng, model, opt, xs[0])
    checkpoint.save_sharded(eng, tmp_path / "sync.ckpt", {}, with_optimizer=True)
    held = HeldWriter(monkeypatch)
    save = checkpoint.save_sharded(eng, tmp_path / "bg.ckpt", {}, with_optimizer=True, background=True)
    released = threading.Event()
    threading.Timer(0.3, lambda: (released.set(), held.release())).start()
    step(eng, model, opt, xs[1])  # waits until the writer has read every chunk: it ends after the release
    assert released.is_set() and save is not None and save.aside_bytes == 0 and save.waited_s > 0
    eng.manager.readers.settle()
    assert same_tensors(saved_tensors(tmp_path / "bg.ckpt"), saved_tensors(tmp_path / "sync.ckpt"))
    eng.teardown()


def test_shards_off_the_host_are_copied_when_the_save_starts(tmp_path, monkeypatch):
    # on a GPU the device tier's shards go to pinned host memory at once; here every device-tier shard is taken
    # for one, and the writer, held, finds them all copied
    monkeypatch.setattr(background_save, "_off_host", lambda chunk: True)
    eng, model, opt = engine(placement="device")
    step(eng, model, opt, batches(1)[0])
    held = HeldWriter(monkeypatch)
    save = checkpoint.save_sharded(eng, tmp_path / "bg.ckpt", {}, with_optimizer=True, background=True)
    assert save is not None and save.aside_bytes == sum(c.shard_numel * 4 * 3 for c in eng.manager.chunks)
    step(eng, model, opt, batches(2)[1])  # nothing left to copy: the step does not wait for the held writer
    held.release()
    save._thread.join(timeout=30)
    # the copies went back to torch's pinned cache, which keeps them page-locked: the next step empties it, once
    # ([Note: pinned blocks a repack leaves behind])
    emptied = []
    monkeypatch.setattr(engine_module, "release_pinned_cache", lambda: emptied.append(True))
    step(eng, model, opt, batches(3)[2])
    assert emptied == [True] and not eng.manager.readers.running
    step(eng, model, opt, batches(4)[3])
    assert emptied == [True]
    eng.teardown()
    eng, model, opt = engine(placement="device")
    step(eng, model, opt, batches(1)[0])
    checkpoint.save_sharded(eng, tmp_path / "sync.ckpt", {}, with_optimizer=False)
    assert same_tensors(
        {k: v for k, v in saved_tensors(tmp_path / "bg.ckpt").items() if k.endswith("master")},
        saved_tensors(tmp_path / "sync.ckpt"),
    )
    eng.teardown()


def test_a_failed_background_save_raises_where_it_settles_and_keeps_the_older_checkpoint(tmp_path, monkeypatch):
    eng, model, opt = engine(placement="host")
    step(eng, model, opt, batches(1)[0])
    checkpoint.save_sharded(eng, tmp_path / "old.ckpt", {}, with_optimizer=True)
    before = saved_tensors(tmp_path / "old.ckpt")

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    import torch.distributed.checkpoint.filesystem as dcp_fs

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    checkpoint.save_sharded(eng, tmp_path / "new.ckpt", {}, with_optimizer=True, background=True)
    removed = []
    checkpoint.when_saved(eng, lambda: removed.append("old"))  # what ModelCheckpoint's top-k removal does
    step(eng, model, opt, batches(2)[1])  # training goes on; the failure waits for a point every rank reaches
    with pytest.raises(checkpoint.CheckpointSaveError, match="No space left on device"):
        eng.manager.readers.settle()
    assert removed == [] and not (tmp_path / "new.ckpt").exists()
    assert same_tensors(saved_tensors(tmp_path / "old.ckpt"), before)
    monkeypatch.undo()
    checkpoint.save_sharded(eng, tmp_path / "new.ckpt", {}, with_optimizer=True, background=True)
    checkpoint.when_saved(eng, lambda: removed.append("old"))
    eng.teardown()  # settles: the save is complete and the removal ran
    assert removed == ["old"] and checkpoint.read_meta(tmp_path / "new.ckpt") is not None


def test_lightning_s_async_checkpoint_io_writes_the_same_checkpoints_and_keeps_top_k(tmp_path):
    def run(out: Path, plugins, top_k):
        cb = ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_top_k=top_k, monitor="step", mode="max")
        strategy = ChunkOffloadStrategy(placement="host", memory={"chunk_numel": 4096})
        fit(strategy, steps=8, callbacks=[cb], enable_checkpointing=True, plugins=plugins)
        return sorted(p.name for p in out.iterdir())

    assert run(tmp_path / "sync", None, -1) == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6, 8)]
    kept = run(tmp_path / "async", [AsyncCheckpointIO()], 2)
    assert kept == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt"]  # older ones removed once the newer were complete
    for name in kept:
        assert same_tensors(saved_tensors(tmp_path / "async" / name), saved_tensors(tmp_path / "sync" / name))


@pytest.mark.parametrize("steps", [4, 2], ids=["at_the_next_save", "at_the_end_of_fit"])
def test_a_failed_save_in_the_background_fails_the_fit_where_it_settles(tmp_path, monkeypatch, steps):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", full)
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    strategy = ChunkOffloadStrategy(placement="host")
    with pytest.raises(checkpoint.CheckpointSaveError, match="No space left on device"):
        fit(strategy, steps=steps, callbacks=[cb], enable_checkpointing=True, plugins=[AsyncCheckpointIO()])
    assert strategy.engine is None  # torn down all the same
    assert not any(p.name.endswith(".ckpt") for p in tmp_path.iterdir())


def test_the_writer_thread_works_on_the_rank_s_gpu_and_cores_and_waits_for_its_copies_there(monkeypatch):
    """A new thread starts on GPU 0: on rank 3 the writer's bare ``torch.cuda.synchronize()`` waited for GPU 0, not
    for its own copy of a device shard (the file could get bytes the copy had not landed), and its pinned buffers
    made a CUDA context on GPU 0. And with torch's default thread count: its clones ran an OpenMP team as large as
    the machine. Faked here (no GPU): what the writer thread asks of CUDA and of torch's thread pool."""
    calls: list[tuple[str, object, str]] = []
    here = threading.current_thread().name
    threads = torch.get_num_threads()  # the rank's share, as the training thread has it
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", n, here_or(here))))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d, here_or(here))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(("synchronize", d, here_or(here))))
    monkeypatch.setattr(background_save.BackgroundSave, "_copy", lambda self, name: PinnedCopy())
    gpu = torch.device("cuda", 3)
    job = FakeJob(gpu)
    save = background_save.BackgroundSave(job, comm=None, copy_aside=False)  # type: ignore[arg-type]
    save.start()
    save.finish()
    assert job.made == ["chunk.0.master"]
    assert calls == [("threads", threads, "writer"), ("set_device", gpu, "writer"), ("synchronize", gpu, "writer")]


def here_or(main: str) -> str:
    return "main" if threading.current_thread().name == main else "writer"


class PinnedCopy:
    def is_pinned(self) -> bool:
        return True


class FakeJob:
    """A save of one device item: ``run`` asks for it as the writer does."""

    def __init__(self, device: torch.device) -> None:
        self.make = {"chunk.0.master": lambda: None}
        self.path = Path("ckpt")
        self.mgr = type("Manager", (), {"device": device, "chunks": []})()
        self.made: list[str] = []

    def run(self, comm) -> None:
        for name, make in self.make.items():
            make()
            self.made.append(name)
