"""What the benchmark scripts share: the example GPT, child processes with a clean environment, timing, results."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIST_VARS = (
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
)


# set by the test suite's smoke runs: ranks forked from a preloaded server ([Note: forked ranks] in tests/forked.py)
FORK_SWITCH = "LIGHTNING_CHUNK_BENCH_FORK"


def clean_env() -> dict[str, str]:
    """The environment for a child that starts its own ranks: no leftovers of a parent's process group."""
    return {k: v for k, v in os.environ.items() if k not in DIST_VARS}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    cmd: list[str], ranks: int, env: dict[str, str], timeout: float, watch: Callable[[int], bool] | None = None
) -> tuple[int, str]:
    """Run ``ranks`` copies of a child that fits with ``devices=ranks``, started at once, each told its rank in the
    variables Lightning's launcher reads, as torchrun and SLURM start ranks: ``(return code, output)``, the first
    non-zero code of a rank if any. Left to Lightning's launcher, the second rank starts importing torch and
    Lightning only when the first reaches ``fit`` (5 s of imports here), so every two-rank run paid that twice;
    what a child measures (its steps) is the same. Each rank gets the launcher's thread count, its share of the cores
    (``OMP_NUM_THREADS``, where the caller did not set it): a strategy whose ranks were started outside it starts no
    launcher, and torch's default, every core in every rank, would run four threads on two cores.

    The ranks share one process group, ended as a whole when a rank fails (as the launcher's observer ends the
    others), at ``timeout``, or when ``watch(pgid)``, asked every 50 ms, says so."""
    port = str(free_port())
    threads = max(1, len(os.sched_getaffinity(0)) // ranks)  # Lightning's _suggested_max_num_threads
    envs = [
        env
        if ranks == 1
        else {
            "OMP_NUM_THREADS": str(threads),
            **env,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        for r in range(ranks)
    ]
    if os.environ.get(FORK_SWITCH) == "1" and watch is None and cmd[:1] == [sys.executable]:
        return _run_forked(cmd[1:], envs, timeout)
    logs = [tempfile.TemporaryFile("w+") for _ in range(ranks)]
    procs: list[subprocess.Popen] = []
    for rank_env, log in zip(envs, logs, strict=True):
        group = procs[0].pid if procs else 0  # rank 0 leads a new group, the others join it
        procs.append(
            subprocess.Popen(
                cmd,
                env=rank_env,
                stdout=log,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
                preexec_fn=lambda g=group: os.setpgid(0, g),
            )
        )
    pgid, deadline = procs[0].pid, time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if (
            time.monotonic() > deadline
            or any(p.poll() not in (None, 0) for p in procs)
            or (watch is not None and watch(pgid))
        ):
            break
        time.sleep(0.05)
    try:  # what is left of the group: the others after a failure, and anything a rank started
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out = []
    for p, log in zip(procs, logs, strict=True):
        p.wait()
        log.seek(0)
        out.append(log.read())
        log.close()
    return next((p.returncode for p in procs if p.returncode), 0), "".join(out)


def _run_forked(argv: list[str], envs: list[dict[str, str]], timeout: float) -> tuple[int, str]:
    """``run_ranks`` for the test suite's smoke runs ([Note: forked ranks] in tests/forked.py): each rank forked from
    a server that has imported torch and Lightning already, so a tiny run does not spend most of its time importing
    them. What a child measures, its steps, is the same; a benchmark run for its numbers starts fresh processes."""
    from tests.forked import ForkedProcess

    logs = [Path(tempfile.mkstemp(suffix=".log")[1]) for _ in envs]
    procs = [ForkedProcess(Path(argv[0]), argv[1:], e, ROOT, log, None) for e, log in zip(envs, logs, strict=True)]
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            break
        time.sleep(0.05)
    for p in procs:
        p.kill()
        p.wait()
    out = "".join(log.read_text() for log in logs)
    for log in logs:
        log.unlink()
    return next((p.returncode for p in procs if p.returncode), 0), out


def load_gpt() -> Any:
    """``examples/gpt/main.py`` as a module (GPT, ByteCorpus)."""
    spec = importlib.util.spec_from_file_location("gpt_main", ROOT / "examples/gpt/main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_gpt(args: argparse.Namespace, **kw: Any) -> Any:
    return load_gpt().GPT(
        width=args.width, depth=args.depth, heads=max(args.width // 64, 1), context=args.context, **kw
    )


def param_groups(model: Any) -> list[dict]:
    """Weight decay on matrices only, as the example GPT's ``configure_optimizers`` does: for the peers' own loops."""
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def deepspeed_offload_config(batch: int, cuda: bool) -> dict:
    """DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU (its ZeRO-Offload for ZeRO-3), AdamW as the
    example GPT's; bf16 and pinned host memory on CUDA, fp32 on CPU."""
    offload = {"device": "cpu", "pin_memory": cuda}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": dict(offload)},
        "bf16": {"enabled": cuda},
        "steps_per_print": 10**9,
    }


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


COPY_NAMES = ("Memcpy", "Memset")  # the profiler's names of the device's copies and fills, not kernels


def on_device(event: Any) -> bool:
    """A profiler event that ran on an accelerator (a kernel, a copy), not on the host."""
    return getattr(getattr(event, "device_type", None), "name", "CPU") != "CPU"


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The time inside at least one of ``spans`` (``(start, end)``): kernels on two streams at once count once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def profiled_step(store: dict, at: int) -> Any:
    """A Lightning callback profiling training step ``at`` (from 0) with torch's profiler into ``store["profile"]``: the
    25 ops and ranges (the engine's ``lc:CAUSE``, [Note: where a step's time goes]) that took most of the host's own
    time, and the 10 kernels and copies that took most of the device's, in ms, with their counts; the step's wall ms,
    and the ms the device was busy in it (``busy_ms``: kernels and copies, overlaps counted once; ``compute_ms``:
    kernels alone). A lease's table then says what a cause's seconds were spent on, and whether the step waited on
    the device or the device on the host, without a second run."""
    import lightning as L
    import torch
    from torch.profiler import ProfilerActivity, profile

    class Profiled(L.Callback):
        prof: Any = None

        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            if trainer.global_step == at and self.prof is None:
                cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
                self.prof = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
                self.prof.__enter__()
                self.t = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if self.prof is None or "profile" in store:
                return
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t
            self.prof.__exit__(None, None, None)
            ops = self.prof.key_averages()

            def top(attr: str, n: int) -> list[list[Any]]:
                rows = sorted(ops, key=lambda e: getattr(e, attr, 0), reverse=True)[:n]
                return [[e.key, round(getattr(e, attr, 0) / 1e3, 3), e.count] for e in rows if getattr(e, attr, 0)]

            host, device = top("self_cpu_time_total", 25), top("self_device_time_total", 10)
            spans = [(e.name, e.time_range.start, e.time_range.end) for e in self.prof.events() if on_device(e)]
            store["profile"] = dict(
                host_self_ms=host,
                device_ms=device,
                step_ms=round(wall * 1e3, 3),
                busy_ms=round(busy_us([(a, b) for _, a, b in spans]) / 1e3, 3),
                compute_ms=round(busy_us([(a, b) for n, a, b in spans if not n.startswith(COPY_NAMES)]) / 1e3, 3),
            )

    return Profiled()


def quiet_trainer(ranks: int, strategy: Any, steps: int, accelerator: str = "cpu", **kw: Any) -> Any:
    """A ``Trainer`` that trains ``steps`` steps and writes, logs and validates nothing: what a script times."""
    import lightning as L

    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    evaluation = dict(limit_val_batches=0, num_sanity_val_steps=0)
    return L.Trainer(
        accelerator=accelerator, devices=ranks, strategy=strategy, max_steps=steps, **{**quiet, **evaluation, **kw}
    )


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


def markdown_table(title: str, columns: list[str], rows: list[list[str]]) -> str:
    """A title line, then a markdown table of ``rows`` under ``columns``."""
    lines = [title, "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def round_ratios(times: list[float], base: list[float]) -> tuple[float, list[float]]:
    """The median of per-round ratios and the ratios: ``times[i] / base[i]``, both measured in round ``i``. A
    machine that drifts between rounds moves both sides of each ratio alike; a ratio of the pooled medians
    would compare one round's contender with another round's baseline."""
    ratios = [a / b for a, b in zip(times, base, strict=True)]
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

    res["meta"] = {
        "machine": platform.platform(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")
    return res


# The engine's calls whose seconds say where a fit's set-up and first step went (each inclusive of those it makes:
# a pack's host buffers are inside its pack): a lent GPU's 1.0B row took 53 s to its first step's end and the 9.0B
# model more than 257 s, which nothing measured finer (2026-12-04).
WATCHED = (
    ("lightning_chunk.engine.runtime.engine", "ChunkEngine", "_place"),  # a pack: set-up's, the warm-up's repack
    ("lightning_chunk.engine.runtime.engine", "ChunkEngine", "prepare_step"),  # the warm-up's ends here
    ("lightning_chunk.engine.chunks.materialize", "DeferredInit", "value"),  # deferred init, module by module
    ("lightning_chunk.engine.tiers.storage", "HostStorage", "alloc"),  # host shard buffers (pinned on a GPU)
    ("lightning_chunk.engine.memory.manager", "ChunkManager", "gather"),
    ("lightning_chunk.engine.tiers.offload", "GradOffload", "copy"),
    ("lightning_chunk.engine.optim.binding", "OptimizerBinding", "step_chunk"),
    # the native host Adam's build (beside set-up on a GPU) and any wait for it, and inductor's vector ISA where a
    # host step asks for it first: functions of a module (owner None)
    ("lightning_chunk.engine.optim.adam_native", None, "native_kernel"),
    ("lightning_chunk.engine.optim.adam_native", None, "vector_isa"),
)


def watch_calls(marks: dict[str, Any]) -> Any:
    """Time ``WATCHED`` in this process (a child's) and return a Lightning callback that puts their seconds and
    calls into ``marks["calls"]``: ``{"set-up": {name: [seconds, calls]}, "first step": {...}, "second step":
    {...}}``, up to fit's start and over each of the first two training batches (the second carries one-time costs
    too: the first gradients taken in bf16, say)."""
    import importlib

    import lightning as L

    totals: dict[str, list[float]] = {}
    for module, owner, attr in WATCHED:
        mod = importlib.import_module(module)
        cls = mod if owner is None else getattr(mod, owner)
        fn, name = getattr(cls, attr), f"{owner or module.rsplit('.', 1)[-1]}.{attr}"
        totals[name] = [0.0, 0]

        def timed(*a: Any, _fn: Any = fn, _total: list[float] = totals[name], **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _total[0] += time.perf_counter() - t
                _total[1] += 1

        setattr(cls, attr, timed)
    calls: dict[str, dict[str, list[float]]] = marks.setdefault("calls", {})
    bounds: list[dict[str, list[float]]] = []  # the totals at fit's start and at each phase's end

    def snapshot() -> dict[str, list[float]]:
        since = bounds[-1] if bounds else {}
        zero = [0.0, 0]
        return {k: [round(v[0] - since.get(k, zero)[0], 3), v[1] - since.get(k, zero)[1]] for k, v in totals.items()}

    def close(phase: str) -> None:
        calls.pop(f"{phase} so far", None)
        calls[phase] = snapshot()
        bounds.append({k: list(v) for k, v in totals.items()})

    class Calls(L.Callback):
        def on_train_start(self, *a: Any) -> None:
            close("set-up")

        def on_train_batch_end(self, *a: Any) -> None:
            for phase in ("first step", "second step"):
                if phase not in calls:
                    return close(phase)

        def now(self) -> None:
            """The running step's seconds so far: a child stopped in it still says where they went."""
            for phase in ("first step", "second step"):
                if "set-up" in calls and phase not in calls:
                    calls[f"{phase} so far"] = snapshot()
                    return

    return Calls()
