"""One rank of a two-rank Lightning fit under chunk_offload, started as its own process (as torchrun or SLURM
start ranks), in which one rank dies or stops at a chosen point of a step.

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python step_worker.py DIR WHERE

``WHERE`` is ``<rank>:<what>:<n>:<how>``: when rank ``<rank>`` enters its ``<n>``-th ``all_gather``,
``reduce_scatter`` or optimizer ``step``, it is sent ``SIGKILL`` (``how=kill``: it dies) or ``SIGSTOP``
(``how=stop``: it hangs, alive). It writes the time just before to ``DIR/fault.json``. The ranks save a
checkpoint every 2 steps into ``DIR/ckpt`` (steps 2 and 4 happen before any fault point used by the tests).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_chunk import (  # noqa: E402
    CheckOptions,
    ChunkOffloadStrategy,  # noqa: E402
    MemoryOptions,
)
from lightning_chunk.engine.comm.collectives import Collectives  # noqa: E402
from lightning_chunk.engine.optim.binding import OptimizerBinding  # noqa: E402
from tests.models import ParityNet, quiet_trainer, token_data  # noqa: E402

TIMEOUT_S = 6.0


def arm(out: Path, where: str) -> None:
    rank, what, n, how = where.split(":")
    if int(rank) != int(os.environ["RANK"]):
        return
    owner, attr = {
        "all_gather": (Collectives, "all_gather"),
        "reduce_scatter": (Collectives, "reduce_scatter"),
        "step": (OptimizerBinding, "step"),
    }[what]
    fn, count = getattr(owner, attr), [0]

    def hooked(*a, **k):
        count[0] += 1
        if count[0] == int(n):
            (out / "fault.json").write_text(json.dumps({"time": time.time(), "pid": os.getpid()}))
            os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        return fn(*a, **k)

    setattr(owner, attr, hooked)


def main() -> None:
    out, where = Path(sys.argv[1]), sys.argv[2]
    import faulthandler

    faulthandler.enable()  # a crash in native code (SIGSEGV, SIGABRT) prints its stack instead of nothing
    # only a net for a real hang (the test waits 180 s and measures the survivor from the fault, not from here): at
    # 25 s it could fire on a slow CI machine before the survivor's own bounded wait ended (a whole run takes
    # about 9 s here, under two busy loops too), and the survivor then ended with a traceback dump instead
    faulthandler.dump_traceback_later(120, exit=True)
    arm(out, where)
    L.seed_everything(7, verbose=False)
    cb = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_last=True, filename="{step}")
    t = quiet_trainer(
        devices=2,
        strategy=ChunkOffloadStrategy(
            placement="host",
            step_in_backward=False,  # the optimizer step a fault hits is the one after backward
            memory=MemoryOptions(chunk_numel=4096),
            checks=CheckOptions(collective_timeout_s=TIMEOUT_S),
        ),
        max_steps=12,
        limit_val_batches=0,
        callbacks=[cb],
        enable_checkpointing=True,
    )
    t.fit(ParityNet(variant="tied"), token_data())
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
