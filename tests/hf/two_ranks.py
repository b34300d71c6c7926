"""GPT-2 fine-tuned from a save_pretrained directory on two gloo ranks: DDP (``from_pretrained`` on every rank)
against chunk_offload (built on the meta device, each rank reading its shards' pieces of the files) under a device
limit that evicts; chunk_offload also saves a sharded checkpoint at the end.

    python tests/hf/two_ranks.py OUTDIR PRETRAINED_DIR
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from lightning_chunk import ChunkOffloadStrategy  # noqa: E402
from tests.hf.models import Batches, load_example  # noqa: E402

STEPS, LIMIT = 6, 3_000_000


def fit(strategy, pretrained: str, **kw) -> tuple[L.Trainer, L.LightningModule]:
    L.seed_everything(3, verbose=False)  # every rank: the same dropout masks under both strategies
    model = load_example().CausalLM(pretrained=pretrained, lr=1e-3, warmup_steps=1)
    t = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                  enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                  **kw)
    t.fit(model, Batches(n=64))
    return t, model


if __name__ == "__main__":
    out, pretrained = Path(sys.argv[1]), sys.argv[2]
    _, ref = fit(DDPStrategy(), pretrained, enable_checkpointing=False)
    strategy = ChunkOffloadStrategy(device_memory_limit=LIMIT, chunk_numel=16384, optimizer_kernel="loop",
                                    collective_timeout_s=60)
    t, got = fit(strategy, pretrained, callbacks=[ModelCheckpoint(dirpath=out, filename="last")])
    rank = t.global_rank
    (out / f"stats{rank}.json").write_text(json.dumps(strategy.memory_stats()))
    if rank == 0:
        torch.save({"ref": ref.state_dict(), "got": got.state_dict()}, out / "params.pt")
    print(f"CASE-DONE hf_gpt2 rank={rank}", flush=True)
    torch.distributed.destroy_process_group()
