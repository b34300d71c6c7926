"""The GPU campaign (``benchmarks/gpu_campaign.py``) on CPU: its smoke run of every part, the plan that sizes its
largest model, and how a short lease picks and keeps what it measures."""

import json
import time
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load

pytestmark = pytest.mark.slow  # child processes: the full suite's, not the fast tier's


def test_gpu_campaign_smoke_runs_every_part_on_cpu(tmp_path, capsys):
    """The campaign a lent GPU runs ([Note: a step's bound] in benchmarks/gpu_campaign.py), every part at a tiny
    size: what the GPU would measure is reported or skipped by name, never faked, and each bound is the longest of
    its three streams."""
    out = tmp_path / "campaign.json"
    res = load("gpu_campaign").main(["--smoke", "--out", str(out)])
    parts = res["parts"]
    assert "skipped" in parts["tests"]["summary"] and parts["tests"]["rc"] == 0  # tests/gpu without CUDA
    probes = parts["probes"]
    assert probes["host_bandwidth_gbps"] > 0 and probes["host_adam_gbps"] > 0 and "needs CUDA" in probes["copies"]
    assert probes["host_first_touch_gbps"] > 0  # fresh pages: the pace of a large model's set-up
    if probes.get("transparent_hugepages", "never") != "never":  # and in huge pages, where the kernel has them
        assert probes["host_first_touch_huge_gbps"] > 0
        assert f"in huge pages ({probes['transparent_hugepages']})" in out.with_suffix(".md").read_text()
    rows = {r["contender"]: r for r in parts["contenders"]["rows"]}
    assert rows["ddp"]["vs_ddp"] == 1.0 and "bound_s" not in rows["ddp"]
    assert "skipped" in rows["fsdp + cpu offload"]
    ds = rows["deepspeed zero-3 offload"]
    assert "skipped" in ds or ds["tokens_per_s"] > 0
    for name in ("chunk_offload", "chunk_offload step_in_backward", "chunk_offload step_in_backward, no thread"):
        r = rows[name]  # the smoke's limit leaves shards on the host: the engine's counts are there
        assert r["host_stepped"] > 0 and r["h2d_per_step"] > 0 and r["d2h_per_step"] > 0
        # the host's seconds a timed step by cause: on CUDA its waits (gradient copies before a step in backward)
        assert 0 < r["host_s_per_step"]["optimizer"] < r["median_s"], r["host_s_per_step"]
        assert r["bound_s"] == max(r["t_gpu"], r["t_cpu"], r["t_pcie"]) > 0
        assert r["vs_bound"] == pytest.approx(r["median_s"] / r["bound_s"])
        # one step more, profiled: the host's own time by op, the engine's causes among them as ranges
        assert any(k == "lc:hooks" and ms > 0 and n > 0 for k, ms, n in r["profile"]["host_self_ms"]), r["profile"]
        assert r["profile"]["step_ms"] > 0 and r["profile"]["busy_ms"] == 0  # no device on a CPU
        assert set(r["grad_copies"]) == {
            "grad_copies_handed_over",
            "grad_copies_landed_by_drain",
            "chunks_stepped_from_bf16_grads",
        }
    for r in (rows["ddp"], rows["chunk_offload"]):  # where a row's wall time went, phase by phase, adding up
        assert set(r["phases"]) == {
            "launch",
            "imports",
            "build",
            "setup",
            "first step",
            "other steps",
            "teardown",
            "exit",
        }
        assert min(r["phases"].values()) >= 0 and sum(r["phases"].values()) == pytest.approx(r["wall_s"])
    (largest,) = parts["largest"]["rows"]
    assert largest["median_s"] > 0 and largest["params"] == 115_008  # the tiny Llama's count, built on meta
    assert largest["done"] and largest["steps_done"] == 4 and largest["set_up_s"] > 0  # the child ends at its step
    assert len(largest["step_s"]) == 4 and largest["step_s"][0] == pytest.approx(largest["first_step_s"], abs=1e-3)
    assert largest["peak_resident_gb"] > 0 and all(t >= 0 and r > 0 for t, r in largest["resident_gb"])
    for r in (largest, rows["chunk_offload step_in_backward"]):  # where set-up's and the first steps' seconds went
        assert set(r["calls"]) == {"set-up", "first step", "second step"}, r["calls"]
        assert r["calls"]["set-up"]["ChunkEngine._place"][1] == 1  # the first pack
        assert "adam_native.native_kernel" in r["calls"]["first step"]  # a module's function, watched too
        assert r["calls"]["first step"]["OptimizerBinding.step_chunk"][1] > 0
        assert r["calls"]["second step"]["OptimizerBinding.step_chunk"][1] > 0
        assert r["calls"]["second step"]["ChunkEngine._place"][1] == 0
    # the warm-up's repack: the GPT's chunks are smaller beside the activations it traced under the limit; the tiny
    # Llama's hold what they held, on the tier they were on, and stay as they are ([Note: a chunk's parameters in
    # their old places])
    assert rows["chunk_offload step_in_backward"]["calls"]["first step"]["ChunkEngine._place"][1] == 1
    assert largest["calls"]["first step"]["ChunkEngine._place"][1] == 0
    assert largest["calls"]["set-up"]["DeferredInit.value"][1] > 0  # built on the meta device
    calls = {"set-up": {"ChunkEngine._place": [148.0, 1]}, "first step so far": {"HostStorage.alloc": [61.5, 90]}}
    shown = load("gpu_campaign").render({"machine": res["machine"], "parts": {"largest": {"rows": [
        {**largest, "calls": calls}]}}})  # fmt: skip
    assert "Llama 2 layers, set-up, seconds (calls): ChunkEngine._place 148.0 (1)" in shown
    assert "Llama 2 layers, first step so far, seconds (calls): HostStorage.alloc 61.5 (90)" in shown
    saved = json.loads(out.read_text())
    assert set(saved["parts"]) == {"tests", "probes", "contenders", "largest"} and saved["meta"]["torch"]
    table = out.with_suffix(".md").read_text()
    assert "x bound" in table and "chunk_offload step_in_backward" in table and "Llama 2 layers" in table
    assert "by phase: chunk_offload step_in_backward" in table and "by cause: chunk_offload step_in_backward (" in table
    assert "chunk_offload step_in_backward, a profiled step, the host's own ms (calls): " in table
    capsys.readouterr()
    late = load("gpu_campaign").main(
        ["--smoke", "--parts", "probes", "--budget", "1", "--out", str(tmp_path / "x.json")]
    )
    assert late["parts"]["probes"]["failed"] == "no time left in --budget"
    # a host probe that fails (no compiler for its kernels) leaves the copies' numbers and no bound
    probes = {"threads": 2, "copies": "skipped: needs CUDA", "host": "failed: no compiler"}
    shown = load("gpu_campaign").render({"machine": saved["machine"], "parts": {"probes": probes}})
    assert "host probes failed: no compiler" in shown
    assert load("gpu_campaign").bound(rows["chunk_offload"], probes, 1.0) == {}


