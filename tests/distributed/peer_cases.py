"""A two-rank case about a peer's checkpoint: Lightning's ``ModelParallelStrategy`` (FSDP2) trains and saves its
sharded directory, which two ranks resume under chunk_offload, against DDP resuming the same state from a plain file
([Note: resuming a peer's sharded checkpoint])."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from tests.distributed.harness import chunk_strategy, trainer
from tests.models import ParityNet, token_data


class Sharded(ParityNet):
    """ParityNet with each block and the root sharded by ``fully_shard`` under ModelParallelStrategy."""

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self, mesh=self.device_mesh["data_parallel"])


def plain_file(directory: Path, file: Path) -> None:
    """A sharded directory of Lightning's as one plain checkpoint file, as Lightning's consolidation writes it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(directory, file)
    checkpoint = torch.load(file, weights_only=False)
    checkpoint.update(torch.load(directory / "meta.pt", weights_only=False))
    checkpoint["optimizer_states"] = [checkpoint.pop("optimizer_0")]
    torch.save(checkpoint, file)


def run_peer_resume(out: Path) -> None:
    """ModelParallel for 4 steps, then from its directory to step 8: DDP from the plain file made of it, chunk_offload
    (host placement, an evicting device limit) from the directory itself."""
    L.seed_everything(11, verbose=False)
    t = trainer(ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), steps=4)
    t.fit(Sharded(variant="tied"), token_data())
    t.save_checkpoint(out / "fsdp2.ckpt")
    if t.global_rank == 0:
        plain_file(out / "fsdp2.ckpt", out / "fsdp2_plain.ckpt")
    t.strategy.barrier()
    results = {}
    for name, strategy, path in [
        ("ddp", "ddp", out / "fsdp2_plain.ckpt"),
        ("chunk", chunk_strategy(placement="host", chunk_numel=4096), out / "fsdp2.ckpt"),
    ]:
        L.seed_everything(11, verbose=False)
        model = Sharded(variant="tied")
        t = trainer(strategy, steps=8)
        t.fit(model, token_data(), ckpt_path=path)
        results[name] = model.state_dict()
    if t.global_rank == 0:
        torch.save({"ref": results["ddp"], "got": results["chunk"]}, out / "peer_resume.pt")
    print(f"CASE-DONE peer_resume rank={t.global_rank}", flush=True)
