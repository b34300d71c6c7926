"""Each benchmark script at a tiny size (seconds), so they cannot rot. No timing is asserted."""

import json
from pathlib import Path

import pytest

from tests.benchmarks.scripts import load

pytestmark = pytest.mark.slow  # several ranks or child processes: the full suite's, not the fast tier's


def test_optimizer_step_benchmark_runs_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "opt.json"
    load("optimizer_step").main(["--numel", "1e6", "--repeats", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["torch"]
    rows = {r["contender"]: r for r in data["results"][0]["rows"]}
    assert set(rows) == {
        "floor",
        "floor+bf16",
        "ours",
        "ours+bf16",
        "ours+bf16-compiled",
        "ours+bf16-2pass",
        "torch-fused",
        "torch-foreach",
        "deepspeed",
    }
    for name in (
        "floor",
        "floor+bf16",
        "ours",
        "ours+bf16",
        "ours+bf16-compiled",
        "ours+bf16-2pass",
        "torch-fused",
        "torch-foreach",
    ):
        assert rows[name]["median_s"] > 0 and rows[name]["vs_floor"] > 0 and len(rows[name]["vs_floor_rounds"]) == 2
        low, high = rows[name]["vs_floor_95"]
        assert low <= rows[name]["vs_floor"] <= high
    assert rows["floor"]["vs_floor_rounds"] == [1.0, 1.0] and rows["floor+bf16"]["vs_floor_rounds"] == [1.0, 1.0]
    # a ratio is the median of per-round ratios; the bf16 rows are measured against the 30-byte loop of the same
    # round, the scaled 28-byte floor shown beside it
    for name, floor in (("ours+bf16", "floor+bf16"), ("ours+bf16-2pass", "floor+bf16"), ("ours", "floor")):
        per_round = [a / b for a, b in zip(rows[name]["rounds_s"], rows[floor]["rounds_s"], strict=True)]
        assert rows[name]["vs_floor_rounds"] == pytest.approx(per_round)
        assert rows[name]["vs_floor"] == pytest.approx(sum(per_round) / 2)  # the median of two
    for name in ("ours+bf16", "ours+bf16-2pass"):
        per_round = [a / (b * 30 / 28) for a, b in zip(rows[name]["rounds_s"], rows["floor"]["rounds_s"], strict=True)]
        assert rows[name]["vs_floor_28_scaled"] == pytest.approx(sum(per_round) / 2)
    assert "vs_floor_28_scaled" not in rows["ours"]
    assert "skipped" in rows["deepspeed"] or rows["deepspeed"]["median_s"] > 0  # never faked
    assert "x floor" in capsys.readouterr().out


def test_step_overhead_benchmark_runs_every_contender(tmp_path, capsys):
    out = tmp_path / "steps.json"
    res = load("step_overhead").main(
        [
            "--width",
            "64",
            "--depth",
            "2",
            "--context",
            "16",
            "--steps",
            "4",
            "--skip",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    rows = {r["contender"]: r for r in res["rows"]}
    assert set(rows) == {
        "auto",
        "chunk resident",
        "chunk half offloaded",
        "chunk resident, heap trimmed",
        "ddp (2 ranks)",
        "chunk resident (2 ranks)",
    }
    assert rows["auto"]["vs_baseline"] == 1.0 and rows["ddp (2 ranks)"]["vs_baseline"] == 1.0
    assert all(r["median_ms"] > 0 for r in rows.values())
    assert json.loads(out.read_text())["meta"]["torch"]
    assert "x baseline" in capsys.readouterr().out


def test_step_overhead_in_one_process_alternates_and_gives_an_interval(tmp_path, capsys):
    res = load("step_overhead").main(
        [
            "--width",
            "64",
            "--depth",
            "2",
            "--context",
            "16",
            "--steps",
            "4",
            "--skip",
            "1",
            "--in-process",
            "2",
            "--ranks",
            "1",
            "--out",
            str(tmp_path / "s.json"),
        ]
    )
    rows = {r["contender"]: r for r in res["rows"]}
    assert set(rows) == {"auto", "chunk resident"} and res["in_process"] and res["repeats"] == 2
    chunk = rows["chunk resident"]
    assert len(chunk["rounds_ms"]) == len(rows["auto"]["rounds_ms"]) == 2
    assert chunk["vs_baseline_rounds"] == pytest.approx(
        [a / b for a, b in zip(chunk["rounds_ms"], rows["auto"]["rounds_ms"], strict=True)]
    )
    low, high = chunk["vs_baseline_95"]
    assert low <= chunk["vs_baseline"] <= high
    assert "95% interval" in capsys.readouterr().out


def test_median_interval_is_the_distribution_free_one():
    """n = 32 at 95%: the 10th and 23rd of the sorted values (P(Binomial(32, 1/2) <= 9) = 0.010, <= 10: 0.025);
    too few values for the confidence: the whole range."""
    median_interval = load("_common").median_interval
    xs = [float(x) for x in range(32, 0, -1)]
    assert median_interval(xs) == (10.0, 23.0)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)
    assert median_interval([float(x) for x in range(1, 7)]) == (1.0, 6.0)  # P(B(6, 1/2) = 0) = 0.016


def test_peers_cpu_benchmark_runs_every_peer(tmp_path, capsys):
    res = load("peers_cpu").main(
        ["--width", "64", "--depth", "2", "--context", "16", "--steps", "3", "--out", str(tmp_path / "peers.json")]
    )
    rows = {r["contender"]: r for r in res["rows"]}
    assert rows["FSDP2 + CPUOffloadPolicy"]["vs_fsdp2"] == 1.0 and rows["DDP (everything replicated)"]["vs_ddp"] == 1.0
    for name in (
        "chunk_offload (device, auto chunk size)",
        "chunk_offload (host, auto chunk size)",
        "chunk_offload (host, one block a chunk)",
        "chunk_offload (host, kept for backward)",
    ):
        assert rows[name]["median_s"] > 0 and all(b > 0 for b in rows[name]["peak_rss"])
        assert len(rows[name]["breakdown"]) == 2 and rows[name]["breakdown"][1]["gather_wait"] > 0  # both ranks
    ds = rows["DeepSpeed ZeRO-3 offload"]
    assert "skipped" in ds or (ds["median_s"] > 0 and all(b > 0 for b in ds["peak_rss"]))  # never faked
    out = capsys.readouterr().out
    assert "x DDP" in out and "x FSDP2" in out and "gather wait" in out


def test_peers_cpu_interleaves_rounds_and_takes_the_median_of_per_round_ratios(monkeypatch):
    """``--repeats``: every round runs each contender once before the next round starts, and a ratio is the median
    of the ratios of the same round, so a round where the machine was slow for everyone does not count twice."""
    peers = load("peers_cpu")
    calls = []
    speed = {0: 1.0, 1: 2.0, 2: 1.0}  # the machine is twice as slow in the second round

    def fake_run(name, args, chunk_numel=None, placement="host", extra=None):
        calls.append(name)
        rnd = (len(calls) - 1) // 6  # six contenders a round (no deepspeed)
        base = {"ddp": 1.0, "fsdp2": 2.0, "chunk": 1.1 if placement == "device" else 1.3}[name]
        t = base * speed[rnd] * (1.5 if (name == "ddp" and rnd == 2) else 1.0)  # DDP alone disturbed in round 3
        return {"median_s": t, "min_s": t, "max_s": t, "peak_rss": [1, 2], "params": 10, "breakdown": []}

    monkeypatch.setattr(peers, "run_contender", fake_run)
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    args = peers.argparse.Namespace(width=8, depth=1, context=4, batch=1, steps=2, repeats=3)
    res = peers.measure(args)
    assert len(calls) == 18 and all(
        sorted(calls[6 * k : 6 * k + 6]) == ["chunk"] * 4 + ["ddp", "fsdp2"] for k in range(3)
    )
    rows = {r["contender"]: r for r in res["rows"]}
    device = rows["chunk_offload (device, auto chunk size)"]
    assert device["vs_ddp_rounds"] == pytest.approx([1.1, 1.1, 1.1 / 1.5])
    assert device["vs_ddp"] == pytest.approx(1.1)  # the median round, not the pooled times (1.1 against 1.5)
    assert device["rounds_s"] == pytest.approx([1.1, 2.2, 1.1]) and device["median_s"] == pytest.approx(1.1)
    assert rows["DeepSpeed ZeRO-3 offload"]["skipped"]
    assert "x DDP per round" in peers.render(res)


def test_step_overhead_takes_the_median_of_per_round_ratios(monkeypatch, tmp_path):
    """As in ``peers_cpu``: a ratio compares runs of the same round, so a round where only the baseline was
    disturbed moves one ratio, not the pooled median the others are divided by."""
    so = load("step_overhead")
    calls = []

    def fake_run(name, args, out):
        calls.append(name)
        rnd = (len(calls) - 1) // 4  # four one-rank contenders a round
        t = {"auto": 1.0, "chunk resident": 1.05, "chunk half offloaded": 1.2, "chunk resident, heap trimmed": 1.1}[
            name
        ] * (2.0 if rnd == 1 else 1.0)
        if name == "auto" and rnd == 2:
            t *= 1.3  # the baseline alone disturbed in the third round
        return {"times": [9.9, t, t, t], "params": 10}

    monkeypatch.setattr(so, "run_child", fake_run)
    args = so.argparse.Namespace(width=8, depth=1, context=4, batch=1, steps=4, skip=1, repeats=3, ranks=[1])
    res = so.measure(args)
    one_rank = ["auto", "chunk half offloaded", "chunk resident", "chunk resident, heap trimmed"]
    assert len(calls) == 12 and all(sorted(calls[4 * k : 4 * k + 4]) == one_rank for k in range(3))
    rows = {r["contender"]: r for r in res["rows"]}
    resident = rows["chunk resident"]
    assert resident["vs_baseline_rounds"] == pytest.approx([1.05, 1.05, 1.05 / 1.3])
    assert resident["vs_baseline"] == pytest.approx(1.05)  # pooled medians would say 1.05 / 1.3
    assert resident["rounds_ms"] == pytest.approx([1050, 2100, 1050]) and rows["auto"]["vs_baseline"] == 1.0
    assert "per round" in so.render(res)


def test_scale_search_doubles_then_bisects(monkeypatch, tmp_path):
    scale = load("scale")
    calls = []

    def fake_attempt(name, depth, args, scratch):
        calls.append(depth)
        fits = depth <= 5
        return {
            "depth": depth,
            "params": 1000 * depth,
            "peak_rss": [1],
            "peak_device": [],
            "fits": fits,
            **({} if fits else {"why": "resident memory reached 1.00 GiB > host limit"}),
        }

    monkeypatch.setattr(scale, "attempt", fake_attempt)
    args = scale.argparse.Namespace(max_depth=256, host_limit="1GiB", ranks=2)
    row = scale.largest("x", args, tmp_path)
    assert calls == [1, 2, 4, 8, 6, 5]
    assert row["depth"] == 5 and row["params"] == 5000 and row["first_failure"]["depth"] == 6
    assert row["fraction_of_host_limit"] == 5000 * 16 / (2 * 2**30)


def test_scale_benchmark_runs_and_reports_a_failure_with_its_reason(tmp_path, capsys):
    # one attempt a contender (the search itself is the test above): each is a two-rank launch of several seconds
    res = load("scale").main(
        [
            "--width",
            "32",
            "--context",
            "8",
            "--host-limit",
            "1GiB",
            "--max-depth",
            "1",
            "--out",
            str(tmp_path / "scale.json"),
        ]
    )
    rows = {r["contender"]: r for r in res["rows"]}
    assert set(rows) == {"ddp", "chunk_offload", "chunk_deferred", "chunk_early", "chunk_adafactor"}
    for r in rows.values():  # all fit at depth 1 within 1 GiB a rank, and the search stops at --max-depth
        assert r["depth"] == 1 and r["params"] > 0 and r["capped_by_max_depth"] and max(r["peak_rss"]) < 2**30
        assert r["bytes_per_param"] > 0
    # counted after fit, not before
    assert len({rows[n]["params"] for n in rows if n != "ddp"}) == 1
    res = load("scale").main(
        [
            "--width",
            "32",
            "--context",
            "8",
            "--host-limit",
            "64MiB",
            "--max-depth",
            "1",
            "--ranks",
            "1",
            "--only",
            "chunk_offload",
            "--out",
            str(tmp_path / "scale1.json"),
        ]
    )
    assert [r["contender"] for r in res["rows"]] == ["chunk_offload"]
    for r in res["rows"]:  # a Python process with torch is larger than 64 MiB: killed by the watchdog
        assert r["depth"] == 0 and "host limit" in r["first_failure"]["why"]
    assert "of host limit" in capsys.readouterr().out


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
    assert largest["done"] and largest["steps_done"] == 3 and largest["set_up_s"] > 0  # the child ends at its step
    saved = json.loads(out.read_text())
    assert set(saved["parts"]) == {"tests", "probes", "contenders", "largest"} and saved["meta"]["torch"]
    table = out.with_suffix(".md").read_text()
    assert "x bound" in table and "chunk_offload step_in_backward" in table and "Llama 2 layers" in table
    assert "by phase: chunk_offload step_in_backward" in table and "by cause: chunk_offload step_in_backward (" in table
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


def test_the_campaign_s_largest_model_for_80_gb_and_128_gib_is_past_7b_and_its_plan_fits():
    """The issue's yardstick, in the plan the campaign sizes its largest run by: one 80 GB GPU at an 85% limit, 92% of
    128 GiB of host, a 2048-token step's activations. 32 layers (6.7B) when the warm-up repack and a resume held the
    optimizer state on the host; 44 (9.2B) since it is read after the repack; 36 (7.5B) once the plan counts the
    pinned host shards in torch's power-of-two blocks, as a GPU holds them; 44 again pinned to the byte
    (``pin_memory="exact"``, which the campaign takes where tests/gpu's checks of it passed)."""
    import argparse

    campaign = load("gpu_campaign")
    args = argparse.Namespace(host_memory=128 << 30, accelerator="cuda", largest_batch=1, largest_context=2048)
    for pin, most in ((True, 7e9), ("exact", 9e9)):
        layers, report = campaign.fitting_layers(args, int(0.85 * 80e9), pin)
        assert campaign.model_params({**campaign.LLAMA, "layers": layers}) > most, (pin, layers)
        assert report.fits and max(p.host for p in report.phases) <= 0.92 * (128 << 30)


def test_the_campaign_pins_to_the_byte_only_where_the_gpu_checks_of_it_passed():
    import argparse

    campaign = load("gpu_campaign")
    cuda = argparse.Namespace(accelerator="cuda")
    ok = {"summary": "29 passed in 80.1s", "failures": []}
    failed = {"summary": "1 failed, 28 passed", "failures": ["FAILED tests/gpu/test_cuda.py::test_exact_pinned_x"]}
    other = {"summary": "1 failed, 28 passed", "failures": ["FAILED tests/gpu/test_cuda.py::test_parity_on_cuda"]}
    assert campaign.exact_pinning_passed(cuda, ok, 60) and campaign.exact_pinning_passed(cuda, other, 60)
    assert not campaign.exact_pinning_passed(cuda, failed, 60)
    assert not campaign.exact_pinning_passed(argparse.Namespace(accelerator="cpu"), ok, 60)


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


def test_a_lease_measures_what_the_results_lack_and_a_stopped_largest_try_keeps_its_set_up_and_steps(
    tmp_path, monkeypatch
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
    machine = json.loads(earlier.read_text())["machine"]
    assert res["parts"]["probes"]["from"]["device"] == machine["device"]
    assert res["parts"]["probes"]["host_first_touch_gbps"] > 0  # measured here, where set-up's seconds are spent
    assert f"probes (from {machine['commit']} on {machine['device']})" in out.with_suffix(".md").read_text()

    report = types.SimpleNamespace(phases=[types.SimpleNamespace(host=1)])
    monkeypatch.setattr(campaign, "fitting_layers", lambda args, limit, pin=True: (36, report))
    monkeypatch.setattr(campaign, "exact_pinning_passed", lambda *a: False)
    monkeypatch.setattr("torch.cuda.get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 << 30))
    written = {"params": 7, "peak_device": 1, "peak_host": 2, "marks": {"started": 10.0, "set_up": 70.0}}

    def stopped_after(times):
        def run_ranks(cmd, *a, **k):  # the child's last report before the budget stopped it
            Path(cmd[cmd.index("--child-out") + 1]).write_text(json.dumps({**written, "times": times, "done": False}))
            return -9, "stopped\n"

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


def test_offload_states_benchmark_times_round_trips_on_one_and_two_ranks(tmp_path):
    out = tmp_path / "offload.json"
    res = load("offload_states").main(
        ["--width", "64", "--depth", "2", "--context", "16", "--steps", "3", "--trips", "2", "--out", str(out)]
    )
    assert json.loads(out.read_text())["rows"] == res["rows"]
    assert [r["ranks"] for r in res["rows"]] == [1, 2]
    for r in res["rows"]:
        assert r["device_bytes"] > 0 and r["offloaded_bytes"] == 0 and r["reloaded_bytes"] == r["device_bytes"]
        assert len(r["trips"]) == 2 and r["vs_floor"] > 0


def test_speculation_benchmark_times_guesses_kept_and_undone_against_stepping_after_backward(tmp_path):
    out = tmp_path / "spec.json"
    args = ["--width", "64", "--depth", "2", "--context", "16", "--batch", "2", "--steps", "4", "--rounds", "1"]
    args += ["--precision", "bf16-mixed"]
    res = load("speculation").main([*args, "--out", str(out)])
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["after backward (holds)"]["ratio"] == rows["after backward (undone)"]["ratio"] == 1.0
    assert rows["on a guess (holds)"]["undone"] == 0 and rows["on a guess (undone)"]["undone"] == 3  # not the warm-up
    assert 14 <= rows["on a guess (holds)"]["copy_bytes_per_param"] < 14.1  # fp32 master, bf16 copy, two moments
    assert res["rows"] == list(rows.values())


def test_lora_benchmark_measures_bytes_a_parameter_against_a_full_fine_tune(tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora.json"
    args = ["--hidden", "64", "--layers", "2", "--vocab", "512", "--context", "32", "--steps", "2", "--ranks", "1"]
    res = load("lora").main([*args, "--out", str(out)])
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["full", "lora", "lora, frozen in bf16"] and rows["full"]["vs_full"] == 1.0
    # fp32 master, gradient and Adam's moments beside a bf16 payload for the full fine-tune; the base's master and bf16
    # copy for LoRA; one bf16 copy with the frozen weights in bf16
    assert rows["lora, frozen in bf16"]["bytes_a_param"] < rows["lora"]["bytes_a_param"] < rows["full"]["bytes_a_param"]
    assert res["rows"] == list(rows.values())


def test_checkpoint_stall_benchmark_times_saves_synchronous_and_in_the_background(tmp_path):
    out = tmp_path / "stall.json"
    res = load("checkpoint_stall").main(
        ["--width", "64", "--depth", "2", "--shapes", "16x2", "--steps", "6", "--out", str(out)]
    )
    assert json.loads(out.read_text())["rows"] == res["rows"]
    (row,) = res["rows"]
    assert row["none"]["saves"] == [] and len(row["sync"]["saves"]) == len(row["background"]["saves"]) == 2
    assert all(s["stall_s"] > 0 and "aside_bytes" in s for s in row["background"]["saves"])
    assert len(row["stall_vs_sync"]) == 2


def test_shard_groups_benchmark_counts_what_crosses_nodes(tmp_path, capsys):
    """[Note: replicas summed once a step]: in groups only the replica all-reduce crosses nodes, half of each reduced
    chunk (groups of two) once a step however many micro-batches; sharded over every rank everything crosses."""
    args = ["--width", "64", "--depth", "2", "--context", "16", "--batch", "2", "--steps", "3", "--accumulate", "2"]
    res = load("shard_groups").main([*args, "--out", str(tmp_path / "groups.json")])
    rows = {(r["shard_size"], r["accumulate"]): r for r in res["results"][0]["rows"]}
    for k in (1, 2):
        full, groups = rows[None, k], rows[2, k]
        assert full["replica_all_reduce_bytes"] == 0 and full["across_vs_every_rank"] == 1.0
        assert full["across_nodes_bytes"] == full["all_gather_bytes"] + full["reduce_scatter_bytes"] > 0
        assert groups["across_nodes_bytes"] == groups["replica_all_reduce_bytes"] > 0
        assert 2 * k * groups["replica_all_reduce_bytes"] == groups["reduce_scatter_bytes"]
        assert groups["shard_bytes"] > 1.5 * full["shard_bytes"]  # a replica a node: twice the chunks a rank
    assert rows[2, 2]["across_vs_every_rank"] < rows[2, 1]["across_vs_every_rank"] < 1
    assert "across nodes MB" in capsys.readouterr().out
