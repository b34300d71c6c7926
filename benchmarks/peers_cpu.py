"""The same GPT on 2 CPU ranks (gloo), trained a few steps by chunk_offload and by its peers.

    python benchmarks/peers_cpu.py                                        # ~100M parameters
    python benchmarks/peers_cpu.py --width 64 --depth 2 --steps 3 --out /tmp/p.json   # seconds

Contenders, each in its own pair of processes:

- ``DDP``: ``Trainer(strategy="ddp", devices=2)``, everything replicated: the price of offloading is read
  against it (the ``x DDP`` column).
- ``chunk_offload (device)``: every shard resident (``placement="device"``): the cost of sharding alone.
- ``chunk_offload (host, ...)``: ``Trainer(strategy=ChunkOffloadStrategy(placement="host"), devices=2)``:
  every chunk sharded over the two ranks, every shard on the host tier, payloads fetched on use. With the
  defaults on a CPU device without a limit every payload is released after use and gathered again for backward
  (FSDP2's ``reshard_after_forward=True``, and the FSDP2 row's): with the automatic chunk size and with one
  transformer block a chunk (FSDP2's unit); and with ``reshard_after_forward=False`` (the default on an
  accelerator): each payload kept from forward until its last use in backward, so every chunk is gathered once a
  step, as DeepSpeed ZeRO-3's default.
- ``FSDP2 + CPUOffloadPolicy``: ``torch.distributed.fsdp.fully_shard`` on every block and the root,
  ``CPUOffloadPolicy(pin_memory=False)``, the same AdamW, in a plain training loop (outside
  Lightning, whose FSDP strategy is FSDP1).
- ``DeepSpeed ZeRO-3 offload``: ``deepspeed.initialize`` with ZeRO stage 3, ``offload_param`` and
  ``offload_optimizer`` to the CPU (so ``DeepSpeedCPUAdam`` steps), the same AdamW hyper-parameters,
  fp32, on the CPU accelerator with gloo, in a plain training loop (Lightning's DeepSpeed strategy
  refuses CPU). Reported as skipped when deepspeed is not importable, never faked.

With ``--repeats N`` every contender runs N times, the rounds interleaved in a shuffled order, and each ratio is
the median of the per-round ratios (against DDP's or FSDP2's run of the same round).

Per contender: the median step time after the first step, and each rank's peak resident memory
(VmHWM from /proc, the whole process: Python, torch, model and optimizer) when training ends: for
chunk_offload before its teardown gathers the full model back into the module, which the plain
loops of the peers do not do. For chunk_offload rows, each rank's time breakdown over the timed steps
(``ChunkTelemetry``: waits on all-gathers, reduce-scatters and agreements, tier copies, the optimizer, the
hooks; [Note: where a step's time goes]).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    ROOT,
    clean_env,
    deepspeed_offload_config,
    gpt_parser,
    make_gpt,
    param_groups,
    proc_bytes,
    round_ratios,
    run_or_child,
    run_ranks,
    step_timer,
    train_end_peak,
)


def _data(args: argparse.Namespace, ranks: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, ((args.steps + 1) * args.batch * ranks, args.context + 1), generator=g)


def child_chunk(args: argparse.Namespace) -> None:
    from lightning_chunk import ChunkOffloadStrategy, ChunkTelemetry
    from lightning_chunk.options import grouped

    telemetry = ChunkTelemetry(picture=False)
    extra = json.loads(args.strategy_json or "{}")  # e.g. '{"verify_collectives": false}', to measure one lever
    given = {"placement": args.placement, "chunk_numel": args.chunk_numel, "log_memory_stats": False, **extra}
    strategy = ChunkOffloadStrategy(**grouped(given))
    _lightning_child(args, strategy, [telemetry], lambda: telemetry.breakdown)


def child_ddp(args: argparse.Namespace) -> None:
    _lightning_child(args, "ddp", [], lambda: [])


def _lightning_child(args: argparse.Namespace, strategy: Any, callbacks: list, breakdown: Any) -> None:
    import lightning as L
    import torch

    times: list[float] = []
    peak: dict = {}
    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        strategy=strategy,
        callbacks=[step_timer(times), train_end_peak(peak), *callbacks],
    )
    trainer.fit(model, torch.utils.data.DataLoader(_data(args, 2), batch_size=args.batch))
    _report(args, trainer.global_rank, times, sum(p.numel() for p in model.parameters()), peak["peak_rss"], breakdown())
    torch.distributed.destroy_process_group()


def child_fsdp2(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = make_gpt(args)
    n_params = sum(p.numel() for p in model.parameters())
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    opt = torch.optim.AdamW(param_groups(model), lr=3e-4, betas=(0.9, 0.95))

    def backward_and_step(loss: Any) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad()

    _report(args, rank, _timed_steps(args, rank, model, backward_and_step), n_params)
    dist.destroy_process_group()


def child_deepspeed(args: argparse.Namespace) -> None:
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = make_gpt(args)
    n_params = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(
        model=model, config=deepspeed_offload_config(args.batch, cuda=False), model_parameters=param_groups(model)
    )

    def backward_and_step(loss: Any) -> None:
        engine.backward(loss)
        engine.step()

    _report(args, rank, _timed_steps(args, rank, engine, backward_and_step), n_params)
    torch.distributed.destroy_process_group()


def _timed_steps(args: argparse.Namespace, rank: int, forward: Any, backward_and_step: Any) -> list[float]:
    """The peers' plain training loop over this rank's half of the data: the wall time of each step."""
    import torch.nn.functional as F

    data = _data(args, 2)[rank::2]
    times = []
    for step in range(args.steps):
        batch = data[step * args.batch : (step + 1) * args.batch]
        t = time.perf_counter()
        logits = forward(batch[:, :-1])
        backward_and_step(F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1)))
        times.append(time.perf_counter() - t)
    return times


def _report(
    args: argparse.Namespace, rank: int, times: list[float], n_params: int, peak: int = 0, breakdown: list | None = None
) -> None:
    """Peak RSS at the end of training: for chunk_offload before its teardown gathers the model back."""
    Path(f"{args.out}.rank{rank}").write_text(
        json.dumps(
            {"times": times, "peak_rss": peak or proc_bytes("VmHWM"), "params": n_params, "breakdown": breakdown or []}
        )
    )


def run_contender(
    name: str,
    args: argparse.Namespace,
    chunk_numel: int | None = None,
    placement: str = "host",
    extra: dict | None = None,
) -> dict:
    env = clean_env()
    out = Path(tempfile.mkdtemp(prefix="peers_cpu_")) / f"{name}{chunk_numel or ''}"  # scratch, not results
    for r in (0, 1):
        Path(f"{out}.rank{r}").unlink(missing_ok=True)
    common = ["--child", name, "--out", str(out)] + [
        f"--{k}={getattr(args, k)}" for k in ("width", "depth", "context", "batch", "steps")
    ]
    if chunk_numel:
        common.append(f"--chunk-numel={chunk_numel}")
    common.append(f"--placement={placement}")
    strategy_kw = {**json.loads(getattr(args, "strategy_json", None) or "{}"), **(extra or {})}
    if strategy_kw:
        common.append(f"--strategy-json={json.dumps(strategy_kw)}")
    if name in ("fsdp2", "deepspeed"):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--master-port=29517",
            str(Path(__file__).resolve()),
            *common,
        ]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
        log = r.stdout + r.stderr
    else:  # Lightning's strategies: both ranks started at once, as torchrun does
        _, log = run_ranks([sys.executable, str(Path(__file__).resolve()), *common], 2, env, timeout=3600)
    ranks = []
    for rank in (0, 1):
        f = Path(f"{out}.rank{rank}")
        if not f.exists():
            raise RuntimeError(f"{name} failed on rank {rank}:\n{log[-3000:]}")
        ranks.append(json.loads(f.read_text()))
    steady = [t for rk in ranks for t in rk["times"][1:]] or [t for rk in ranks for t in rk["times"]]
    return {
        "median_s": statistics.median(steady),
        "min_s": min(steady),
        "max_s": max(steady),
        "peak_rss": [rk["peak_rss"] for rk in ranks],
        "params": ranks[0]["params"],
        "breakdown": ranks[0].get("breakdown", []),
    }


LABELS = {
    "chunk": "chunk_offload (host)",
    "fsdp2": "FSDP2 + CPUOffloadPolicy",
    "deepspeed": "DeepSpeed ZeRO-3 offload",
    "ddp": "DDP (everything replicated)",
}


CONTENDERS = (  # (row, child, chunk_numel: None or "block", placement, further ChunkOffloadStrategy arguments)
    (LABELS["ddp"], "ddp", None, "host", None),
    (LABELS["fsdp2"], "fsdp2", None, "host", None),
    ("chunk_offload (device, auto chunk size)", "chunk", None, "device", None),
    ("chunk_offload (host, auto chunk size)", "chunk", None, "host", None),
    ("chunk_offload (host, one block a chunk)", "chunk", "block", "host", None),
    ("chunk_offload (host, kept for backward)", "chunk", None, "host", {"reshard_after_forward": False}),
    (LABELS["deepspeed"], "deepspeed", None, "host", None),
)


def measure(args: argparse.Namespace) -> dict:
    """``--repeats`` rounds; each runs every contender once, in a shuffled order. A row's ratios are the medians
    of its per-round ratios (each against DDP's or FSDP2's run of the same round), so a machine that drifts
    between rounds moves both sides of a ratio alike; one round alone can be off by 2x on a shared machine."""
    block_numel = 12 * args.width * args.width + 13 * args.width  # one transformer block: FSDP2's unit here
    has_ds = importlib.util.find_spec("deepspeed") is not None
    runs: dict[str, list[dict]] = {row: [] for row, *_ in CONTENDERS}
    rng = random.Random(0)
    for _ in range(args.repeats):
        order = [c for c in CONTENDERS if c[1] != "deepspeed" or has_ds]
        rng.shuffle(order)
        for row, child, numel, placement, extra in order:
            runs[row].append(
                run_contender(child, args, block_numel if numel == "block" else None, placement=placement, extra=extra)
            )
    rows = []
    for row, _child, *_ in CONTENDERS:
        if not runs[row]:
            rows.append({"contender": row, "skipped": "deepspeed is not installed"})
            continue
        r = runs[row]
        per_round = [x["median_s"] for x in r]
        rows.append(
            {
                "contender": row,
                "median_s": statistics.median(per_round),
                "min_s": min(x["min_s"] for x in r),
                "max_s": max(x["max_s"] for x in r),
                "rounds_s": per_round,
                "peak_rss": [max(x["peak_rss"][k] for x in r) for k in (0, 1)],
                "params": r[0]["params"],
                "breakdown": r[-1]["breakdown"],
            }
        )
    for r in rows:
        if "median_s" in r:
            for key, peer in (("vs_ddp", LABELS["ddp"]), ("vs_fsdp2", LABELS["fsdp2"])):
                base = next(x for x in rows if x["contender"] == peer)["rounds_s"]
                r[key], r[f"{key}_rounds"] = round_ratios(r["rounds_s"], base)
    return {
        "params": rows[0]["params"],
        "block_numel": block_numel,
        "width": args.width,
        "depth": args.depth,
        "context": args.context,
        "batch": args.batch,
        "steps": args.steps,
        "repeats": args.repeats,
        "rows": rows,
    }


def render(res: dict) -> str:
    gib = 2**30
    lines = [
        f"GPT {res['params']:,} parameters (width {res['width']}, depth {res['depth']}, context {res['context']}, "
        f"batch {res['batch']} per rank), 2 gloo ranks, {res['steps']} steps (the first not timed), "
        f"{res.get('repeats', 1)} interleaved round(s); ratios: median of the per-round ratios",
        f"{'contender':<40} {'median s':>9} {'min..max s':>14} {'x DDP':>6} {'x FSDP2':>8} "
        f"{'peak RSS GiB (rank 0, 1)':>26}",
    ]
    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"{r['contender']:<40} skipped: {r['skipped']}")
            continue
        rss = ", ".join(f"{b / gib:.2f}" for b in r["peak_rss"])
        lines.append(
            f"{r['contender']:<40} {r['median_s']:>9.2f} {r['min_s']:>6.2f}..{r['max_s']:<6.2f} "
            f"{r['vs_ddp']:>6.2f} {r['vs_fsdp2']:>8.2f} {rss:>26}"
        )
    if res.get("repeats", 1) > 1:
        lines.append(
            "x DDP per round: "
            + "; ".join(
                f"{r['contender']}: " + ", ".join(f"{x:.2f}" for x in r["vs_ddp_rounds"])
                for r in res["rows"]
                if "median_s" in r
            )
        )
    for r in res["rows"]:
        if r.get("breakdown"):
            from lightning_chunk.telemetry import breakdown_table

            lines += ["", f"{r['contender']}:", breakdown_table(r["breakdown"]).split("\n", 1)[1]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/peers_cpu.json", width=768, depth=14, context=64, batch=2, steps=4)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved rounds of every contender (3 or more to read a ratio on a shared machine)",
    )
    p.add_argument("--chunk-numel", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--placement", default="host", help=argparse.SUPPRESS)
    p.add_argument("--strategy-json", default=None, help=argparse.SUPPRESS)
    children = {"chunk": child_chunk, "ddp": child_ddp, "fsdp2": child_fsdp2, "deepspeed": child_deepspeed}
    return run_or_child(p.parse_args(argv), children, measure, render)


if __name__ == "__main__":
    main()
