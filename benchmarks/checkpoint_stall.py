"""A sharded save's stall of training: synchronous against written in the background (Lightning's AsyncCheckpointIO).

    python benchmarks/checkpoint_stall.py                       # the 99.5M GPT, 128 and 2048 tokens a step
    python benchmarks/checkpoint_stall.py --width 64 --depth 2 --shapes 16x2 --steps 4 --out /tmp/c.json  # seconds

Each row is one shape of step (context x batch, one rank, the default strategy) and three fits of ``--steps`` steps
in child processes: without a save, with ``trainer.save_checkpoint`` after step 2 written synchronously, and the
same save with ``AsyncCheckpointIO``. The *stall* is the time the training thread is held by the save: the call
itself, and in the background mode the waits (and copies aside) of the steps that change what the writer has not
read yet ([Note: training beside a save]); the goal is at most 10% of the synchronous stall. The fits' wall times
against the fit without a save are also given: on a machine with few cores the writer's work (the kernel copying
into the page cache) also slows the steps it runs beside.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import clean_env, gpt_parser, make_gpt, quiet_trainer, run_or_child, run_ranks  # noqa: E402

MODES = ("none", "sync", "background")
SAVE_AFTER = 2  # the save follows this step: the later steps run beside a background save


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from lightning_chunk import ChunkOffloadStrategy

    mode = args.child
    seen: dict[str, Any] = {}

    class Save(L.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if mode == "none" or trainer.global_step != SAVE_AFTER:
                return
            t0 = time.perf_counter()
            trainer.save_checkpoint(Path(args.out).with_suffix(".ckpt"))
            seen["call_s"] = time.perf_counter() - t0
            running = trainer.strategy.engine.manager.readers.running
            seen["save"] = running[-1] if running else None

        def on_train_end(self, trainer: Any, *a: Any) -> None:
            save = seen.pop("save", None)
            if save is not None:
                t0 = time.perf_counter()
                trainer.strategy.engine.manager.readers.settle()  # not a stall: training is over
                seen["left_at_end_s"] = time.perf_counter() - t0
                seen["waited_s"], seen["aside_bytes"] = save.waited_s, save.aside_bytes

    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    data = torch.randint(0, 256, (args.steps * args.batch, args.context + 1))
    plugins = [AsyncCheckpointIO()] if mode == "background" else []
    strategy = ChunkOffloadStrategy(checks={"log_memory_stats": False})
    trainer = quiet_trainer(1, strategy, args.steps, callbacks=[Save()], plugins=plugins)
    t0 = time.perf_counter()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    seen["fit_s"] = time.perf_counter() - t0
    seen["params"] = sum(p.numel() for p in model.parameters())
    seen["stall_s"] = seen.get("call_s", 0.0) + seen.get("waited_s", 0.0)
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
        sync, bg, none = row["sync"], row["background"], row["none"]
        row["stall_vs_sync"] = bg["stall_s"] / sync["stall_s"]
        row["fit_over_none"] = {m: row[m]["fit_s"] - none["fit_s"] for m in ("sync", "background")}
        rows.append(row)
    return {"params": params, "width": args.width, "depth": args.depth, "steps": args.steps, "rows": rows}


def render(res: dict) -> str:
    lines = [
        f"a save after step {SAVE_AFTER} of {res['steps']}, GPT of {res['params'] / 1e6:.1f}M parameters, one rank",
        "| tokens a step | step s | sync stall s | background stall s | stall / sync | copied aside MiB | "
        "fit over no save: sync s | background s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        step_s = r["none"]["fit_s"] / res["steps"]
        bg = r["background"]
        lines.append(
            f"| {r['tokens']} | {step_s:.2f} | {r['sync']['stall_s']:.2f} | {bg['stall_s']:.3f} | "
            f"{r['stall_vs_sync']:.1%} | {bg.get('aside_bytes', 0) / 2**20:.0f} | {r['fit_over_none']['sync']:.2f} | "
            f"{r['fit_over_none']['background']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/checkpoint_stall.json", width=768, depth=14, context=64, batch=2, steps=6)
    p.add_argument("--shapes", nargs="+", default=["64x2", "256x8"], help="context x batch of each row")
    args = p.parse_args(argv)
    return run_or_child(args, {"*": child}, measure, render)


if __name__ == "__main__":
    main()
