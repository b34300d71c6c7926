"""One rank of a two-rank fit started as ``srun`` starts it, with ``SLURMEnvironment``'s auto-requeue: at step AT each
rank sends itself a signal (``USR1``, the requeue signal, or ``TERM``; ``NONE`` sends none) from the forward of
another module (rank 0 early, rank 1 late), as a signal SLURM sends every task lands wherever each rank's main thread
is ([Note: signals on several ranks] in ``lightning_chunk/signals.py``). A ``ModelCheckpoint`` saves every step
beside it.

    RANK=r LOCAL_RANK=r WORLD_SIZE=2 MASTER_ADDR MASTER_PORT python requeue_worker.py DIR USR1|TERM|NONE [MODE]

Prints ``SIGNALLED <rank> <module>`` where each signal was sent, ``FIT-DONE`` at the end, or ``FIT-FAILED <error>
at step <n>``. MODE ``validate``: a validation alone, signalled at its third batch (``VALIDATE-...``); ``sanity``:
the same in a fit's sanity check; ``requeued``: the job SLURM starts again, no signal (``STARTED AT STEP <n>``,
``REQUEUED-DONE at step <n>``)."""

from __future__ import annotations

import os
import signal
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from tests.distributed.harness import chunk_strategy, trainer  # noqa: E402
from tests.models import ParityNet, token_data  # noqa: E402

AT = 5
LIMIT = 200_000  # rank 0's device limit in bytes; rank 1 has twice it


class SignalledInForward(ParityNet):
    """Signals itself once: in a fit at step AT, in a validation alone at its third batch."""

    def on_fit_start(self):
        self._arm(lambda: self.trainer.global_step == AT)

    def on_validation_start(self):
        if self.trainer.sanity_checking or self.trainer.state.fn != "fit":
            loop = (
                self.trainer.fit_loop.epoch_loop.val_loop
                if self.trainer.sanity_checking
                else self.trainer.validate_loop
            )
            self._arm(lambda: loop.batch_progress.current.ready == 3)

    def _arm(self, due):
        owners = [m for m in self.modules() if list(m.parameters(recurse=False))]
        name = {m: n for n, m in self.named_modules()}
        rank = os.environ["SLURM_PROCID"]
        target = owners[1] if rank == "0" else owners[-2]

        def hook(module, args):
            if due() and not getattr(self, "_sent", False):
                self._sent = True
                print(f"SIGNALLED {rank} {name[module]}", flush=True)
                os.kill(os.getpid(), getattr(signal, "SIG" + sys.argv[2]))

        target.register_forward_pre_hook(hook)


class Started(Callback):
    def on_train_start(self, trainer, pl_module):
        print(f"STARTED AT STEP {trainer.global_step}", flush=True)


def _fit_trainer(out: Path, rank: str, callback: Callback):
    """As a user runs: the automatic chunk size, device limits that differ by rank, accumulation."""
    strategy = chunk_strategy(chunk_numel=None, chunk_numel_min=4096, device_memory_limit=LIMIT * (1 + int(rank)))
    t = trainer(strategy, steps=AT + 3, default_root_dir=str(out), accumulate_grad_batches=2)
    t.callbacks.append(callback)  # after: the quiet trainer's enable_checkpointing=False refuses a ModelCheckpoint
    return t


def main() -> None:
    out, rank = Path(sys.argv[1]), os.environ["RANK"]
    os.environ.update(  # as srun sets them for a job of two tasks on one node: Lightning takes SLURMEnvironment
        SLURM_NTASKS="2", SLURM_PROCID=rank, SLURM_LOCALID=rank, SLURM_NODEID="0", SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="train", SLURM_NODELIST="localhost", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE="2",
    )  # fmt: skip
    if sys.argv[3:] in (["validate"], ["sanity"]):
        sanity = sys.argv[3] == "sanity"
        strategy = chunk_strategy(placement="host", chunk_numel=4096)
        t = trainer(strategy, default_root_dir=str(out), limit_val_batches=8, num_sanity_val_steps=8 if sanity else 0)
        loop = t.fit_loop.epoch_loop.val_loop if sanity else t.validate_loop
        try:
            if sanity:
                t.fit(SignalledInForward(), token_data(), token_data())
            else:
                t.validate(SignalledInForward(), token_data())
        except BaseException as e:  # noqa: BLE001 - the test reads it
            done = loop.batch_progress.current.completed
            print(f"VALIDATE-FAILED {type(e).__name__} after batch {done}", flush=True)
            raise
        print("VALIDATE-DONE", flush=True)
        return
    if sys.argv[3:] == ["requeued"]:  # the job SLURM starts again: Lightning resumes from the newest hpc_ckpt_N
        t = _fit_trainer(out, rank, Started())
        t.fit(ParityNet(), token_data())
        print(f"REQUEUED-DONE at step {t.global_step}", flush=True)
        return
    every = ModelCheckpoint(dirpath=out / "every", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    t = _fit_trainer(out, rank, every)
    model = ParityNet() if sys.argv[2] == "NONE" else SignalledInForward()
    try:
        t.fit(model, token_data())
    except BaseException as e:  # noqa: BLE001 - the test reads it
        print(f"FIT-FAILED {type(e).__name__} at step {t.global_step}: {' '.join(str(e).split())[:600]}", flush=True)
        raise
    print("FIT-DONE", flush=True)


if __name__ == "__main__":
    main()
