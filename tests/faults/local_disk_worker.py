"""One rank of a two-node fit (one rank a node) whose checkpoint path is on storage each node has to itself: every
rank works in a directory of its node's and saves to ``/proc/self/cwd/ckpt``, one path naming another directory on
each node, as ``/local/ckpt`` on a node-local disk does ([Note: one directory every rank sees]).

    RANK=r LOCAL_RANK=0 NODE_RANK=r WORLD_SIZE=2 MASTER_ADDR MASTER_PORT python local_disk_worker.py DIR [MODE]

Prints ``SAVE-FAILED <error>`` for the node-local save (in a step, where every rank writes its shards) and
``SAVED-SHARED`` once a save to a shared path after it worked; ``FIT-DONE`` when training went on to its end. MODE
``resume``: a fit resumed from ``/proc/self/cwd/ckpt``, which only node 0 holds; ``RESUME-FAILED <error>``. MODE
``weights``: a fit from ``weights="/proc/self/cwd/w.pt"``, which only node 0 holds; ``WEIGHTS-FAILED <error>``."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from lightning_chunk.engine.state import checkpoint_dir  # noqa: E402
from tests.distributed.harness import chunk_strategy, trainer  # noqa: E402
from tests.models import ParityNet, token_data  # noqa: E402

checkpoint_dir.SEEN_WITHIN_S = 1.0  # the storage here shows a new file at once


class SaveBoth(L.Callback):
    """After the second step, on every rank: a save to the node-local path, then one to the shared ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 2:
            return
        try:
            trainer.save_checkpoint("/proc/self/cwd/ckpt")
            print("SAVED-LOCAL", flush=True)
        except Exception as e:  # noqa: BLE001 - the test reads it
            print(f"SAVE-FAILED {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
        trainer.save_checkpoint(self.out / "shared.ckpt")
        print("SAVED-SHARED", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    node = out / f"node{os.environ['NODE_RANK']}"
    node.mkdir(exist_ok=True)
    os.chdir(node)
    if sys.argv[2:] == ["weights"]:
        t = trainer(chunk_strategy(placement="host", chunk_numel=4096, weights="/proc/self/cwd/w.pt"), steps=2)
        try:
            t.fit(ParityNet(), token_data())
            print("FIT-DONE", flush=True)
        except Exception as e:  # noqa: BLE001 - the test reads it
            print(f"WEIGHTS-FAILED {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
        return
    if sys.argv[2:] == ["resume"]:
        t = trainer(chunk_strategy(placement="host", chunk_numel=4096), steps=4)
        try:
            t.fit(ParityNet(), token_data(), ckpt_path="/proc/self/cwd/ckpt")
        except Exception as e:  # noqa: BLE001 - the test reads it
            print(f"RESUME-FAILED {type(e).__name__}: {' '.join(str(e).split())}", flush=True)
        return
    t = trainer(chunk_strategy(placement="host", chunk_numel=4096), steps=3, callbacks=[SaveBoth(out)])
    t.fit(ParityNet(), token_data())
    print("FIT-DONE", flush=True)


if __name__ == "__main__":
    main()