def test_the_campaign_s_largest_model_for_80_gb_and_128_gib_is_past_7b_and_its_plan_fits(monkeypatch):
    """The issue's yardstick, in the plan the campaign sizes its largest run by: one 80 GB GPU at an 85% limit, 80% of
    128 GiB of host, a 2048-token step's activations. 32 layers (6.7B) when the warm-up repack and a resume held the
    optimizer state on the host; 44 (9.2B) since it is read after the repack; 36 (7.5B) once the plan counts the
    pinned host shards in torch's power-of-two blocks, as a GPU holds them; 44 again pinned to the byte
    (``pin_memory="exact"``, which the campaign takes where tests/gpu's checks of it passed); 53 (11.0B) and 38
    (8.0B) since the plan steps in backward as the run does and pinned gradient shards are given back; 48 (10.0B)
    and 38 in 80% of the host, the share since a try planned at 92% ran out of time on an H200. Where torch cannot
    swap storages (before 2.12, the GPU machine's 2.11: [Note: torch versions]) a gradient shard pinned to the byte
    keeps its bytes: 41 (8.6B)."""
    import argparse

    from lightning_chunk.engine.system import torch_features

    campaign = load("gpu_campaign")
    args = argparse.Namespace(host_memory=128 << 30, accelerator="cuda", largest_batch=1, largest_context=2048)
    for swap, pin, most in ((True, True, 7.9e9), (True, "exact", 9.9e9), (False, "exact", 8.5e9)):
        monkeypatch.setattr(torch_features, "SWAP_STORAGES", swap)
        layers, report = campaign.fitting_layers(args, int(0.85 * 80e9), pin)
        assert campaign.model_params({**campaign.LLAMA, "layers": layers}) > most, (pin, layers)
        assert report.fits and max(p.host for p in report.phases) <= load("_llama_size").HOST_SHARE * (128 << 30)


