"""Each benchmark script at a tiny size (seconds), so they cannot rot. No timing is asserted."""

import json

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


def test_bf16_gradients_benchmark_steps_from_them_to_the_same_bits(tmp_path):
    out = tmp_path / "bf16_grads.json"
    args = ["--width", "64", "--depth", "2", "--context", "16", "--batch", "2", "--steps", "4", "--rounds", "1"]
    res = load("bf16_grads").main([*args, "--chunk-numel", "16384", "--out", str(out)])
    saved = json.loads(out.read_text())
    rows = {r["contender"]: r for r in saved["rows"]}
    assert saved["same_bits"] and rows["widened first"]["host_ratio"] == 1.0
    assert rows["bf16 gradients"]["chunks_from_bf16"] > 0 == rows["widened first"]["chunks_from_bf16"]
    assert res["rows"] == saved["rows"]


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
    # the checkpoint: the full fine-tune's masters and moments (12 bytes); LoRA's frozen base, its values alone
    assert 12 <= rows["full"]["checkpoint_bytes_a_param"] and rows["lora"]["checkpoint_bytes_a_param"] < 6
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
