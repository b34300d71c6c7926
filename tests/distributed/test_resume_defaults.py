"""Resume with the defaults a user gets, on 2 ranks and across world sizes, against DDP's and plain
Lightning's own resume: the automatic chunk size, a model registered in another order than it is used
(so the resumed warm-up repacks and every rank's piece of each parameter moves, optimizer state with
it), with and without a device limit, host placement keeping its payloads for backward under the limit, and
most shards on the disk tier with each disk chunk stepped during backward (``disk_early_limit``).
2->2 and 1->2 run in a child (tests/distributed/runner.py), 2->1 and 1->1 here.
"""

import json

import pytest
import torch

from tests.distributed.launch import run
from tests.distributed.resume_common import RESUME_VARIANTS, final_state, resume_fit, resume_strategy

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's

EXACT = dict(rtol=0, atol=0)


def assert_same_state(ref: dict, got: dict, what: str) -> None:
    assert ref.keys() == got.keys(), what
    assert any(k.startswith("opt.") and k.endswith("exp_avg_sq") for k in ref), "optimizer state is compared too"
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, msg=lambda m: f"{what} {k}: {m}", **EXACT)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume_defaults")
    resume_fit("auto", out / "from1_auto", 8, devices=1)
    for v in RESUME_VARIANTS:
        resume_fit(resume_strategy(v), out / f"from1_{v}", 8, devices=1)
    rc, log, _ = run(out, "resume_defaults", timeout=600)
    for r in (0, 1):
        assert f"CASE-DONE resume_defaults rank={r}" in log, log[-4000:]
    results = torch.load(out / "resume_defaults.pt")
    results["held"] = [json.loads((out / f"resume_defaults.bytes{r}.json").read_text()) for r in (0, 1)]
    for src, ref in (("from2", "from2_ddp"), ("from1", "from1_auto")):  # 2 -> 1 and 1 -> 1
        t, m = resume_fit("auto", None, 12, ckpt_path=out / ref / "step=8.ckpt", devices=1)
        results[f"{src}.to1.auto"] = final_state(t, m)
        for v in RESUME_VARIANTS:
            t, m = resume_fit(resume_strategy(v), None, 12, ckpt_path=out / f"{src}_{v}" / "step=8.ckpt", devices=1)
            results[f"{src}.to1.{v}"] = final_state(t, m)
    return results


@pytest.mark.parametrize("variant", RESUME_VARIANTS)
def test_two_rank_checkpoint_resumes_on_two_ranks_like_ddp(resumed, variant):
    assert_same_state(resumed["from2.ddp"], resumed[f"from2.{variant}"], f"2->2 {variant}")


def test_resumed_ranks_hold_the_same_device_bytes_at_every_moment(resumed):
    """What the ranks plan evictions from, through a resume's warm-up and the optimizer state read after it
    ([Note: the same bytes on every rank after a step], [Note: optimizer state read after the warm-up])."""
    held = resumed["held"]
    assert held[0].keys() == held[1].keys() and len(held[0]) == 2 * len(RESUME_VARIANTS)
    for fit, moments in held[0].items():
        assert moments and moments == held[1][fit], fit


@pytest.mark.parametrize("variant", RESUME_VARIANTS)
def test_one_rank_checkpoint_resumes_on_two_ranks_like_ddp(resumed, variant):
    assert_same_state(resumed["from1.ddp"], resumed[f"from1.{variant}"], f"1->2 {variant}")


@pytest.mark.parametrize("variant", RESUME_VARIANTS)
@pytest.mark.parametrize("src", ["from2", "from1"])
def test_checkpoint_resumes_on_one_rank_like_plain_lightning(resumed, variant, src):
    assert_same_state(resumed[f"{src}.to1.auto"], resumed[f"{src}.to1.{variant}"], f"{src}->1 {variant}")
