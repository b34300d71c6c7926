"""SLURM's requeue signal and SIGTERM landing at another module's forward on each rank ([Note: signals on several
ranks] in ``signals.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_chunk.consolidate import read_checkpoint
from lightning_chunk.engine.comm.collectives import GLOO_AS_NCCL
from tests.faults.common import Ranks
from tests.faults.requeue_worker import AT

pytestmark = pytest.mark.slow  # two ranks

WORKER = Path(__file__).with_name("requeue_worker.py")


def test_the_requeue_signal_landing_at_different_modules_saves_one_checkpoint_on_every_rank_and_training_goes_on(
    tmp_path,
):
    """Before, rank 0 began Lightning's save in its handler while rank 1 waited in the all-gather of a module rank 0
    had not reached: both failed after the collective timeout (60 s here; on NCCL a hang), no checkpoint and no
    requeue. Now both run the handler at the next micro-batch's start (the second of step AT + 1's two, accumulation
    on, chunks sized automatically, limits that differ by rank): one checkpoint, the state the ModelCheckpoint of
    step AT saved; training goes on to its end as a run that got no signal, bit for bit; the job SLURM starts again
    resumes from it."""
    results = Ranks(WORKER, tmp_path / "signalled", "USR1").wait(timeout=240)
    unsignalled = Ranks(WORKER, tmp_path / "unsignalled", "NONE").wait(timeout=240)
    for rank, (rc, so, se, _) in enumerate(results):
        assert rc == 0 and "FIT-DONE" in so, (so + se)[-3000:]
        assert f"SIGNALLED {rank} " in so, so
    assert all(rc == 0 for rc, *_ in unsignalled), unsignalled[0][1:3]
    out = tmp_path / "signalled"
    hpc = sorted(p.name for p in out.iterdir() if p.name.startswith("hpc_ckpt"))
    assert hpc == ["hpc_ckpt_1.ckpt"], hpc
    # taken after the window's first micro-batch: its training_step counted one call more (the ``calls`` buffer)
    at_step = read_checkpoint(out / "every" / f"step={AT}.ckpt")
    _same(read_checkpoint(out / hpc[0]), at_step, AT, but=frozenset({"calls"}))
    last = f"step={AT + 3}.ckpt"
    _same(read_checkpoint(out / "every" / last), read_checkpoint(tmp_path / "unsignalled" / "every" / last), AT + 3)
    for rc, so, se, _ in Ranks(WORKER, out, "USR1", "requeued").wait(timeout=240):
        assert rc == 0 and f"STARTED AT STEP {AT}" in so, (so + se)[-3000:]
        assert f"REQUEUED-DONE at step {AT + 3}" in so, so


def _same(got: dict, ref: dict, step: int, but: frozenset[str] = frozenset()) -> None:
    assert got["global_step"] == ref["global_step"] == step
    assert got["state_dict"].keys() == ref["state_dict"].keys()
    for k, v in ref["state_dict"].items():
        assert k in but or torch.equal(got["state_dict"][k], v), k


def test_sigterm_landing_at_different_modules_stops_every_rank_at_the_end_of_the_same_batch(tmp_path):
    """Before, as NCCL runs, Lightning's SIGTERM handler broadcast from rank 0 in the middle of its forward, which
    paired with rank 1's all-gather: both failed after the collective timeout (on NCCL a hang until the job is
    killed). Now every rank runs the handler at the next micro-batch's start and Lightning stops them at the end of
    that batch: signalled in the first micro-batch of step AT + 1, stopped when its second ends it."""
    results = Ranks(WORKER, tmp_path, "TERM", env={GLOO_AS_NCCL: "1"}).wait(timeout=240)
    stopped = []
    for rank, (_, so, se, _) in enumerate(results):
        assert f"SIGNALLED {rank} " in so, (so + se)[-3000:]
        line = next((ln for ln in so.splitlines() if ln.startswith("FIT-FAILED")), so + se)
        assert line.startswith("FIT-FAILED SIGTERMException at step "), line[-3000:]
        stopped.append(line)
    assert stopped[0] == stopped[1] == f"FIT-FAILED SIGTERMException at step {AT + 1}: ", stopped


@pytest.mark.parametrize("where", ["validate", "sanity"])
def test_sigterm_in_a_validation_stops_every_rank_after_the_same_batch(tmp_path, where):
    """The same outside training: ``trainer.validate`` on two ranks, or a fit's sanity check, signalled in its third
    batch."""
    results = Ranks(WORKER, tmp_path, "TERM", where, env={GLOO_AS_NCCL: "1"}).wait(timeout=240)
    stopped = [next((ln for ln in so.splitlines() if ln.startswith("VALIDATE-")), so + se) for _, so, se, _ in results]
    assert stopped[0] == stopped[1] == "VALIDATE-FAILED SIGTERMException after batch 4", stopped  # handled at the 4th
