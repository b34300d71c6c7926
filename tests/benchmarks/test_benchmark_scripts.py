"""Each benchmark script at a tiny size (seconds), so they cannot rot. No timing is asserted."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_optimizer_step_benchmark_runs_and_writes_its_table(tmp_path, capsys):
    out = tmp_path / "opt.json"
    load("optimizer_step").main(["--numel", "1e6", "--repeats", "2", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["torch"]
    rows = {r["contender"]: r for r in data["results"][0]["rows"]}
    assert set(rows) == {"floor", "ours", "ours+bf16", "torch-fused", "torch-foreach", "deepspeed"}
    for name in ("floor", "ours", "ours+bf16", "torch-fused", "torch-foreach"):
        assert rows[name]["median_s"] > 0 and rows[name]["vs_floor"] > 0
    assert "skipped" in rows["deepspeed"] or rows["deepspeed"]["median_s"] > 0  # never faked
    assert "x floor" in capsys.readouterr().out
