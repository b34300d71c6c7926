"""fp16 with an inf in one rank's gradients only: every rank skips the same step, the loss scale drops the same
way on every rank, and each rank's shards (masters and Adam state) equal those of a run in which that step never
happened (the same data without that batch, the scale halved at that point). See overflow_worker.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.faults.common import Ranks

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

WORKER = Path(__file__).with_name("overflow_worker.py")
K = 3  # overflow_worker.K


def test_an_inf_on_one_rank_skips_the_step_on_every_rank_as_if_it_never_happened(tmp_path):
    for mode in ("faulty", "reference"):
        results = Ranks(WORKER, tmp_path / mode, mode).wait(timeout=300)
        for r, (rc, so, se, _) in enumerate(results):
            assert rc == 0 and f"DONE {mode} rank={r}" in so, se[-3000:]
    got = [torch.load(tmp_path / "faulty" / f"faulty.rank{r}.pt") for r in range(2)]
    ref = [torch.load(tmp_path / "reference" / f"reference.rank{r}.pt") for r in range(2)]
    for r in range(2):
        assert got[r]["changed"] == [True] * K + [False] + [True] * (len(got[r]["changed"]) - K - 1), r
        assert got[r]["scales"] == got[0]["scales"] and got[r]["final_scale"] == got[0]["final_scale"]
        s0 = got[r]["scales"][0]
        assert got[r]["scales"] == [s0] * (K + 1) + [s0 / 2] * (len(got[r]["scales"]) - K - 1)
        assert ref[r]["scales"] == got[r]["scales"][:K] + got[r]["scales"][K + 1 :]
        assert all(torch.equal(a, b) for a, b in zip(got[r]["masters"], ref[r]["masters"], strict=True)), r
        assert got[r]["state"].keys() == ref[r]["state"].keys() and got[r]["state"]
        for k in got[r]["state"]:
            assert torch.equal(got[r]["state"][k], ref[r]["state"][k]), (r, k)