def test_the_campaign_pins_to_the_byte_only_where_the_gpu_checks_of_it_passed(monkeypatch):
    import argparse

    campaign = load("gpu_campaign")
    cuda = argparse.Namespace(accelerator="cuda")
    ok = {"summary": "29 passed in 80.1s", "failures": []}
    failed = {"summary": "1 failed, 28 passed", "failures": ["FAILED tests/gpu/test_cuda.py::test_exact_pinned_x"]}
    other = {"summary": "1 failed, 28 passed", "failures": ["FAILED tests/gpu/test_cuda.py::test_parity_on_cuda"]}
    assert campaign.exact_pinning_passed(cuda, ok, 60) and campaign.exact_pinning_passed(cuda, other, 60)
    assert not campaign.exact_pinning_passed(cuda, failed, 60)
    assert not campaign.exact_pinning_passed(argparse.Namespace(accelerator="cpu"), ok, 60)
    # a tests part stopped at its cap before reaching those checks: they are run on their own
    stopped = {"summary": "stopped at 120 s: 20 passed", "failures": [], "passed": ["tests/gpu/t.py::test_parity"]}
    asked = []

    def part_tests(args, budget, select=None):
        asked.append(select)
        return {"summary": "3 passed in 9s", "failures": [], "passed": ["tests/gpu/t.py::test_exact_pinned_x"]}

    monkeypatch.setattr(campaign, "part_tests", part_tests)
    assert campaign.exact_pinning_passed(cuda, stopped, 60) and asked == [["-k", "exact or pinned_to_the_byte"]]
    reached = {**stopped, "passed": ["tests/gpu/t.py::test_host_shards_pinned_to_the_byte_train"]}
    assert campaign.exact_pinning_passed(cuda, reached, 60) and len(asked) == 1  # they had passed before the cap


def test_a_gpu_tests_part_stopped_at_its_cap_keeps_the_outcomes_it_had(monkeypatch):
    """A lease's tests part past its cap lost every outcome (pytest prints its summary at the end); ``-v`` reports
    each test as it ends, and what had ended is kept."""
    import argparse
    import subprocess

    campaign = load("gpu_campaign")
    out = "tests/gpu/t.py::test_a PASSED [ 10%]\ntests/gpu/t.py::test_b[fp16] FAILED [ 20%]\ntests/gpu/t.py::test_c "

    def run(cmd, **kw):
        assert "-v" in cmd
        raise subprocess.TimeoutExpired(cmd, kw["timeout"], output=out.encode())

    monkeypatch.setattr(campaign.subprocess, "run", run)
    got = campaign.part_tests(argparse.Namespace(), 120)
    assert got["summary"] == "stopped at 120 s: 1 passed, 1 failed, 0 error" and got["failed"].endswith("120 s")
    assert got["passed"] == ["tests/gpu/t.py::test_a"] and got["failures"] == ["FAILED tests/gpu/t.py::test_b[fp16]"]


def test_the_campaign_keeps_why_each_gpu_test_failed():
    """Before, a lease's JSON named the failed tests only (pytest cuts the reason off its summary lines), so a test
    that failed on a GPU could not be diagnosed without another lease."""
    report = """FF.                                                                      [100%]
=================================== FAILURES ===================================
_____ test_guess[fp16] _____
tests/gpu/test_cuda.py:270: in test_guess
    assert_same_params(want, got, EXACT)
tests/compare.py:20: in assert_same_params
    torch.testing.assert_close(a, b, **tol)
E   AssertionError: Tensor-likes are not close!
E   Mismatched elements: 3 / 4096 (0.1%)
_____ test_save[host-True] _____
tests/gpu/test_cuda.py:300: in test_save
    eng.teardown()
E   RuntimeError: CUDA error: an illegal memory access was encountered
----------------------------- Captured stderr call -----------------------------
warning text
=========================== short test summary info ============================
FAILED tests/gpu/test_cuda.py::test_guess[fp16] - AssertionError: Tensor-lik...
FAILED tests/gpu/test_cuda.py::test_save[host-True] - RuntimeError: CUDA err...
2 failed, 1 passed in 3.10s""".splitlines()
    campaign = load("gpu_campaign")
    assert campaign.failure_reasons(report) == {
        "test_guess[fp16]": [
            "tests/compare.py:20: in assert_same_params",
            "AssertionError: Tensor-likes are not close!",
            "Mismatched elements: 3 / 4096 (0.1%)",
        ],
        "test_save[host-True]": [
            "tests/gpu/test_cuda.py:300: in test_save",
            "RuntimeError: CUDA error: an illegal memory access was encountered",
        ],
    }


