"""A rank that dies or hangs in the middle of a step: the other rank stops with an error naming it and what it
was waiting for, within ``collective_timeout_s`` plus a small slack, and no incomplete checkpoint is left where
a checkpoint is looked for.

Two ranks of ``step_worker.py`` are started as separate processes (as torchrun or SLURM start them), train with
``chunk_offload`` and save every 2 steps. One rank is killed (SIGKILL) at a parameter all-gather, at a gradient
reduce-scatter, or in the optimizer step, or stopped (SIGSTOP: alive but stuck) at an all-gather.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_chunk.engine.state.checkpoint import check_checkpoint_dir
from tests.faults.common import Ranks, find_last

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

WORKER = Path(__file__).with_name("step_worker.py")
TIMEOUT_S = 6.0  # step_worker.TIMEOUT_S
SLACK_S = 5.0

CASES = {
    # (rank that fails, what it enters, the how-many-th, how): what the survivor reports
    "killed at an all-gather": ("1:all_gather:40:kill", "lost rank 1", "all_gather of chunk"),
    "killed at a reduce-scatter": ("0:reduce_scatter:30:kill", "lost rank 0", "reduce_scatter of chunk"),
    # the survivor steps and waits at its next batch, in the exchange that every rank has one ([Note: the same number
    # of batches on every rank])
    "killed in the optimizer step": ("1:step:5:kill", "lost rank 1", "the check that every rank runs training batch"),
    "stopped at an all-gather": ("1:all_gather:40:stop", "rank 1 (pid", "all_gather of chunk"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_survivor_names_the_lost_rank_and_exits_within_the_timeout(tmp_path, case):
    where, names, waiting = CASES[case]
    failing = int(where.split(":")[0])
    survivor = 1 - failing
    results = Ranks(WORKER, tmp_path, where).wait(timeout=180, until_first="stop" in where)
    rc, so, se, exited_at = results[survivor]
    fault = json.loads((tmp_path / "fault.json").read_text())
    assert rc not in (None, 0) and "FINISHED" not in so, se[-3000:]
    error = next((ln for ln in se.splitlines() if "CollectiveTimeoutError:" in ln), None)
    assert error is not None, f"exit status {rc}: {se[-3000:]}"  # the survivor's own words when it ended another way
    assert names in error and waiting in error, error
    if "stop" in where:
        assert "is stopped" in error
    took = exited_at - fault["time"]
    assert took < TIMEOUT_S + SLACK_S, f"the survivor exited {took:.1f} s after the fault"
    (tmp_path / f"bound-{case.replace(' ', '-')}.txt").write_text(f"{took:.2f}")
    print(f"{case}: the survivor exited {took:.2f} s after the fault (timeout {TIMEOUT_S} s)")
    ckpts = tmp_path / "ckpt"
    for p in ckpts.iterdir():
        if not p.name.startswith("."):
            check_checkpoint_dir(p)  # every checkpoint in sight is complete
    assert find_last(ckpts) == str(ckpts / "last.ckpt")
