"""A 1B+ parameter GPT on one GPU: chunk_offload against DDP and Lightning's FSDP with CPU offload.

    python benchmarks/gpu.py                                   # ~1.0B GPT (width 2048, depth 20), bf16-mixed
    python benchmarks/gpu.py --largest                         # also: the largest GPT that trains on this GPU
    python benchmarks/gpu.py --accelerator cpu --width 64 --depth 2 --context 16 --batch 2 --steps 3   # smoke test

Contenders, each a fresh ``Trainer.fit`` of ``--steps`` steps in its own process, on one device,
``precision="bf16-mixed"`` (``32-true`` on CPU), activation checkpointing on every block:

- ``chunk_offload``: ``placement="auto"`` with ``device_memory_limit=--device-limit`` (default 12 GiB,
  below the ~16 bytes a parameter the training state needs on the device without offload), so the
  placement policy must keep part of the shards, and of the Adam step, on the host.
- ``chunk_offload step_in_backward``: the same with ``step_in_backward=True``: each chunk steps as its
  gradients land, on a worker thread beside backward (``step_thread``'s default on a GPU);
  ``chunk_offload step_in_backward, no thread``: on the autograd thread (``step_thread=False``).
- ``chunk_offload default``: ``ChunkOffloadStrategy()`` as a user gets it: no limit given, so the limit is the
  device's free memory less a margin; on a GPU where the model fits, everything stays resident.
- ``ddp``: plain Lightning on one device (``strategy="auto"``): the reference where the model fits.
- ``fsdp + cpu offload``: ``FSDPStrategy(cpu_offload=True)`` wrapping each block; needs CUDA (reported
  as skipped otherwise, never faked).
- ``deepspeed zero-3 offload``: DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU
  (``DeepSpeedCPUAdam``), bf16 on CUDA, the same GPT, data and activation checkpointing in DeepSpeed's own loop,
  one rank told so in the variables torchrun sets; skipped where deepspeed is not installed
  (``pip install --no-build-isolation deepspeed``).

Per contender: median step time after ``--skip`` warm-up steps, tokens/s, model TFLOP/s (6 × parameters
+ 12 × depth × width × context FLOPs a token, the usual count for a decoder, checkpoint recompute not
credited), peak allocated device memory and the child's peak resident host memory; for the ``chunk_offload``
rows also the bytes copied each way a step and the parameters the host Adam steps, which
``gpu_campaign.py`` turns into a step's bound. ``--largest`` then runs ``scale.py``'s search on this GPU
(``--accelerator cuda --ranks 1``) for ``auto`` against ``chunk_offload``.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    deepspeed_offload_config,
    free_port,
    load_gpt,
    param_groups,
    proc_bytes,
    profiled_step,
    quiet_trainer,
    run_or_child,
    run_ranks,
    step_timer,
    watch_calls,
)

# in the order the GPU goals need them: a row of the 1.0B GPT took about 100 s on an H200 (2026-11-30), mostly its
# start-up, so the campaign's budget held three rows and stopped the fourth
CONTENDERS = (
    "chunk_offload step_in_backward",
    "ddp",
    "deepspeed zero-3 offload",
    "chunk_offload",
    "fsdp + cpu offload",
    "chunk_offload step_in_backward, no thread",
    "chunk_offload default",
)


def _flops_per_token(params: int, depth: int, width: int, context: int) -> int:
    return 6 * params + 12 * depth * width * context


def _model_and_data(args: argparse.Namespace) -> tuple[Any, Any]:
    """The GPT every contender trains (activation checkpointing on every block) and its token windows."""
    import lightning as L
    import torch

    L.seed_everything(0, verbose=False)
    model = load_gpt().GPT(
        width=args.width,
        depth=args.depth,
        heads=max(args.width // 128, 1),
        context=args.context,
        activation_checkpointing=True,
    )
    return model, torch.randint(0, 256, (args.steps * args.batch, args.context + 1))


def _write(args: argparse.Namespace, times: list[float], params: int, **extra: Any) -> None:
    import torch

    peak = torch.cuda.max_memory_allocated() if args.accelerator == "cuda" else 0
    out = {"times": times, "params": params, "peak_device": peak, "peak_host": proc_bytes("VmHWM"), **extra}
    Path(args.out).write_text(json.dumps(out))


# [Note: where a row's time goes]
# A row of the 1.0B GPT took about 100 s on an H200 for 8 steps of 0.3 s. Each child notes when it reached each
# phase (``time.perf_counter()``: CLOCK_MONOTONIC, one clock for every process of the machine) and the parent,
# which notes the launch and the exit, turns the marks into seconds a phase: ``phases`` in each row.
PHASES = (  # (name, the mark that ends it); each phase starts at the mark before
    ("launch", "started"),  # the interpreter and this script's imports
    ("imports", "imported"),  # torch, Lightning, the strategy's package (CUDA's start-up is in setup)
    ("build", "built"),  # the model, initialised on the host, and its data
    ("setup", "setup_done"),  # the Trainer and fit's setup: packing, placement, the optimizer
    ("first step", "first_step_done"),  # the warm-up step, its trace and repack
    ("other steps", "last_step_done"),
    ("teardown", "fit_done"),  # the end of fit: parameters given their values back
    ("exit", "ended"),  # results written, the process gone (memory given back)
)


def phase_marks(marks: dict[str, float]) -> Any:
    """A Lightning callback putting into ``marks`` when fit's setup ended and the first and last steps ended
    ([Note: where a row's time goes]); placed after ``step_timer``, which waits for the device."""
    import lightning as L

    class Marks(L.Callback):
        def on_train_start(self, *a: Any) -> None:
            marks["setup_done"] = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            marks.setdefault("first_step_done", time.perf_counter())
            marks["last_step_done"] = time.perf_counter()

    return Marks()


def phases(marks: dict[str, float]) -> dict[str, float]:
    """Seconds a phase from a child's marks and the parent's ``launched`` and ``ended`` (a mark a child did not
    reach is left out, and its phase with it)."""
    out, last = {}, marks.get("launched")
    for name, mark in PHASES:
        if mark in marks and last is not None:
            out[name] = marks[mark] - last
        last = marks.get(mark, last)
    return out


def traffic(strategy: Any, skip: int, store: dict, until: int | None = None) -> Any:
    """A callback putting into ``store`` the bytes ``strategy`` copied host to device and back a step after the
    first ``skip`` steps, the seconds a step the host spent on each cause of [Note: where a step's time goes]
    (``host_s_per_step``: on CUDA the host's waits, as for gradient copies before each step in backward), and the
    parameters its host Adam steps (a shard left on the host steps there); over the first ``until`` steps only
    (the timed ones: a profiled step after them runs slower)."""
    import lightning as L

    from lightning_chunk.engine.chunks.chunk import Tier

    seen: list[tuple[int, int, dict[str, float]]] = []

    class Traffic(L.Callback):
        def on_train_batch_end(self, *a: Any) -> None:
            if until is not None and len(seen) >= until:
                return
            mgr = strategy.engine.manager
            seen.append((mgr.transfers.h2d_bytes, mgr.transfers.d2h_bytes, dict(mgr.clock.seconds)))
            steps = len(seen) - min(skip, len(seen) - 1)
            first = seen[-steps - 1] if steps < len(seen) else (0, 0, dict.fromkeys(seen[-1][2], 0.0))
            store["h2d_per_step"] = (seen[-1][0] - first[0]) / steps
            store["d2h_per_step"] = (seen[-1][1] - first[1]) / steps
            store["host_s_per_step"] = {k: (v - first[2][k]) / steps for k, v in seen[-1][2].items()}
            copies = mgr.reducer.offload.stats()  # gradient copies the worker landed, and those a drain landed first
            store["grad_copies"] = {k: copies[k] for k in ("grad_copies_handed_over", "grad_copies_landed_by_drain")}
            low = mgr.grads.low  # chunks stepped from their bf16 gradients ([Note: gradients in bf16 until the step])
            store["grad_copies"]["chunks_stepped_from_bf16_grads"] = low.taken - low.widened
            store["host_stepped"] = sum(
                c.shard_numel for c in mgr.chunks if c.trainable and c.shard_tier is not Tier.DEVICE
            )

    return Traffic()


def child_deepspeed(args: argparse.Namespace) -> None:
    """DeepSpeed's own loop, one rank under torchrun: forward, ``engine.backward``, ``engine.step``, timed a step."""
    import os

    marks = {"started": time.perf_counter()}
    cuda = args.accelerator == "cuda"
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.nn.functional as F

    marks["imported"] = time.perf_counter()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    model, data = _model_and_data(args)
    params = sum(p.numel() for p in model.parameters())
    marks["built"] = time.perf_counter()
    engine, *_ = deepspeed.initialize(
        model=model, config=deepspeed_offload_config(args.batch, cuda), model_parameters=param_groups(model)
    )
    marks["setup_done"] = time.perf_counter()
    times = []
    for step in range(args.steps):
        batch = data[step * args.batch : (step + 1) * args.batch].to(engine.device)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        logits = engine(batch[:, :-1])
        engine.backward(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        marks.setdefault("first_step_done", time.perf_counter())
    marks["last_step_done"] = marks["fit_done"] = time.perf_counter()
    _write(args, times, params, marks=marks)
    torch.distributed.destroy_process_group()


def child(args: argparse.Namespace) -> None:
    marks = {"started": time.perf_counter()}
    import lightning  # noqa: F401  (timed with the imports)
    import torch

    from lightning_chunk import CheckOptions, ChunkOffloadStrategy, OffloadOptions
    from lightning_chunk.engine.config import parse_bytes

    marks["imported"] = time.perf_counter()
    cuda = args.accelerator == "cuda"
    if args.child.startswith("chunk_offload") and args.child != "chunk_offload default":
        strategy = ChunkOffloadStrategy(
            placement="auto",
            device_memory_limit=parse_bytes(args.device_limit, field="--device-limit"),
            step_in_backward="step_in_backward" in args.child,
            offload=OffloadOptions(step_thread=False if args.child.endswith("no thread") else None),
            checks=CheckOptions(log_memory_stats=False),
        )
    elif args.child == "chunk_offload default":  # what a user gets: the limit is the device's free memory less a margin
        strategy = ChunkOffloadStrategy(checks=CheckOptions(log_memory_stats=False))
    elif args.child == "ddp":
        strategy = "auto"
    else:
        from lightning.pytorch.strategies import FSDPStrategy

        gpt = load_gpt()
        strategy = FSDPStrategy(cpu_offload=True, auto_wrap_policy={gpt.Block})
    model, data = _model_and_data(args)
    params = sum(p.numel() for p in model.parameters())
    marks["built"] = time.perf_counter()
    times: list[float] = []
    moved: dict[str, float] = {}
    callbacks = [step_timer(times), phase_marks(marks)]
    profiled = args.profile and isinstance(strategy, ChunkOffloadStrategy)  # one step more, profiled and not timed
    if isinstance(strategy, ChunkOffloadStrategy):
        callbacks += [traffic(strategy, args.skip, moved, args.steps), watch_calls(moved)]
    if profiled:
        callbacks.append(profiled_step(moved, args.steps))
    precision = "bf16-mixed" if cuda else "32-true"
    steps = args.steps + profiled
    trainer = quiet_trainer(1, strategy, steps, args.accelerator, precision=precision, callbacks=callbacks)
    if cuda:
        torch.cuda.synchronize()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    marks["fit_done"] = time.perf_counter()
    _write(args, times[: args.steps], params, marks=marks, **moved)


ENGINE_KEYS = (
    "h2d_per_step",
    "d2h_per_step",
    "host_stepped",
    "host_s_per_step",
    "grad_copies",
    "profile",
    "calls",
)  # chunk_offload


def run(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    if name == "fsdp + cpu offload" and args.accelerator != "cuda":
        return {"contender": name, "skipped": "Lightning's FSDP with CPU offload needs CUDA"}
    deepspeed = name == "deepspeed zero-3 offload"
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        return {"contender": name, "skipped": "deepspeed is not installed"}
    out = scratch / f"{name.replace(' ', '_')}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out)]
    for k in ("width", "depth", "context", "batch", "steps", "skip", "accelerator", "device_limit"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    cmd += ["--profile"] * bool(getattr(args, "profile", False))
    env = clean_env()
    if deepspeed:  # one rank, told so as torchrun would (deepspeed.init_distributed reads it); no torchrun, whose
        # worker leads a session of its own and so outlived a stop at the budget, holding the GPU
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # a caller with a time budget (gpu_campaign.py) gives a deadline: a child still running then is stopped
    timeout = max(getattr(args, "deadline", time.monotonic() + 3600) - time.monotonic(), 1)
    launched = time.perf_counter()
    output = run_ranks(cmd, 1, env, timeout=timeout)[1]
    ended = time.perf_counter()
    if not out.exists():
        tail = [ln for ln in output.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        return {"contender": name, "failed": tail[0][:300]}  # e.g. out of memory where the model does not fit
    res = json.loads(out.read_text())
    spent = phases({**res.get("marks", {}), "launched": launched, "ended": ended})
    steady = res["times"][args.skip :] or res["times"]
    step = statistics.median(steady)
    tokens = args.batch * args.context / step
    return {
        "contender": name,
        "median_s": step,
        "min_s": min(steady),
        "max_s": max(steady),
        "tokens_per_s": tokens,
        "tflops": tokens * _flops_per_token(res["params"], args.depth, args.width, args.context) / 1e12,
        "peak_device": res["peak_device"],
        "peak_host": res["peak_host"],
        "params": res["params"],
        **{k: res[k] for k in ENGINE_KEYS if k in res},
        "wall_s": ended - launched,
        "phases": spent,
    }


def measure(args: argparse.Namespace) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="gpu_"))
    rows = []
    # each row as it lands: a run stopped part-way still reports what it measured
    for name in getattr(args, "contenders", None) or CONTENDERS:
        rows.append(run(name, args, scratch))
        print(json.dumps(rows[-1]), flush=True)
    base = next((r for r in rows if r["contender"] == "ddp" and "median_s" in r), None)
    for r in rows:
        if base and "median_s" in r:
            r["vs_ddp"] = r["median_s"] / base["median_s"]
    res = {
        "params": next((r["params"] for r in rows if "params" in r), 0),
        "width": args.width,
        "depth": args.depth,
        "context": args.context,
        "batch": args.batch,
        "steps": args.steps,
        "accelerator": args.accelerator,
        "device_limit": args.device_limit,
        "rows": rows,
    }
    if args.largest:
        import scale

        device_limit = None
        if args.accelerator == "cuda":  # the whole GPU but a margin for the CUDA context and fragmentation
            import torch

            device_limit = str(int(0.92 * torch.cuda.get_device_properties(0).total_memory))
        sargs = argparse.Namespace(
            width=args.width,
            context=args.context,
            batch=args.batch,
            steps=3,
            ranks=1,
            accelerator=args.accelerator,
            host_limit=args.host_limit,
            device_limit=device_limit,
            max_depth=args.max_depth,
        )
        res["largest"] = [scale.largest(name, sargs, scratch) for name in scale.contenders(1)]
    return res


def render(res: dict) -> str:
    gib = 2**30
    lines = [
        f"GPT {res['params']:,} parameters (width {res['width']}, depth {res['depth']}, context {res['context']}, "
        f"batch {res['batch']}), one {res['accelerator']} device, chunk_offload device limit {res['device_limit']}",
        f"{'contender':<42} {'median s':>9} {'tokens/s':>10} {'TFLOP/s':>8} {'peak dev GiB':>13} "
        f"{'peak host GiB':>14} {'x ddp':>6}",
    ]
    for r in res["rows"]:
        if "median_s" not in r:
            lines.append(
                f"{r['contender']:<42} {r.get('skipped') and 'skipped: ' + r['skipped'] or 'failed: ' + r['failed']}"
            )
            continue
        ratio = f"{r['vs_ddp']:.2f}" if "vs_ddp" in r else "-"
        lines.append(
            f"{r['contender']:<42} {r['median_s']:>9.3f} {r['tokens_per_s']:>10.0f} {r['tflops']:>8.1f} "
            f"{r['peak_device'] / gib:>13.2f} {r['peak_host'] / gib:>14.2f} {ratio:>6}"
        )
    for r in res.get("largest", []):
        lines.append(f"largest for {r['contender']}: depth {r['depth']}, {r['params']:,} parameters")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("width", 2048), ("depth", 20), ("context", 1024), ("batch", 8), ("steps", 8), ("skip", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--device-limit", default="12GiB")
    p.add_argument("--largest", action="store_true", help="also search the largest GPT that trains on this GPU")
    p.add_argument("--host-limit", default="100GiB", help="host memory the --largest search may use")
    p.add_argument("--max-depth", type=int, default=512)
    p.add_argument("--out", default="benchmarks/results/gpu.json")
    p.add_argument("--profile", action="store_true", help="chunk_offload rows: one step more, under torch's profiler")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return run_or_child(p.parse_args(argv), {"deepspeed zero-3 offload": child_deepspeed, "*": child}, measure, render)


if __name__ == "__main__":
    main()
