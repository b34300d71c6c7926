"""Training step time of the example GPT with chunk_offload against plain Lightning, side by side.

    python benchmarks/step_overhead.py                          # ~10M-parameter GPT, 3 interleaved repeats
    python benchmarks/step_overhead.py --width 64 --depth 2 --steps 6 --repeats 1 --out /tmp/s.json   # seconds

Contenders, each a fresh ``Trainer.fit`` in its own child process (two-rank ones through Lightning's
launcher), repeats run in a shuffled order:

- 1 rank: ``auto`` (plain Lightning); ``chunk resident`` (``placement="device"``: everything on the
  device tier); ``chunk half offloaded`` (``placement="static", offload_fraction=0.5``: half the
  chunks' shards on the host, their payloads fetched every step and their Adam step on the host);
  ``chunk resident, heap trimmed`` (``keep_freed_heap=False``: glibc's own heap settings, which give the
  activations' pages back at every backward; [Note: the heap between steps]).
- 2 ranks (gloo): ``ddp``; ``chunk resident`` (every chunk sharded, all-gathered and reduce-scattered).

Step time: median over the steps after the first ``--skip`` (the warm-up), per run; the table shows
the median over repeats and their spread. The ratio to ``auto`` (1 rank) or ``ddp`` (2 ranks) is the median
of the per-round ratios, each against the baseline's run of the same round, with their range beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, clean_env, gpt_parser, make_gpt, round_ratios, run_or_child, step_timer  # noqa: E402

CONTENDERS = {  # name -> (devices, strategy spec)
    "auto": (1, "auto"),
    "chunk resident": (1, {"placement": "device"}),
    "chunk half offloaded": (1, {"placement": "static", "offload_fraction": 0.5}),
    "chunk resident, heap trimmed": (1, {"placement": "device", "keep_freed_heap": False}),
    "ddp (2 ranks)": (2, "ddp"),
    "chunk resident (2 ranks)": (2, {"placement": "device"}),
}
BASELINE = {1: "auto", 2: "ddp (2 ranks)"}


def child(args: argparse.Namespace) -> None:
    """One fit; rank 0 writes its per-step times."""
    import lightning as L
    import torch

    from lightning_chunk import ChunkOffloadStrategy

    devices, spec = CONTENDERS[args.child]
    strategy = spec if isinstance(spec, str) else ChunkOffloadStrategy(**spec, log_memory_stats=False)
    times: list[float] = []
    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    data = torch.randint(0, 256, (args.steps * args.batch * devices, args.context + 1))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[step_timer(times)])
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "params": sum(p.numel() for p in model.parameters())}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_child(name: str, args: argparse.Namespace, out: Path) -> dict:
    env = clean_env()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out)]
    for k in ("width", "depth", "context", "batch", "steps"):
        cmd += [f"--{k}", str(getattr(args, k))]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if not out.exists():
        raise RuntimeError(f"{name} failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return json.loads(out.read_text())


def measure(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="step_overhead_"))  # per-run scratch, not results
    per_run: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    params = 0
    rng = random.Random(0)
    for rep in range(args.repeats):
        order = [n for n in CONTENDERS if CONTENDERS[n][0] in args.ranks]
        rng.shuffle(order)
        for name in order:
            res = run_child(name, args, tmp / f"{rep}-{name.replace(' ', '_')}.json")
            params = res["params"]
            steady = res["times"][args.skip:] or res["times"]
            per_run[name].append(statistics.median(steady))
    rows = []
    for name, (devices, _) in CONTENDERS.items():
        if devices not in args.ranks:
            continue
        ratio, ratios = round_ratios(per_run[name], per_run[BASELINE[devices]])
        rows.append({"contender": name, "ranks": devices, "median_ms": statistics.median(per_run[name]) * 1e3,
                     "min_ms": min(per_run[name]) * 1e3, "max_ms": max(per_run[name]) * 1e3, "rounds_ms":
                     [t * 1e3 for t in per_run[name]], "vs_baseline": ratio, "vs_baseline_rounds": ratios,
                     "baseline": BASELINE[devices]})
    return {"params": params, "width": args.width, "depth": args.depth, "context": args.context, "batch": args.batch,
            "steps": args.steps, "skip": args.skip, "repeats": args.repeats, "rows": rows}


def render(res: dict) -> str:
    lines = [f"GPT {res['params']:,} parameters (width {res['width']}, depth {res['depth']}, context {res['context']}, "
             f"batch {res['batch']} per rank), {res['steps']} steps a run minus {res['skip']} warm-up, "
             f"{res['repeats']} interleaved repeats; x baseline: the median of the per-round ratios",
             f"{'contender':<30} {'median ms':>10} {'min..max ms':>17} {'x baseline':>11} {'per round':>18}"]
    for r in res["rows"]:
        rounds = r.get("vs_baseline_rounds", [])
        spread = f"{min(rounds):.3f}..{max(rounds):.3f}" if rounds else ""
        lines.append(f"{r['contender']:<30} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f}..{r['max_ms']:<7.1f} "
                     f"{r['vs_baseline']:>7.3f} ({r['baseline']}) {spread:>12}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/step_overhead.json", width=384, depth=6, context=128, batch=8, steps=30)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="+", choices=(1, 2), default=[1, 2],
                   help="run only the contenders on these rank counts")
    return run_or_child(p.parse_args(argv), {"*": child}, measure, render)


if __name__ == "__main__":
    main()