def test_after_a_failed_try_pinned_to_the_byte_the_campaign_tries_torch_s_pinning_at_its_planned_size(
    tmp_path, monkeypatch
):
    import argparse
    import types

    campaign = load("gpu_campaign")
    report = types.SimpleNamespace(phases=[types.SimpleNamespace(host=1)])
    monkeypatch.setattr(
        campaign, "fitting_layers", lambda args, limit, pin=True: (44 if pin == "exact" else 36, report)
    )
    monkeypatch.setattr(campaign, "exact_pinning_passed", lambda *a: True)
    monkeypatch.setattr(campaign, "pinning_paces", lambda: {"torch": 1.0, "exact": 8.0})
    monkeypatch.setattr(campaign, "run_ranks", lambda *a, **k: (1, "CUDA error\n"))
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 << 30))
    args = argparse.Namespace(
        smoke=False,
        accelerator="cuda",
        host_memory=128 << 30,
        scratch=str(tmp_path),
        largest_steps=3,
        largest_batch=1,
        largest_context=2048,
    )
    rows = campaign.part_largest(args, 600, {}, None)["rows"]
    assert [(r["layers"], r["pin_memory"]) for r in rows] == [(44, "exact"), (36, True), (32, True)]
    assert all(r["failed"] == "CUDA error" for r in rows)
    assert rows[1]["pin_why"] == "torch's pinned blocks at 1.0 GB/s" and rows[1]["pin_gbps"]["exact"] == 8.0


