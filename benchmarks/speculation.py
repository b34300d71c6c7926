"""What stepping on a guess costs: clipping by norm while stepping in backward, against stepping after backward.

    python benchmarks/speculation.py                                  # the example GPT (10.8M), 8 rounds
    python benchmarks/speculation.py --width 64 --depth 2 --context 16 --batch 2 --steps 5 --rounds 1   # seconds

One rank, ``placement="host"`` (every shard and its Adam step on the host), ``--precision`` (``32-true``: bf16 matmuls
are slow on a CPU without bf16 units; ``bf16-mixed`` adds the compute copy to what is kept), the example GPT's AdamW.
With ``step_in_backward=True`` and ``gradient_clip_val`` set, each host chunk steps in backward on the guess that the
clip's coefficient will be 1.0 and keeps a copy of its master, compute copy and moments until the step ([Note:
speculating past the norm and the overflow] in ``engine/optim/speculation.py``). Two regimes, each against
stepping after backward with the same clip:

- ``holds``: ``gradient_clip_val=1e9``, never clips: every guess is kept; the cost is the copy.
- ``undone``: ``gradient_clip_val=1e-3``, clips every step: every guess is undone and the chunk steps again after
  backward; the cost is the copy, the restore and a second step.

All four contenders are fitted one after the other in this process, ``--rounds`` times in an order shuffled each
round, so the machine's drift cancels in each round's ratio. Step time: median over the steps after ``--skip``; the
ratio is the median of the per-round ratios with a distribution-free 95% interval. Also: the copies' peak bytes a
parameter (``speculation_peak_bytes``) and the steps undone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    gpt_parser,
    make_gpt,
    markdown_table,
    median_interval,
    quiet_trainer,
    round_ratios,
    run_or_child,
    step_timer,
)

CLIP = {"holds": 1e9, "undone": 1e-3}
CONTENDERS = [(regime, early) for regime in CLIP for early in (False, True)]


def name(regime: str, early: bool) -> str:
    return f"{'on a guess' if early else 'after backward'} ({regime})"


def fit(args: argparse.Namespace, regime: str, early: bool) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_chunk import CheckOptions, ChunkOffloadStrategy

    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    params = sum(p.numel() for p in model.parameters())
    data = torch.randint(0, 256, (args.steps * args.batch, args.context + 1))
    strategy = ChunkOffloadStrategy(
        placement="host", step_in_backward=early, checks=CheckOptions(log_memory_stats=False)
    )
    times: list[float] = []
    trainer = quiet_trainer(
        1, strategy, args.steps, precision=args.precision, gradient_clip_val=CLIP[regime], callbacks=[step_timer(times)]
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    stats = strategy.memory_stats()
    return {
        "ms": 1000 * statistics.median(times[args.skip :] or times),
        "params": params,
        "copy_bytes_per_param": stats.get("speculation_peak_bytes", 0) / params,
        "undone": stats.get("speculation_rollbacks", 0),
        "optimizer_s": stats["time_optimizer_s"],
    }


def measure(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    rounds: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.rounds):
        order = list(CONTENDERS)
        rng.shuffle(order)
        rounds.append({name(r, e): fit(args, r, e) for r, e in order})
    rows = []
    for regime, early in CONTENDERS:
        n, base = name(regime, early), name(regime, False)
        ratio, ratios = round_ratios([r[n]["ms"] for r in rounds], [r[base]["ms"] for r in rounds])
        last = rounds[-1][n]
        rows.append(
            {
                "contender": n,
                "ms": statistics.median(r[n]["ms"] for r in rounds),
                "ratio": ratio,
                "interval": list(median_interval(ratios)),
                "copy_bytes_per_param": last["copy_bytes_per_param"],
                "undone": last["undone"],
                "steps": args.steps,
            }
        )
    return {
        "params": rounds[0][name(*CONTENDERS[0])]["params"],
        "precision": args.precision,
        "rounds": rounds,
        "rows": rows,
    }


def render(res: dict) -> str:
    title = (
        f"GPT of {res['params'] / 1e6:.1f}M parameters, placement='host', {res['precision']}, "
        f"{len(res['rounds'])} rounds"
    )
    columns = ["contender", "ms a step (median)", "x after backward", "95% interval", "copies, bytes a param"]
    rows = [
        [r["contender"], f"{r['ms']:.1f}", f"{r['ratio']:.3f}", "{:.3f}..{:.3f}".format(*r["interval"])]
        + [f"{r['copy_bytes_per_param']:.1f}", f"{r['undone']} of {r['steps'] - 1}"]
        for r in res["rows"]
    ]
    return markdown_table(title, [*columns, "steps undone"], rows)


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/speculation.json", width=384, depth=6, context=128, batch=8, steps=16)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    args = p.parse_args(argv)
    return run_or_child(args, {}, measure, render)


if __name__ == "__main__":
    main()
