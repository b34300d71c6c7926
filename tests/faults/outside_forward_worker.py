"""One rank of a two-rank fit whose callback runs a forward at the end of each epoch: on every rank after the first
epoch, on rank 0 alone after the second ([Note: a forward outside a step] in ``engine/comm/group.py``).

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python outside_forward_worker.py DIR

Each rank prints ``SAMPLE <epoch> <value>`` for each forward it ran; gloo runs as NCCL does (one communicator, no
agreement check), so nothing but the roll call stands between rank 0's lone forward and a hang.
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


class Samples(L.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0 or trainer.is_global_zero:
            with torch.no_grad():
                value = pl_module(torch.arange(8).view(1, 8)).float().sum().item()
            print(f"SAMPLE {trainer.current_epoch} {value!r}", flush=True)


def main() -> None:
    L.seed_everything(7, verbose=False)
    strategy = ChunkOffloadStrategy(**grouped({"placement": "host", "collective_timeout_s": TIMEOUT_S}))
    t = quiet_trainer(devices=2, strategy=strategy, max_epochs=3, limit_train_batches=3, callbacks=[Samples()])
    t.fit(ParityNet(), token_data())
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
