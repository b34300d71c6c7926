"""One rank of a two-rank fit whose callback runs a forward (``WHAT=forward``), saves a checkpoint (``WHAT=save``)
or reads a weight inside ``full_parameters()`` (``WHAT=full_parameters``) at the end of each epoch: on every rank
after the first epoch, on rank 0 alone after the second ([Note: a forward outside a step] in
``engine/comm/group.py``).

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python alone_worker.py DIR WHAT

Each rank prints ``DONE <epoch> <value>`` for each call it finished; gloo runs as NCCL does (one
communicator, no agreement check), so nothing but the roll call stands between rank 0's lone call and a hang.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["LIGHTNING_CHUNK_GLOO_AS_NCCL"] = "1"

import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_chunk import ChunkOffloadStrategy  # noqa: E402
from lightning_chunk.options import grouped  # noqa: E402
from tests.models import ParityNet, quiet_trainer, token_data  # noqa: E402

TIMEOUT_S = 3.0


class EveryEpoch(L.Callback):
    def __init__(self, out: Path, what: str) -> None:
        self.out, self.what = out, what

    def on_train_epoch_end(self, trainer, pl_module):
        epoch = trainer.current_epoch
        if epoch == 0 or trainer.is_global_zero:
            if self.what == "save":
                trainer.save_checkpoint(self.out / f"epoch{epoch}.ckpt")
                value = (self.out / f"epoch{epoch}.ckpt").is_dir()
            elif self.what == "full_parameters":
                with trainer.strategy.full_parameters():
                    value = pl_module.head.weight.sum().item()
            elif self.what == "full_optimizer_state":  # logging Adam's moments on rank 0, as a user might
                with trainer.strategy.full_optimizer_state(pl_module.head) as state:
                    value = state[pl_module.head.weight]["exp_avg"].sum().item()
            else:
                with torch.no_grad():
                    value = pl_module(torch.arange(8).view(1, 8)).float().sum().item()
            print(f"DONE {epoch} {value!r}", flush=True)


def main() -> None:
    out, what = Path(sys.argv[1]), sys.argv[2]
    L.seed_everything(7, verbose=False)
    strategy = ChunkOffloadStrategy(**grouped({"placement": "host", "collective_timeout_s": TIMEOUT_S}))
    t = quiet_trainer(
        devices=2, strategy=strategy, max_epochs=3, limit_train_batches=3, callbacks=[EveryEpoch(out, what)]
    )
    t.fit(ParityNet(), token_data())
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
