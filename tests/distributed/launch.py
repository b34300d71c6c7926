"""Launching the two-rank cases (``runner.py``) and reading what they leave: the cases each launch runs, the check
that a parity case trained as DDP did, each rank's stats. The tests are ``test_two_ranks.py`` and
``test_two_rank_paths.py``; the launches, their session-wide fixtures in ``conftest.py``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tests.distributed.parity_cases import CASES
from tests.distributed.rank_cases import FOUR_ONLY
from tests.faults.common import Ranks
from tests.weights_files import FORMATS

RUNNER = Path(__file__).with_name("runner.py")
WEIGHTS = [f"weights_{fmt}" for fmt in FORMATS]
PARITY = [case for case in CASES if case not in WEIGHTS and case not in FOUR_ONLY]
# Summed in another order than DDP's, so equal to fp32 rounding: norm clipping sums squared norms per rank,
# then across ranks; sharded accumulation reduces each micro-batch where DDP adds the micro-batches locally and
# reduces once (a last-bit difference that Adam carries through the steps: the tolerance the one-rank suite
# gives the fused kernel's rounding). sharded_accumulation=False sums as DDP does and is bit-exact.
ROUNDING = {
    "clip_norm": dict(rtol=1e-5, atol=1e-6),
    "early_clip_norm": dict(rtol=1e-5, atol=1e-6),
    "clip_norm_accumulate": dict(rtol=1e-4, atol=1e-5),
    "early_clip_norm_accumulate": dict(rtol=1e-4, atol=1e-5),
    "clip_norm_limit": dict(rtol=1e-4, atol=1e-5),
    "early_clip_norm_limit": dict(rtol=1e-4, atol=1e-5),
    "two_optimizers": dict(rtol=1e-5, atol=1e-6),
    "accumulate": dict(rtol=1e-4, atol=1e-5),
    "static_limit": dict(rtol=1e-4, atol=1e-5),
    "adafactor_limits_differ": dict(rtol=1e-4, atol=1e-5),
    "zeroed_in_place": dict(rtol=1e-4, atol=1e-5),
    "early_accumulate": dict(rtol=1e-4, atol=1e-5),
    "grad_penalty_early_accumulate": dict(rtol=1e-4, atol=1e-5),
    "disk_accumulate": dict(rtol=1e-4, atol=1e-5),
    "disk_defaults": dict(rtol=1e-4, atol=1e-5),
    "disk_defaults_after": dict(rtol=1e-4, atol=1e-5),
    "added_group_limits": dict(rtol=1e-4, atol=1e-5),
    "early_user_late": dict(rtol=1e-4, atol=1e-5),
    "backward_skips": dict(rtol=1e-4, atol=1e-5),
    "backward_planned": dict(rtol=1e-4, atol=1e-5),
    "no_swaps": dict(rtol=1e-4, atol=1e-5),
    "whole_optimizer_state_user": dict(rtol=1e-4, atol=1e-5),
}
# fp16 payloads: the gradients of fp32 ops (layer norm) are rounded to fp16 before the fp32 master; the update
# still agrees with DDP + GradScaler to a few percent (as on one rank, tests/integration/test_precision_parity.py);
# bf16 against bf16 autocast too
FP16 = {case for case, spec in CASES.items() if (spec.get("fp16") or spec.get("bf16")) and not spec.get("exact")}
AS_NCCL = {"LIGHTNING_CHUNK_GLOO_AS_NCCL": "1"}  # [Note: gloo as NCCL]: one communicator, no agreement check
# the cases that also run with gloo's own defaults (a group per kind of collective, the check once a micro-batch)
GLOO_DEFAULTS = ["plain", "host", "limit", "rank_gated"]
LAUNCHED = [
    *PARITY,
    *WEIGHTS,
    "fp16_overflow_one_rank",
    "resume",
    "unfreeze",
    "full_parameters",
    "edited_checkpoint",
    "ema",
    "grad_penalty_limit",
    "batchnorm",
    "save_after_fit",
    "save_inside_a_step",
    "uneven_batches",
    "static_limits",
    "fits_again",
    "clip_over_optimizer",
    "models_differ",
    "written_after_a_forward",
    "backbone_resume",
    "backward_raised",
]


def run(out: Path, *cases: str, timeout: int, env: dict | None = None) -> tuple[int, str, float]:
    """The runner's two ranks started at once, as torchrun starts them (``Ranks``): under Lightning's launcher the
    second rank would start importing torch and Lightning (about 5 s) only when the first reaches ``fit``.
    ``(return code, both ranks' output, seconds)``: the first non-zero code of a rank (-9 for one killed at
    ``timeout``)."""
    start = time.monotonic()
    ranks = Ranks(RUNNER, out, *cases, env=env).wait(timeout=timeout)
    rc = next((-9 if code is None else code for code, *_ in ranks if code != 0), 0)
    return rc, "".join(so + se for _, so, se, _ in ranks), time.monotonic() - start


def stats(out: Path, case: str) -> list[dict]:
    return [json.loads((out / f"{case}.stats{r}.json").read_text()) for r in (0, 1)]


def write_start_weights(out: Path) -> None:
    """The weights_* cases: 2 ranks start from weights in each format (written here, once) and train like DDP
    from those values."""
    import lightning as L

    from tests.models import ParityNet
    from tests.weights_files import write_weights

    L.seed_everything(3, verbose=False)
    start = ParityNet(variant="tied").state_dict()
    torch.save(start, out / "start.pt")
    paths = {fmt: str(write_weights(start, out / f"w_{fmt}", fmt, variant="tied")) for fmt in FORMATS}
    (out / "weights.json").write_text(json.dumps(paths))


def check_parity(out, rc, log, case):
    for r in (0, 1):
        assert f"CASE-DONE {case} rank={r}" in log, log[-3000:]
    # the ranks plan evictions from their device bytes: the same at every moment ([Note: the same bytes on every
    # rank after a step])
    per_rank = stats(out, case)
    held = [s["device_bytes"] for s in per_rank]
    first = next((i for i, (a, b) in enumerate(zip(*held, strict=False)) if a != b), min(map(len, held)))
    assert held[0] == held[1], f"{case}: the ranks' device bytes differ from moment {first} on"
    assert per_rank[0]["digest"] == per_rank[1]["digest"], f"{case}: the ranks end with different models"
    d = torch.load(out / f"{case}.pt")
    if case in FP16:
        init, ref, got = d["init"], d["ref"], d["got"]
        params = [k for k, v in init.items() if v.is_floating_point()]
        num = sum((got[k].float() - ref[k].float()).pow(2).sum() for k in params)
        den = sum((ref[k].float() - init[k].float()).pow(2).sum() for k in params)
        assert float((num / den).sqrt()) < 0.05, case
        for k in params:  # every parameter moved: both optimizers stepped
            assert not torch.equal(got[k], init[k]), f"{case} {k} never stepped"
        return
    # bit-exact otherwise: gradients are scaled by 1/world_size and summed as DDP does
    tol = ROUNDING.get(case, dict(rtol=0, atol=0))
    for k, v in d["ref"].items():
        torch.testing.assert_close(d["got"][k], v, msg=lambda m: f"{case} {k}: {m}", **tol)
