"""A forward outside a step on some ranks only: a callback that draws a sample at the end of an epoch under ``if
trainer.is_global_zero:``, as works under DDP ([Note: a forward outside a step] in ``engine/comm/group.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.common import Ranks

pytestmark = pytest.mark.slow  # two ranks

WORKER = Path(__file__).with_name("outside_forward_worker.py")


def test_a_forward_on_rank_zero_alone_fails_naming_the_hook_and_the_way_out(tmp_path):
    """Before, rank 0's lone forward waited in an all-gather rank 1 never issued (rank 1 was in the next epoch's
    first batch): on NCCL a hang until the watchdog ended the job; with gloo run as NCCL a timeout blaming
    data-dependent control flow. The forward every rank runs after the first epoch passes its roll call and gives
    the same sample on both."""
    (rc0, so0, se0, _), (rc1, so1, _, _) = Ranks(WORKER, tmp_path).wait(timeout=180)
    samples = [[ln for ln in so.splitlines() if ln.startswith("SAMPLE")] for so in (so0, so1)]
    assert samples[0][:1] == samples[1] and len(samples[1]) == 1 and samples[1][0].startswith("SAMPLE 0 "), samples
    assert len(samples[0]) == 1, "rank 0's lone forward ran"
    assert rc0 not in (None, 0) and rc1 not in (None, 0) and "FINISHED" not in so0 + so1
    error = next((ln for ln in se0.splitlines() if "CollectiveTimeoutError:" in ln), None)
    assert error is not None, se0[-3000:]
    assert "a forward outside a training or evaluation step (in on_train_epoch_end)" in error, error
    assert "Ranks 1 failed to pass" in error and "if trainer.is_global_zero:" in error, error
