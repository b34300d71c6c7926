"""Lightning's ModelParallelStrategy (FSDP2) saves its sharded directory on two ranks; chunk_offload resumes it on two
ranks and on one, each against plain Lightning (DDP, ``auto``) resuming the same state from a plain file ([Note:
resuming a peer's sharded checkpoint]; the formats one by one: ``tests/integration/test_peer_checkpoints.py``)."""

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.options import grouped
from tests.distributed.launch import run
from tests.distributed.peer_cases import Sharded
from tests.models import quiet_trainer, token_data

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's


def test_a_model_parallel_directory_resumes_on_two_ranks_and_on_one(tmp_path: Path):
    rc, log, _ = run(tmp_path, "peer_resume", timeout=300)
    assert rc == 0 and "CASE-DONE peer_resume rank=1" in log, log[-3000:]
    d = torch.load(tmp_path / "peer_resume.pt")
    for k, v in d["ref"].items():
        torch.testing.assert_close(d["got"][k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
    out = {}
    for name, strategy, path in [
        ("auto", "auto", tmp_path / "fsdp2_plain.ckpt"),
        ("chunk", ChunkOffloadStrategy(**grouped(dict(optimizer_kernel="loop", device_memory_limit=120_000))), None),
    ]:
        L.seed_everything(11, verbose=False)
        model = Sharded(variant="tied")
        trainer = quiet_trainer(strategy=strategy, max_steps=8, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(model, token_data(), ckpt_path=path or tmp_path / "fsdp2.ckpt")
        out[name] = model.state_dict()
    for k, v in out["auto"].items():
        torch.testing.assert_close(out["chunk"][k], v, rtol=0, atol=0, msg=lambda m: f"{k}: {m}")
