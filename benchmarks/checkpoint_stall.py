"""A sharded save's stall of training: synchronous against written in the background (Lightning's AsyncCheckpointIO).

    python benchmarks/checkpoint_stall.py                       # the 99.5M GPT, 128 and 2048 tokens a step
    python benchmarks/checkpoint_stall.py --width 64 --depth 2 --shapes 16x2 --steps 6 --out /tmp/c.json  # seconds

Each row is one shape of step (context x batch, one rank, the default strategy) and three fits of ``--steps`` steps
in child processes: without a save (for the step time), with ``trainer.save_checkpoint`` after steps 2 and 5 written
synchronously, and the same saves with ``AsyncCheckpointIO``. A save's *stall* is the time the training thread is
held by it: the call itself, and in the background the waits and copies aside of the steps that change what the
writer has not read yet ([Note: training beside a save]); the goal is at most 10% of the synchronous stall. The
first save of a run copies aside into memory the process never touched (page faults); a later one finds the pages
the first freed. On a machine with few cores the writer's work (the kernel copying into the page cache) also slows
the steps it runs beside: that is not a stall of the training thread and not measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    clean_env,
    gpt_parser,
    make_gpt,
    quiet_trainer,
    run_or_child,
    run_ranks,
    step_timer,
)

MODES = ("none", "sync", "background")
SAVES_AFTER = (2, 5)  # the saves follow these steps: the later steps run beside a background save


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_chunk import ChunkOffloadStrategy

    mode = args.child
    saves: list[dict[str, Any]] = []

    class Save(L.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if mode == "none" or trainer.global_step not in SAVES_AFTER:
                return
            t0 = time.perf_counter()
            trainer.save_checkpoint(Path(args.out).with_suffix(f".{trainer.global_step}.ckpt"))
            running = trainer.strategy.engine.manager.readers.running
            saves.append({"call_s": time.perf_counter() - t0, "job": running[-1] if running else None})

        def on_train_end(self, trainer: Any, *a: Any) -> None:
            trainer.strategy.engine.manager.readers.settle()  # not a stall: training is over
            for s in saves:
                job = s.pop("job")
                s["waited_s"], s["aside_bytes"] = (job.waited_s, job.aside_bytes) if job else (0.0, 0)
                s["stall_s"] = s["call_s"] + s["waited_s"]

    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    data = torch.randint(0, 256, (args.steps * args.batch, args.context + 1))
    plugins = [AsyncCheckpointIO()] if mode == "background" else []
    strategy = ChunkOffloadStrategy(checks={"log_memory_stats": False})
    times: list[float] = []
    trainer = quiet_trainer(1, strategy, args.steps, callbacks=[Save(), step_timer(times)], plugins=plugins)
    t0 = time.perf_counter()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    seen = {"fit_s": time.perf_counter() - t0, "params": sum(p.numel() for p in model.parameters()), "saves": saves}
    seen["step_s"] = statistics.median(times[1:])  # after the warm-up's step
    Path(args.out).write_text(json.dumps(seen))


def measure(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="checkpoint_stall_"))  # per-run scratch (the checkpoints), not results
    rows, params = [], 0
    for shape in args.shapes:
        context, batch = (int(x) for x in shape.split("x"))
        row: dict[str, Any] = {"context": context, "batch": batch, "tokens": context * batch}
        for mode in MODES:
            out = tmp / f"{shape}-{mode}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--out", str(out)]
            for k, v in (("width", args.width), ("depth", args.depth), ("steps", args.steps)):
                cmd += [f"--{k}", str(v)]
            cmd += ["--context", str(context), "--batch", str(batch)]
            _, log = run_ranks(cmd, 1, clean_env(), timeout=3600)
            if not out.exists():
                raise RuntimeError(f"{shape} {mode} failed:\n{log[-3000:]}")
            row[mode] = res = json.loads(out.read_text())
            params = res["params"]
        row["stall_vs_sync"] = [
            b["stall_s"] / s["stall_s"] for b, s in zip(row["background"]["saves"], row["sync"]["saves"], strict=True)
        ]
        rows.append(row)
    return {"params": params, "width": args.width, "depth": args.depth, "steps": args.steps, "rows": rows}


def render(res: dict) -> str:
    def each(xs: list, fmt: str) -> str:
        return ", ".join(format(x, fmt) for x in xs)

    lines = [
        f"saves after steps {' and '.join(map(str, SAVES_AFTER))} of {res['steps']}, GPT of "
        f"{res['params'] / 1e6:.1f}M parameters, one rank; stalls in seconds, the first save's, then the later one's",
        "| tokens a step | step s | synchronous stall | background stall | background ÷ synchronous | aside MiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        sync, bg = r["sync"]["saves"], r["background"]["saves"]
        lines.append(
            f"| {r['tokens']} | {r['none']['step_s']:.2f} | {each([s['stall_s'] for s in sync], '.2f')} | "
            f"{each([s['stall_s'] for s in bg], '.3f')} | {each(r['stall_vs_sync'], '.1%')} | "
            f"{each([s['aside_bytes'] / 2**20 for s in bg], '.0f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    out = "benchmarks/results/checkpoint_stall.json"
    p = gpt_parser(__doc__, out, width=768, depth=14, context=64, batch=2, steps=8)
    p.add_argument("--shapes", nargs="+", default=["64x2", "256x8"], help="context x batch of each row")
    args = p.parse_args(argv)
    return run_or_child(args, {"*": child}, measure, render)


if __name__ == "__main__":
    main()
