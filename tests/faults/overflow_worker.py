"""One rank of a two-rank fp16 fit where one rank's gradients hold an inf at one step, or of the run in which
that step never happened.

    RANK=r ... python overflow_worker.py DIR MODE

``MODE=faulty``: at global step ``K`` rank 1 puts an inf into one element of ``embed.weight``'s gradient before
it is reduce-scattered (rank 0's gradients stay finite). ``MODE=reference``: the same run without the global
batch of step ``K`` and with the loss scale halved from that point on, as the skipped step halves it; one step
fewer. Each rank saves its own shards (masters and Adam state), its loss scale at the start of every step, and
which steps changed its parameters, to ``DIR/<MODE>.rank<r>.pt``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_chunk import CheckOptions, ChunkOffloadStrategy, ChunkPrecision, MemoryOptions  # noqa: E402  # noqa: E402
from tests.models import SEQ, VOCAB, ParityNet, quiet_trainer  # noqa: E402

K, STEPS, BATCH = 3, 7, 4


def data(mode: str, rank: int) -> DataLoader:
    """This rank's batches in order (Lightning's distributed sampler would shuffle them)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (2, STEPS, BATCH, SEQ), generator=g)[rank]
    if mode == "reference":
        x = torch.cat([x[:K], x[K + 1 :]])
    x = x.reshape(-1, SEQ)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=BATCH, shuffle=False)


class Recorder(L.Callback):
    def __init__(self, mode: str) -> None:
        self.mode, self.scales, self.changed, self._before = mode, [], [], None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        scaler = trainer.strategy.precision_plugin.scaler
        if self.mode == "reference" and trainer.global_step == K:
            scaler.scale *= scaler.backoff_factor  # what the skipped step did to the scale
        self.scales.append(scaler.scale)
        self._before = [c.master.clone() for c in trainer.strategy.engine.manager.chunks]
        if self.mode == "faulty" and trainer.global_step == K and trainer.global_rank == 1:
            w = module.embed.weight
            self._hook = w.register_hook(lambda g: g.clone().index_fill_(0, torch.tensor([5]), float("inf")))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if getattr(self, "_hook", None) is not None:
            self._hook.remove()
            self._hook = None
        after = [c.master for c in trainer.strategy.engine.manager.chunks]
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self._before, after, strict=True)))

    def on_train_end(self, trainer, module):
        eng = trainer.strategy.engine
        b = eng.bindings[0]
        state = {}
        for i, view in sorted(b.views().items()):
            for k, v in b.optimizer.state.get(view, {}).items():
                state[f"{i}.{k}"] = v.clone() if torch.is_tensor(v) else torch.tensor(v)
        torch.save(
            {
                "masters": [c.master.clone() for c in eng.manager.chunks],
                "state": state,
                "scales": self.scales,
                "changed": self.changed,
                "final_scale": trainer.strategy.precision_plugin.scaler.scale,
            },
            Path(sys.argv[1]) / f"{self.mode}.rank{trainer.global_rank}.pt",
        )


def main() -> None:
    mode = sys.argv[2]  # argv[1]: the output folder, unused here
    L.seed_everything(7, verbose=False)
    t = quiet_trainer(
        devices=2,
        strategy=ChunkOffloadStrategy(
            placement="host", memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(collective_timeout_s=60)
        ),
        plugins=[ChunkPrecision("16-mixed")],
        max_steps=STEPS if mode == "faulty" else STEPS - 1,
        limit_val_batches=0,
        callbacks=[Recorder(mode)],
        use_distributed_sampler=False,
    )
    t.fit(
        ParityNet(scheduler=False), data(mode, int(os.environ["RANK"]))
    )  # Lightning steps a scheduler on a skipped step too
    print(f"DONE {mode} rank={t.global_rank}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
