"""One rank of a two-rank run in which only rank 1's inputs grow after the warm-up (its sequence length
quadruples from batch 5 on: the second micro-batch of an accumulation window), under a device limit: DDP, then
chunk_offload with its defaults (automatic chunk size, ``auto`` placement), on the same per-rank batches, on a
model whose use order differs from its registration order, accumulating 2 micro-batches a step.

    RANK=r ... python grow_worker.py DIR

Rank 0 saves both state dicts to ``DIR/grow.pt``; each rank saves its ``memory_stats()`` to ``DIR/stats<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_chunk import (  # noqa: E402
    CheckOptions,
    ChunkOffloadStrategy,  # noqa: E402
    OffloadOptions,
)
from tests.models import VOCAB, ReorderedNet, quiet_trainer  # noqa: E402

SHAPE = dict(dim=64, hidden=256, depth=4)
GROW_AT, BATCHES, LIMIT = 5, 12, 2_200_000


def batches(rank: int) -> DataLoader:
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for i in range(BATCHES):
        seq = 32 if (rank == 1 and i >= GROW_AT) else 8
        x = torch.randint(0, VOCAB, (4, seq), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return DataLoader(out, batch_size=None)


def fit(strategy) -> tuple[L.Trainer, ReorderedNet]:
    L.seed_everything(7, verbose=False)
    model = ReorderedNet(**SHAPE)
    t = quiet_trainer(
        devices=2,
        strategy=strategy,
        max_steps=BATCHES // 2,
        limit_val_batches=0,
        use_distributed_sampler=False,
        accumulate_grad_batches=2,
    )
    t.fit(model, batches(int(os.environ["RANK"])))
    return t, model


def main() -> None:
    out = Path(sys.argv[1])
    _, ref = fit(DDPStrategy())
    strategy = ChunkOffloadStrategy(
        device_memory_limit=LIMIT,
        offload=OffloadOptions(optimizer_kernel="loop"),
        checks=CheckOptions(collective_timeout_s=60),
    )
    t, got = fit(strategy)
    (out / f"stats{t.global_rank}.json").write_text(json.dumps(strategy.memory_stats()))
    if t.global_rank == 0:
        torch.save({"ref": ref.state_dict(), "got": got.state_dict()}, out / "grow.pt")
    print(f"DONE rank={t.global_rank}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
