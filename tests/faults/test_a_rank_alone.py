"""A forward, a save, ``full_parameters()`` or ``full_optimizer_state()`` outside a step on some ranks only: a
callback that draws a sample, saves a checkpoint, reads the weights or logs Adam's moments at the end of an epoch
under ``if trainer.is_global_zero:``, as works under DDP ([Note: a forward outside a step] in
``engine/comm/group.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.common import Ranks

pytestmark = pytest.mark.slow  # two ranks

WORKER = Path(__file__).with_name("alone_worker.py")
NAMED = {
    "forward": ("a forward outside a training or evaluation step (in on_train_epoch_end)", "Run it on every rank"),
    "save": ("a checkpoint save (in on_train_epoch_end)", "Call it on every rank"),
    "full_parameters": ("full_parameters() (in on_train_epoch_end)", "Enter it on every rank"),
    "full_optimizer_state": ("full_optimizer_state() (in on_train_epoch_end)", "Call it on every rank"),
}


@pytest.mark.parametrize("what", list(NAMED))
def test_a_call_on_rank_zero_alone_fails_naming_the_hook_and_the_way_out(tmp_path, what):
    """Before, rank 0's lone call waited in an all-gather rank 1 never issued, rank 1 being in the next
    epoch's first batch: on NCCL a hang until the watchdog ended the job; with gloo run as NCCL a timeout blaming
    data-dependent control flow (the save's object exchange waited unbounded). The call every rank makes after the
    first epoch passes its roll call: the same value on both ranks, a checkpoint written."""
    (rc0, so0, se0, _), (rc1, so1, _, _) = Ranks(WORKER, tmp_path, what).wait(timeout=180)
    done = [[ln for ln in so.splitlines() if ln.startswith("DONE")] for so in (so0, so1)]
    assert done[0] == done[1] and len(done[1]) == 1 and done[1][0].startswith("DONE 0 "), done
    assert what != "save" or done[0] == ["DONE 0 True"]
    assert rc0 not in (None, 0) and rc1 not in (None, 0) and "FINISHED" not in so0 + so1
    error = next((ln for ln in se0.splitlines() if "CollectiveTimeoutError:" in ln), None)
    assert error is not None, se0[-3000:]
    call, fix = NAMED[what]
    assert f"{call} did not find every rank running one" in error and "Ranks 1 failed to pass" in error, error
    assert "if trainer.is_global_zero:" in error and fix in error, error
