"""Lightning's ModelParallelStrategy (FSDP2) saves its sharded directory on two ranks; chunk_offload resumes it on two
ranks and on one with its defaults, under device limits, with accumulation, against resuming the plain file made of
it ([Note: resuming a peer's sharded checkpoint]; the formats one by one: ``test_peer_checkpoints.py``)."""

from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.options import grouped
from tests.distributed.launch import AS_NCCL, ROUNDING, run
from tests.distributed.peer_cases import SHAPE, Sharded, device_limit
from tests.models import quiet_trainer, token_data

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's


def same(got: dict, want: dict, **tol) -> None:
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, msg=lambda m: f"{k}: {m}", **(tol or dict(rtol=0, atol=0)))


def test_a_model_parallel_directory_resumes_on_two_ranks_and_on_one(tmp_path: Path):
    rc, log, _ = run(tmp_path, "peer_resume", timeout=300, env=AS_NCCL)  # one communicator, as NCCL has it
    assert rc == 0 and "CASE-DONE peer_resume rank=1" in log, log[-3000:]
    d = torch.load(tmp_path / "peer_resume.pt")
    same(d["dir"], d["file"])  # the directory read a parameter at a time gives what the whole file gives
    same(d["dir"], d["ddp"], **ROUNDING["accumulate"])  # each micro-batch reduce-scattered, as DDP to fp32 rounding
    out = {}
    for name, path in [("auto", "fsdp2_plain.ckpt"), ("chunk", "fsdp2.ckpt")]:
        L.seed_everything(11, verbose=False)
        model = Sharded(**SHAPE)
        limit = device_limit(model, 0)
        strategy = (
            "auto"
            if name == "auto"
            else ChunkOffloadStrategy(**grouped(dict(device_memory_limit=limit, optimizer_kernel="loop")))
        )
        trainer = quiet_trainer(
            strategy=strategy, max_steps=7, limit_val_batches=0, num_sanity_val_steps=0, accumulate_grad_batches=2
        )
        trainer.fit(model, token_data(), ckpt_path=tmp_path / path)
        out[name] = model.state_dict()
    same(out["chunk"], out["auto"])
