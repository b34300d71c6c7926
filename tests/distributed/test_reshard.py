"""Checkpoints change world size: 2 ranks -> 1 and 1 -> 2, against DDP / auto following the same schedule."""

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.options import grouped
from tests.distributed.launch import run
from tests.models import ParityNet, quiet_trainer, token_data

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

EXACT = dict(rtol=0, atol=0)


def one_rank(strategy, steps, **kw):
    return quiet_trainer(
        strategy=strategy, max_steps=steps, limit_val_batches=0, **{"enable_checkpointing": True, **kw}
    )


def chunk(**kw):
    return ChunkOffloadStrategy(**grouped({**kw, "chunk_numel": 4096, "optimizer_kernel": "loop"}))


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path: Path):
    rc, log, _ = run(tmp_path, "reshard_save", timeout=300)
    assert "CASE-DONE reshard_save rank=0" in log and "CASE-DONE reshard_save rank=1" in log, log[-3000:]
    assert (tmp_path / "from2_chunk" / "step=8.ckpt" / "meta.pt").is_file()
    out = {}
    for name, strategy in [("ddp", "auto"), ("chunk", chunk(placement="device"))]:
        L.seed_everything(11, verbose=False)
        model = ParityNet(variant="tied")
        one_rank(strategy, 12, enable_checkpointing=False).fit(
            model, token_data(), ckpt_path=tmp_path / f"from2_{name}" / "step=8.ckpt"
        )
        out[name] = model
    for a, b in zip(out["ddp"].parameters(), out["chunk"].parameters(), strict=True):
        torch.testing.assert_close(b, a, **EXACT)


def test_one_rank_checkpoint_resumes_on_two_ranks(tmp_path: Path):
    """With frozen layers, whose chunks saved no optimizer state, read by each rank's regions."""
    for name, strategy in [("auto", "auto"), ("chunk", chunk(placement="host"))]:
        L.seed_everything(11, verbose=False)
        cb = ModelCheckpoint(dirpath=tmp_path / f"from1_{name}", every_n_train_steps=8, filename="{step}")
        one_rank(strategy, 8, callbacks=[cb]).fit(ParityNet(variant="frozen"), token_data())
    rc, log, _ = run(tmp_path, "reshard_resume", timeout=300)
    assert "CASE-DONE reshard_resume rank=0" in log and "CASE-DONE reshard_resume rank=1" in log, log[-3000:]
    d = torch.load(tmp_path / "reshard_resume.pt")
    for k, v in d["ref"].items():
        torch.testing.assert_close(d["got"][k], v, msg=lambda m: f"{k}: {m}", **EXACT)
