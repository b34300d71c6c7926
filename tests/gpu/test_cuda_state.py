"""CUDA checks of saved state: a checkpoint from pinned host shards resumes as plain Lightning's, the disk tier
(stepped in backward by default, and after it), saves in the background; the optimizer's state read and reset
between steps. Skipped cleanly without CUDA."""

import lightning as L
import pytest
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy, MemoryOptions, OffloadOptions
from lightning_chunk.engine import ChunkConfig, ChunkEngine
from tests.compare import assert_same_params
from tests.models import ParityNet, fit, quiet_trainer, token_data

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = dict(rtol=1e-4, atol=1e-5)


def test_checkpoint_from_pinned_host_shards_resumes_like_auto(tmp_path):
    def run(strategy, steps, ckpt_dir=None, ckpt_path=None):
        L.seed_everything(11, verbose=False)
        m = ParityNet(variant="tied")
        cbs = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=8, filename="{step}")] if ckpt_dir else []
        quiet_trainer(
            accelerator="gpu",
            strategy=strategy,
            max_steps=steps,
            callbacks=cbs,
            limit_val_batches=0,
            enable_checkpointing=bool(cbs),
        ).fit(m, token_data(), ckpt_path=ckpt_path)
        return m

    run("auto", 8, ckpt_dir=tmp_path / "auto")
    run(ChunkOffloadStrategy(placement="host", memory=MemoryOptions(chunk_numel=4096)), 8, ckpt_dir=tmp_path / "chunk")
    ref = run("auto", 12, ckpt_path=tmp_path / "auto" / "step=8.ckpt")
    got = run(
        ChunkOffloadStrategy(placement="auto", device_memory_limit="256MiB", memory=MemoryOptions(chunk_numel=4096)),
        12,
        ckpt_path=tmp_path / "chunk" / "step=8.ckpt",
    )
    assert_same_params(ref, got, TOL)


@pytest.mark.parametrize("step_in_backward", [None, False])
def test_the_disk_tier_on_cuda_trains_like_auto_and_steps_in_backward_by_default(tmp_path, step_in_backward):
    """Shards beyond ``host_memory_limit`` in files, their gradients copied off the GPU into host buffers: by default
    each disk chunk steps during backward from those buffers ([Note: stepping in backward by default]);
    with ``step_in_backward=False`` after backward, through the gradient files. Both as plain Lightning."""
    kw = dict(steps=12, accelerator="gpu", model_kwargs=dict(dim=64, hidden=1024))
    ref = fit("auto", **kw)
    strategy = ChunkOffloadStrategy(
        placement="host",
        host_memory_limit="3MB",
        step_in_backward=step_in_backward,
        memory=MemoryOptions(chunk_numel=66560),
        offload=OffloadOptions(disk_dir=tmp_path / "scratch"),
    )
    got = fit(strategy, **kw)
    assert_same_params(ref, got, TOL)
    s = strategy.memory_stats()
    assert s["disk_shards"] >= 3 and s["disk_read_bytes"] > 0 and s["disk_write_bytes"] > 0
    assert (s.get("chunks_stepped_in_backward", 0) > 0) == (step_in_backward is None)
    assert list((tmp_path / "scratch").iterdir()) == []


@pytest.mark.parametrize("pin", [True, "exact", False])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_save_in_the_background_holds_the_state_at_the_save(tmp_path, placement, pin):
    """Device-tier shards go to host memory pinned as ``pin_memory`` says when the save starts, host ones are copied
    aside by the steps beside it ([Note: training beside a save]): the checkpoint equals a synchronous one of the
    same state."""
    from lightning_chunk.engine.state import checkpoint
    from tests.engine_steps import step
    from tests.faults.common import same_tensors, saved_tensors

    def engine():
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]).cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        config = ChunkConfig(placement=placement, chunk_numel=70_000, pin_memory=pin)
        return ChunkEngine(model, [opt], config=config, device=torch.device("cuda")), model, opt

    xs = [torch.randn(8, 256, device="cuda") for _ in range(4)]
    eng, model, opt = engine()
    for x in xs[:2]:
        step(eng, model, opt, x)
    checkpoint.save_sharded(eng, tmp_path / "sync.ckpt", {}, with_optimizer=True)
    save = checkpoint.save_sharded(eng, tmp_path / "bg.ckpt", {}, with_optimizer=True, background=True)
    for x in xs[2:]:
        step(eng, model, opt, x)
    eng.manager.readers.settle()
    assert save is not None and (placement == "host" or save.aside_bytes > 0)
    assert same_tensors(saved_tensors(tmp_path / "bg.ckpt"), saved_tensors(tmp_path / "sync.ckpt"))
    eng.teardown()


@pytest.mark.parametrize("placement", ["device", "host", "auto"])
def test_the_whole_optimizer_state_read_and_reset_on_cuda_is_plain_lightnings(placement):
    """[Note: the whole optimizer state of a parameter] where the kernels keep their own: torch's fused step on a
    device shard holds its count on the GPU, the one pass a host chunk's moments in regions (bf16-mixed)."""
    from tests.integration.test_full_optimizer_state import RESET_AT, ReadsAndResets

    run = dict(steps=6, cls=ReadsAndResets, accelerator="gpu", precision="bf16-mixed")
    ref = fit("auto", **run)
    kw = dict(device_memory_limit="24MiB") if placement == "auto" else {}
    got = fit(ChunkOffloadStrategy(placement=placement, memory=MemoryOptions(chunk_numel=4096), **kw), **run)
    assert_same_params(ref, got, TOL)
    for a, b in zip(ref.seen, got.seen, strict=True):
        assert a.keys() == b.keys()
        for n in a:
            assert a[n].keys() == b[n].keys()
            for k in a[n]:
                torch.testing.assert_close(b[n][k].cpu(), a[n][k].cpu(), msg=f"{n}.{k}", **TOL)
    assert float(got.seen[RESET_AT + 1]["head.weight"]["step"]) == 1.0


@pytest.mark.parametrize("placement", ["device", "host"])
def test_the_state_norms_on_cuda_are_plain_lightnings(placement):
    """[Note: optimizer state norms from the pieces] with a device shard's moments on the GPU."""
    from tests.integration.test_state_norms import LogsStateNorms

    run = dict(steps=4, cls=LogsStateNorms, accelerator="gpu", precision="bf16-mixed")
    ref = fit("auto", **run)
    got = fit(ChunkOffloadStrategy(placement=placement, memory=MemoryOptions(chunk_numel=4096)), **run)
    for a, b in zip(ref.norms, got.norms, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k].cpu(), a[k].cpu(), msg=k, **TOL)
