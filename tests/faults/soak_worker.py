"""One rank of a two-rank soak: 1000 steps under a device limit that evicts every step, saving every 50 steps
(top 2 plus last), or the same run without saving.

    RANK=r ... python soak_worker.py DIR MODE STEPS     (MODE: save | nosave)

Each rank writes ``DIR/<MODE>.rank<r>.json``: its peak RSS (KiB) after each save, its open file descriptors
after each save, and the evictions and device bytes after each step; rank 0 saves the final parameters to
``DIR/<MODE>.pt``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_chunk import (  # noqa: E402
    CheckOptions,
    ChunkOffloadStrategy,  # noqa: E402
    MemoryOptions,
    OffloadOptions,
)
from tests.models import SEQ, VOCAB, ParityNet, quiet_trainer  # noqa: E402

SHAPE = dict(dim=32, hidden=128, depth=3)
LIMIT = 200_000  # the activations (~130 kB) leave room for fewer than all chunks: some are evicted every step


class Watch(L.Callback):
    def __init__(self) -> None:
        self.after_save, self.fds, self.evictions, self._last = [], [], [], 0
        self.device_bytes: list[int] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        stats = trainer.strategy.memory_stats()
        ev = stats["evictions"]
        self.device_bytes.append(int(stats["device_chunk_bytes"]))
        self.evictions.append(ev - self._last)
        self._last = ev
        if trainer.global_step % 50 == 0:  # ModelCheckpoint saved in this hook's batch, before this callback ran
            self.after_save.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            self.fds.append(len(os.listdir("/proc/self/fd")))


def main() -> None:
    out, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (64, SEQ), generator=g)
    data = DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=4, shuffle=False)
    watch = Watch()
    callbacks = (
        [
            ModelCheckpoint(
                dirpath=out / "ckpt",
                every_n_train_steps=50,
                save_top_k=2,
                monitor="step",
                mode="max",
                save_last=True,
                filename="{step}",
            )
        ]
        if mode == "save"
        else []
    )
    L.seed_everything(7, verbose=False)
    t = quiet_trainer(
        devices=2,
        strategy=ChunkOffloadStrategy(
            placement="auto",
            device_memory_limit=LIMIT,
            memory=MemoryOptions(chunk_numel=4096),
            offload=OffloadOptions(optimizer_kernel="loop"),
            checks=CheckOptions(collective_timeout_s=60, log_memory_stats=False),
        ),
        max_steps=steps,
        limit_val_batches=0,
        callbacks=callbacks + [watch],
        enable_checkpointing=mode == "save",
    )
    model = ParityNet(scheduler=False, **SHAPE)
    t.fit(model, data)
    (out / f"{mode}.rank{rank}.json").write_text(
        json.dumps(
            {
                "rss_kib_after_save": watch.after_save,
                "fds_after_save": watch.fds,
                "evictions": watch.evictions,
                "device_bytes": watch.device_bytes,
            }
        )
    )
    if rank == 0:
        torch.save(model.state_dict(), out / f"{mode}.pt")
    print(f"DONE {mode} rank={rank}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