def test_the_largest_try_is_pageable_where_that_fits_more_or_torch_s_pinning_would_take_most_of_the_part(
    tmp_path, monkeypatch
):
    """The 9.0B try of 2026-12-04, in torch's pinned blocks, spent 148 s in set-up and ran out of the part's time in
    its first step; their power-of-two rounding also plans fewer layers (37 on an H200 where pageable or to the byte
    plan 49). Without the pinning to the byte, the try holds its shards pageable where that plan fits more layers, or
    where the measured pace of torch's pinning would spend more than a quarter of the time left on the shards."""
    import argparse
    import types

    campaign = load("gpu_campaign")
    choose = load("_llama_size").choose_pinning
    same = {True: (40, 100e9), False: (40, 100e9)}
    assert choose(True, {}, {}, 0)[0] == "exact"
    # a torch that cannot swap storages keeps the gradient shards pinned to the byte: that plan fits fewer layers
    kept = {"exact": (44, 100e9), True: (40, 100e9), False: (46, 100e9)}
    assert choose(True, {}, kept, 400) == (
        False,
        "to the byte fits 44 layers, fewer (its gradient shards kept); "
        "pageable fits 46 layers, torch's pinned blocks 40",
    )
    assert choose(True, {}, {**kept, "exact": (46, 100e9)}, 400)[0] == "exact"
    assert choose(False, {}, same, 400) == (True, "torch's pinned blocks")  # no pace measured: as before
    assert choose(False, {"torch": 4.0}, same, 400)[0] is True  # 25 s of 400
    assert choose(False, {"torch": 0.8}, same, 400) == (
        False,
        "torch's pinned blocks at 0.8 GB/s: 125 s of set-up for the shards",
    )
    assert choose(False, {"torch": 4.0}, {True: (37, 100e9), False: (49, 100e9)}, 400) == (
        False,
        "pageable fits 49 layers, torch's pinned blocks 37",
    )

    plans = {"exact": (44, 110e9), True: (36, 120e9), False: (44, 110e9)}
    monkeypatch.setattr(
        campaign,
        "fitting_layers",
        lambda args, limit, pin=True: (
            plans[pin][0],
            types.SimpleNamespace(phases=[types.SimpleNamespace(host=plans[pin][1])]),
        ),
    )
    monkeypatch.setattr(campaign, "pinning_paces", lambda: {"torch": 0.8, "exact": 9.5})
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 << 30))
    asked = []

    def run_ranks(cmd, *a, **k):
        asked.append(cmd[cmd.index("--largest-pin") + 1])
        return 1, "CUDA error\n"

    monkeypatch.setattr(campaign, "run_ranks", run_ranks)
    args = argparse.Namespace(smoke=False, accelerator="cuda", host_memory=128 << 30, scratch=str(tmp_path))
    vars(args).update(largest_steps=3, largest_batch=1, largest_context=2048)
    for exact_ok, first in ((False, (44, False, "false")), (True, (44, "exact", "exact"))):
        asked.clear()
        monkeypatch.setattr(campaign, "exact_pinning_passed", lambda *a, ok=exact_ok: ok)
        rows = campaign.part_largest(args, 400, {}, None)["rows"]
        assert (rows[0]["layers"], rows[0]["pin_memory"], asked[0]) == first
        assert rows[0]["planned_peak_host"] == 110e9
    # after the try pinned to the byte failed: pageable, not torch's blocks, at the size the plan allows
    assert [(r["layers"], r["pin_memory"]) for r in rows[:2]] == [(44, "exact"), (44, False)]
    assert asked[1] == "false" and rows[1]["pin_gbps"] == {"torch": 0.8, "exact": 9.5}

    # a try the part's budget stops is said to be stopped, not failed with the last line it printed
    def stopped(cmd, *a, timeout, **k):
        time.sleep(timeout)
        return -9, "The 'train_dataloader' does not have many workers\n"

    monkeypatch.setattr(campaign, "run_ranks", stopped)
    (late,) = campaign.part_largest(args, 1.5, {}, None)["rows"]
    assert late["failed"] == "stopped at the part's 2 s" and late["pin_memory"] == "exact"

    # one the kernel kills (out of memory) is said to be killed, where its last line was a tip printed at its start
    def killed(cmd, *a, **k):
        out = Path(cmd[cmd.index("--child-out") + 1])
        out.write_text(json.dumps({"rss": [[0.0, 0.4], [5.0, 23.2]], "marks": {"started": 0.0}}))
        return -9, "Tip: For seamless cloud logging, try installing litlogger\n"

    monkeypatch.setattr(campaign, "run_ranks", killed)
    dead = campaign.part_largest(args, 400, {}, None)["rows"][0]
    assert dead["failed"] == "after 0 steps: killed by signal 9 at 23.2 GB resident"
    assert "Llama 44 layers: pin_memory=False (pageable fits 44 layers, torch's pinned blocks 36" in campaign.render(
        {
            "machine": campaign._machine(argparse.Namespace(accelerator="cpu", host_memory=1 << 30)),
            "parts": {"largest": {"rows": rows}},
        }
    )


