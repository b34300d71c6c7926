"""A two-rank case about a peer's checkpoint: Lightning's ``ModelParallelStrategy`` (FSDP2) trains and saves its
sharded directory, which two ranks resume under chunk_offload, against DDP resuming the same state from a plain file
([Note: resuming a peer's sharded checkpoint])."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from tests.distributed.harness import chunk_strategy, trainer
from tests.models import ReorderedNet, token_data

SHAPE = dict(variant="tied", dim=64, hidden=256, depth=3)


class Sharded(ReorderedNet):
    """A tied head, parameters registered in another order than they are used; each block and the root sharded by
    ``fully_shard`` under ModelParallelStrategy."""

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self, mesh=self.device_mesh["data_parallel"])


def device_limit(model: torch.nn.Module, rank: int) -> int:
    """Limits that differ by rank and evict: the parameters' bytes times 1.3 on rank 0, 1.6 on the others (the traced
    activations take about 0.6 of them)."""
    return int(sum(p.numel() * p.element_size() for p in model.parameters()) * (1.3 if rank == 0 else 1.6))


def plain_file(directory: Path, file: Path) -> None:
    """A sharded directory of Lightning's as one plain checkpoint file, as Lightning's consolidation writes it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, file)
    checkpoint = torch.load(file, weights_only=False)
    checkpoint.update(torch.load(directory / "meta.pt", weights_only=False))
    checkpoint["optimizer_states"] = [checkpoint.pop("optimizer_0")]
    torch.save(checkpoint, file)


def run_peer_resume(out: Path) -> None:
    """ModelParallel for 3 steps of 2 micro-batches, then to step 7: DDP from the plain file made of its directory;
    chunk_offload with its defaults (the automatic chunk size) under device limits that differ by rank, from the
    directory itself and from the plain file."""
    rank = int(os.environ["RANK"])
    L.seed_everything(11, verbose=False)
    t = trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), steps=3, accumulate_grad_batches=2)
    t.fit(Sharded(**SHAPE), token_data())
    t.save_checkpoint(out / "fsdp2.ckpt")
    if t.global_rank == 0:
        plain_file(out / "fsdp2.ckpt", out / "fsdp2_plain.ckpt")
    t.strategy.barrier()
    results = {}
    for name, path in [("ddp", "fsdp2_plain.ckpt"), ("dir", "fsdp2.ckpt"), ("file", "fsdp2_plain.ckpt")]:
        L.seed_everything(11, verbose=False)
        model = Sharded(**SHAPE)
        strategy = "ddp" if name == "ddp" else chunk_strategy(device_memory_limit=device_limit(model, rank))
        t = trainer(strategy, steps=7, accumulate_grad_batches=2)
        t.fit(model, token_data(), ckpt_path=out / path)
        results[name] = model.state_dict()
    if t.global_rank == 0:
        torch.save(results, out / "peer_resume.pt")
    print(f"CASE-DONE peer_resume rank={t.global_rank}", flush=True)
