"""What the benchmark scripts share: the example GPT, child processes with a clean environment, timing, results."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIST_VARS = ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "PL_GLOBAL_SEED")


def clean_env() -> dict[str, str]:
    """The environment for a child that starts its own ranks: no leftovers of a parent's process group."""
    return {k: v for k, v in os.environ.items() if k not in DIST_VARS}


def load_gpt() -> Any:
    """``examples/gpt/main.py`` as a module (GPT, ByteCorpus)."""
    spec = importlib.util.spec_from_file_location("gpt_main", ROOT / "examples/gpt/main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_gpt(args: argparse.Namespace, **kw: Any) -> Any:
    return load_gpt().GPT(width=args.width, depth=args.depth, heads=max(args.width // 64, 1), context=args.context, **kw)


def step_timer(times: list[float]) -> Any:
    """A Lightning callback appending each training step's wall time to ``times`` (device work included)."""
    import lightning as L

    import torch

    def sync() -> None:  # CUDA runs ahead of the host: a step ends when its kernels have
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    class StepTimer(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            sync()
            self.t = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            sync()
            times.append(time.perf_counter() - self.t)

    return StepTimer()


def proc_bytes(field: str, pid: str = "self") -> int:
    """A byte count from /proc/PID/status (``VmHWM``: peak resident set; ``VmRSS``: resident now); 0 if gone."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def train_end_peak(store: dict) -> Any:
    """A Lightning callback putting the peak resident bytes at the end of training (before the strategy's
    teardown, which the peers' plain loops do not have) into ``store["peak_rss"]``."""
    import lightning as L

    class TrainEndPeak(L.Callback):
        def on_train_end(self, *a: Any) -> None:
            store["peak_rss"] = proc_bytes("VmHWM")

    return TrainEndPeak()


def gpt_parser(doc: str, out: str, **defaults: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    for name in ("width", "depth", "context", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, default=defaults[name])
    p.add_argument("--out", default=out)
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def run_or_child(args: argparse.Namespace, children: dict[str, Any], measure: Any, render: Any) -> dict:
    """A script's ``main``: as ``--child NAME``, run ``children[NAME]`` (one contender in its own process);
    otherwise measure every contender, print the table and write the JSON."""
    if args.child:
        children.get(args.child, children.get("*"))(args)
        return {}
    res = measure(args)
    print(render(res), flush=True)
    return save_results(res, args.out)


def round_ratios(times: list[float], base: list[float]) -> tuple[float, list[float]]:
    """The median of per-round ratios and the ratios: ``times[i] / base[i]``, both measured in round ``i``. A
    machine that drifts between rounds moves both sides of each ratio alike; a ratio of the pooled medians
    would compare one round's contender with another round's baseline."""
    ratios = [a / b for a, b in zip(times, base)]
    return statistics.median(ratios), ratios


def median_interval(xs: list[float], confidence: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``xs``: order statistics ``k`` and ``n + 1 - k`` (1-based),
    ``k`` the largest with P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2. With too few values for that
    confidence (5 or fewer at 95%), the smallest and the largest."""
    import math

    s, n = sorted(xs), len(xs)
    k, below = 0, 0.0
    while k < n // 2:
        p = math.comb(n, k) / 2**n
        if below + p > (1 - confidence) / 2:
            break
        below += p
        k += 1
    return (s[k - 1], s[n - k]) if k else (s[0], s[-1])


def save_results(res: dict, out: str) -> dict:
    import torch

    res["meta"] = {"machine": platform.platform(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "date": time.strftime("%Y-%m-%d")}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return res