def test_a_lease_measures_what_the_results_lack_and_a_stopped_largest_try_keeps_its_set_up_and_steps(
    tmp_path, monkeypatch, capsys
):
    """A short lease: only the rows asked for, the committed probes of the same kind of machine named as such; a
    largest try the budget stops keeps its set-up's seconds and the steps it finished (each written as it ends)."""
    import argparse
    import types

    campaign = load("gpu_campaign")
    earlier = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_campaign.json"
    out = tmp_path / "lease.json"
    res = campaign.main(["--smoke", "--parts", "contenders", "--contenders", "ddp", "--cap", "contenders=120"]
                        + ["--probes-from", str(earlier), "--out", str(out)])  # fmt: skip
    assert [r["contender"] for r in res["parts"]["contenders"]["rows"]] == ["ddp"]
    saved = json.loads(earlier.read_text())
    machine = saved["parts"]["probes"].get("from") or saved["machine"]  # where they were measured, kept along reuses
    assert res["parts"]["probes"]["from"]["device"] == machine["device"]
    assert res["parts"]["probes"]["host_first_touch_gbps"] > 0  # measured here, where set-up's seconds are spent
    for bad in ("contenders", "probe=5", "tests=soon", "largest=-1"):  # named, with what is allowed
        with pytest.raises(SystemExit):
            campaign.main(["--smoke", "--cap", bad, "--out", str(out)])
        assert f"{bad!r} is not PART=SECONDS with PART one of tests, probes" in capsys.readouterr().err
    assert f"probes (from {machine['commit']} on {machine['device']})" in out.with_suffix(".md").read_text()

    report = types.SimpleNamespace(phases=[types.SimpleNamespace(host=1)])
    monkeypatch.setattr(campaign, "fitting_layers", lambda args, limit, pin=True: (36, report))
    monkeypatch.setattr(campaign, "exact_pinning_passed", lambda *a: False)
    monkeypatch.setattr(campaign, "pinning_paces", lambda: {})
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 << 30))
    written = {"params": 7, "peak_device": 1, "peak_host": 2, "marks": {"started": 10.0, "set_up": 70.0}}

    def stopped_after(times):
        def run_ranks(cmd, *a, **k):  # the child's last report before the budget stopped it
            Path(cmd[cmd.index("--child-out") + 1]).write_text(json.dumps({**written, "times": times, "done": False}))
            return 1, "stopped\n"

        return run_ranks

    args = argparse.Namespace(smoke=False, accelerator="cuda", host_memory=128 << 30, scratch=str(tmp_path))
    vars(args).update(largest_steps=3, largest_batch=1, largest_context=2048)
    monkeypatch.setattr(campaign, "run_ranks", stopped_after([30.0, 2.0]))
    (row,) = campaign.part_largest(args, 600, {}, None)["rows"]
    assert (row["set_up_s"], row["first_step_s"], row["median_s"], row["steps_done"]) == (60.0, 30.0, 2.0, 2)
    assert row["done"] is False and "failed" not in row
    monkeypatch.setattr(campaign, "run_ranks", stopped_after([]))
    rows = campaign.part_largest(args, 600, {}, None)["rows"]
    assert rows[0]["set_up_s"] == 60.0 and rows[0]["failed"] == "after 0 steps: stopped"
    assert "Llama 36 layers: set-up 60.0 s, warm-up step 30.0 s" in campaign.render(
        {"machine": machine, "parts": {"largest": {"rows": [row]}}}
    )


def test_a_lease_without_ddp_bounds_the_largest_by_the_ddp_row_of_the_run_it_takes_the_probes_from(tmp_path):
    """A lease that runs the largest model before (or without) the contenders still computes its bound: T_gpu from
    DDP's model TFLOP/s in the run whose probes it reuses, named as such."""
    campaign = load("gpu_campaign")
    earlier = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_campaign.json"
    res = campaign.main(
        ["--smoke", "--parts", "largest", "--probes-from", str(earlier), "--out", str(tmp_path / "l.json")]
    )
    largest = res["parts"]["largest"]
    saved = json.loads(earlier.read_text())
    assert largest["ddp_from"] == (saved["parts"]["probes"].get("from") or saved["machine"])
    (row,) = largest["rows"]
    ddp = next(r for r in saved["parts"]["contenders"]["rows"] if r["contender"] == "ddp")
    assert row["t_gpu"] == pytest.approx(row["tflops"] * row["median_s"] / ddp["tflops"])
    src = largest["ddp_from"]
    assert f"T_gpu from DDP's TFLOP/s of {src['commit']} on {src['device']}" in campaign.render(res)


def test_a_profiled_step_says_how_long_the_device_was_busy_in_it():
    """The bound's question on a lease: did the step wait on the device, or the device on the host? The device's busy
    time counts two streams' overlapping kernels and copies once."""
    common, table = load("_common"), load("_campaign_table")
    assert common.busy_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17 and common.busy_us([]) == 0
    row = {"contender": "c", "profile": {"host_self_ms": [], "step_ms": 250.0, "busy_ms": 160.5, "compute_ms": 150.0}}
    assert "c, a profiled step: 250.0 ms, the device busy 160.5 (kernels 150.0)" in table.time_spent([row])
    row = {"contender": "c", "grad_copies": {"grad_copies_handed_over": 40, "grad_copies_landed_by_drain": 25}}
    said = "c: 25 of 40 gradient copies handed to the worker were landed by a drain first (in all steps)"
    assert said in table.time_spent([row])  # the staging ring backed up into the autograd thread
    row["grad_copies"]["chunks_stepped_from_bf16_grads"] = 30
    assert said + "; 30 chunk steps from bf16 gradients" in table.time_spent([row])
