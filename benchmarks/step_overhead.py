"""Training step time of the example GPT with chunk_offload against plain Lightning, side by side.

    python benchmarks/step_overhead.py                          # ~10M-parameter GPT, 3 interleaved repeats
    python benchmarks/step_overhead.py --width 64 --depth 2 --steps 6 --repeats 1 --out /tmp/s.json   # seconds

Contenders, each a fresh ``Trainer.fit`` in its own child process (two-rank ones with both ranks started at
once, as torchrun starts them: ``run_ranks``), repeats run in a shuffled order:

- 1 rank: ``auto`` (plain Lightning); ``chunk resident`` (``placement="device"``: everything on the
  device tier); ``chunk half offloaded`` (``placement="static", offload_fraction=0.5``: half the
  chunks' shards on the host, their payloads fetched every step and their Adam step on the host);
  ``chunk resident, heap trimmed`` (``keep_freed_heap=False``: glibc's own heap settings, which give the
  activations' pages back at every backward; [Note: the heap between steps]).
- 2 ranks (gloo): ``ddp``; ``chunk resident`` (every chunk sharded, all-gathered and reduce-scattered).

Step time: median over the steps after the first ``--skip`` (the warm-up), per run; the table shows
the median over repeats and their spread. The ratio to ``auto`` (1 rank) or ``ddp`` (2 ranks) is the median
of the per-round ratios, each against the baseline's run of the same round, with their range beside it.

``--in-process N`` (1 rank): ``auto`` and ``chunk resident`` fitted one after the other in one process, N
rounds, the order swapped every round. Separate processes land in a fast or a slow mode of this machine
(423-445 or 470-497 ms a step on the 10.8M GPT, whatever the code), which moves a round's ratio by +-5%;
in one process both contenders share the mode. Both run under the heap setting ``chunk_offload`` makes
(``keep_freed_heap``, process-wide: set before the first fit, so ``auto`` has it from round one too). The
ratio is the median of the per-round ratios with a distribution-free 95% interval for that median
(``median_interval``), which says whether the rounds were enough to tell the ratio from a target.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    clean_env,
    gpt_parser,
    make_gpt,
    median_interval,
    quiet_trainer,
    round_ratios,
    run_or_child,
    run_ranks,
    step_timer,
)

CONTENDERS = {  # name -> (devices, strategy spec)
    "auto": (1, "auto"),
    "chunk resident": (1, {"placement": "device"}),
    "chunk half offloaded": (1, {"placement": "static", "offload_fraction": 0.5}),
    "chunk resident, heap trimmed": (1, {"placement": "device", "keep_freed_heap": False}),
    "ddp (2 ranks)": (2, "ddp"),
    "chunk resident (2 ranks)": (2, {"placement": "device"}),
}
BASELINE = {1: "auto", 2: "ddp (2 ranks)"}
IN_PROCESS = ("auto", "chunk resident")


def child(args: argparse.Namespace) -> None:
    """One fit; rank 0 writes its per-step times."""
    import torch

    if args.child == "in-process":
        return child_in_process(args)
    times, params, rank = fit(args, args.child)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"times": times, "params": params}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def child_in_process(args: argparse.Namespace) -> None:
    """``auto`` and ``chunk resident`` alternated in this process, ``--in-process`` rounds."""
    from lightning_chunk.engine.system.host_heap import keep_freed_heap

    keep_freed_heap()  # what the first chunk_offload fit would do for the whole process: both sides share it
    rounds: list[dict[str, float]] = []
    params = 0
    for r in range(args.in_process):
        got = {}
        for name in IN_PROCESS if r % 2 == 0 else IN_PROCESS[::-1]:
            times, params, _ = fit(args, name)
            got[name] = statistics.median(times[args.skip :] or times)
        rounds.append(got)
    Path(args.out).write_text(json.dumps({"rounds": rounds, "params": params}))


def fit(args: argparse.Namespace, name: str) -> tuple[list[float], int, int]:
    """One ``Trainer.fit`` of contender ``name``: (per-step seconds, parameters, global rank)."""
    import lightning as L
    import torch

    from lightning_chunk import ChunkOffloadStrategy
    from lightning_chunk.options import grouped

    devices, spec = CONTENDERS[name]
    strategy = spec if isinstance(spec, str) else ChunkOffloadStrategy(**grouped({**spec, "log_memory_stats": False}))
    times: list[float] = []
    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    data = torch.randint(0, 256, (args.steps * args.batch * devices, args.context + 1))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch)
    trainer = quiet_trainer(devices, strategy, args.steps, callbacks=[step_timer(times)])
    trainer.fit(model, loader)
    return times, sum(p.numel() for p in model.parameters()), trainer.global_rank


def run_child(name: str, args: argparse.Namespace, out: Path) -> dict:
    env = clean_env()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out)]
    for k in ("width", "depth", "context", "batch", "steps"):
        cmd += [f"--{k}", str(getattr(args, k))]
    if name == "in-process":
        cmd += ["--in-process", str(args.in_process), "--skip", str(args.skip)]
    _, log = run_ranks(cmd, 1 if name == "in-process" else CONTENDERS[name][0], env, timeout=1800)
    if not out.exists():
        raise RuntimeError(f"{name} failed:\n{log[-3000:]}")
    return json.loads(out.read_text())


def measure(args: argparse.Namespace) -> dict:
    if getattr(args, "in_process", 0):
        return measure_in_process(args)
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
            steady = res["times"][args.skip :] or res["times"]
            per_run[name].append(statistics.median(steady))
    rows = []
    for name, (devices, _) in CONTENDERS.items():
        if devices not in args.ranks:
            continue
        ratio, ratios = round_ratios(per_run[name], per_run[BASELINE[devices]])
        rows.append(
            {
                "contender": name,
                "ranks": devices,
                "median_ms": statistics.median(per_run[name]) * 1e3,
                "min_ms": min(per_run[name]) * 1e3,
                "max_ms": max(per_run[name]) * 1e3,
                "rounds_ms": [t * 1e3 for t in per_run[name]],
                "vs_baseline": ratio,
                "vs_baseline_rounds": ratios,
                "baseline": BASELINE[devices],
            }
        )
    return {
        "params": params,
        "width": args.width,
        "depth": args.depth,
        "context": args.context,
        "batch": args.batch,
        "steps": args.steps,
        "skip": args.skip,
        "repeats": args.repeats,
        "rows": rows,
    }


def measure_in_process(args: argparse.Namespace) -> dict:
    out = Path(tempfile.mkdtemp(prefix="step_overhead_")) / "in_process.json"
    res = run_child("in-process", args, out)
    base, name = IN_PROCESS
    per_run = {n: [r[n] for r in res["rounds"]] for n in IN_PROCESS}
    ratio, ratios = round_ratios(per_run[name], per_run[base])
    low, high = median_interval(ratios)
    rows = [
        {
            "contender": n,
            "ranks": 1,
            "median_ms": statistics.median(per_run[n]) * 1e3,
            "min_ms": min(per_run[n]) * 1e3,
            "max_ms": max(per_run[n]) * 1e3,
            "rounds_ms": [t * 1e3 for t in per_run[n]],
            "baseline": base,
            **(
                {"vs_baseline": ratio, "vs_baseline_rounds": ratios, "vs_baseline_95": [low, high]}
                if n == name
                else {"vs_baseline": 1.0}
            ),
        }
        for n in IN_PROCESS
    ]
    return {
        "params": res["params"],
        "width": args.width,
        "depth": args.depth,
        "context": args.context,
        "batch": args.batch,
        "steps": args.steps,
        "skip": args.skip,
        "repeats": args.in_process,
        "in_process": True,
        "rows": rows,
    }


def render(res: dict) -> str:
    lines = [
        f"GPT {res['params']:,} parameters (width {res['width']}, depth {res['depth']}, context {res['context']}, "
        f"batch {res['batch']} per rank), {res['steps']} steps a run minus {res['skip']} warm-up, "
        f"{res['repeats']} interleaved repeats; x baseline: the median of the per-round ratios",
        f"{'contender':<30} {'median ms':>10} {'min..max ms':>17} {'x baseline':>11} {'per round':>18}",
    ]
    for r in res["rows"]:
        rounds = r.get("vs_baseline_rounds", [])
        spread = f"{min(rounds):.3f}..{max(rounds):.3f}" if rounds else ""
        lines.append(
            f"{r['contender']:<30} {r['median_ms']:>10.1f} {r['min_ms']:>8.1f}..{r['max_ms']:<7.1f} "
            f"{r['vs_baseline']:>7.3f} ({r['baseline']}) {spread:>12}"
        )
        if "vs_baseline_95" in r:
            lines.append(
                f"{'':<30} 95% interval of the median ratio: {r['vs_baseline_95'][0]:.3f}.."
                f"{r['vs_baseline_95'][1]:.3f} ({len(rounds)} rounds in one process)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/step_overhead.json", width=384, depth=6, context=128, batch=8, steps=30)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        choices=(1, 2),
        default=[1, 2],
        help="run only the contenders on these rank counts",
    )
    p.add_argument(
        "--in-process",
        type=int,
        default=0,
        metavar="N",
        help="1 rank: auto and chunk resident alternated in one process, N rounds",
    )
    return run_or_child(p.parse_args(argv), {"*": child}, measure, render)


if __name__ == "__main__":
    main()
