"""The largest GPT (depth grown at fixed width) that trains 3 steps under a memory limit, per strategy.

    python benchmarks/scale.py                                  # width 768, 3 GiB of host memory a rank
    python benchmarks/scale.py --width 64 --context 16 --host-limit 1GiB --max-depth 4 --out /tmp/s.json  # seconds
    python benchmarks/scale.py --accelerator cuda --ranks 1 --device-limit 20GiB --host-limit 100GiB   # on a GPU

Contenders, each attempt a fresh ``Trainer.fit`` of ``--steps`` steps in its own process group:

- ``--ranks 2`` (default, CPU with gloo): ``ddp`` against ``chunk_offload`` (``placement="host"``:
  every chunk sharded over the ranks, payloads fetched on use and dropped after).
- ``--ranks 1``: ``auto`` against ``chunk_offload`` (``placement="auto"`` with ``--device-limit``;
  on CUDA the peers get the same limit through ``torch.cuda.set_per_process_memory_fraction``).
- ``chunk_deferred``: ``chunk_offload`` with the GPT built in ``configure_model`` (``deferred_init=True``):
  on the meta device, initialised chunk by chunk, so no rank ever holds the whole model.
- ``chunk_early``: ``chunk_deferred`` with ``step_in_backward=True``: each chunk steps as its gradients land
  and gives its gradient shard back ([Note: stepping in backward]).
- ``chunk_adafactor``: ``chunk_deferred`` with torch's Adafactor in place of AdamW (``step_in_backward=None``: in
  backward on one rank, after it on several; [Note: optimizers that need whole parameters]).

``B/param``: the marginal bytes a parameter of the largest model that fits: the rank's peak resident set
minus its resident set just before the model was built, over the parameter count (ideal for ZeRO-3 on two
ranks in fp32 with AdamW: 8, half of the 16 bytes of weights, gradients and two moments).

The host limit is a budget for each rank's resident memory: a watchdog in this process reads the
resident set of every process of the attempt and kills the group the moment one passes it, and an
attempt counts only if it finished every step and each rank's peak (VmHWM) stayed under the limit
(and, on CUDA, its peak allocated device memory under ``--device-limit``). The peak is read when
training ends; chunk_offload runs with ``materialize_on_teardown=False`` (gathering the trained model
back into the module is a separate choice, not part of training). Depth doubles from 1 until
an attempt fails, then bisects. Fraction of the limit reached: parameters × 16 bytes (fp32 weight,
gradient and two Adam moments) over the host memory of all ranks together: the share of the
machine's memory the model's training state could fill if nothing were replicated or wasted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    ROOT,
    clean_env,
    make_gpt,
    param_groups,
    proc_bytes,
    quiet_trainer,
    run_or_child,
    run_ranks,
    train_end_peak,
)

sys.path.insert(0, str(ROOT))
from lightning_chunk.engine.config import parse_bytes  # noqa: E402

BYTES_PER_PARAM = 16  # fp32 weight + gradient + Adam's two moments


def contenders(ranks: int) -> dict[str, dict]:
    placement = "auto" if ranks == 1 else "host"
    return {
        ("auto" if ranks == 1 else "ddp"): {"strategy": "auto" if ranks == 1 else "ddp"},
        "chunk_offload": {"strategy": "chunk", "placement": placement},
        "chunk_deferred": {"strategy": "chunk", "placement": placement, "deferred": True},
        "chunk_early": {"strategy": "chunk", "placement": placement, "deferred": True, "step_in_backward": True},
        # torch's Adafactor in place of AdamW: a row and a column of state a matrix; in backward on one rank only
        "chunk_adafactor": {
            "strategy": "chunk",
            "placement": placement,
            "deferred": True,
            "step_in_backward": None,
            "optimizer": "adafactor",
        },
    }


# ------------------------------------------------------------------------------------------ child
def child(args: argparse.Namespace) -> None:
    """One attempt at ``args.depth``: train ``args.steps`` steps, each rank writes what it saw."""
    import lightning as L
    import torch

    from lightning_chunk import CheckOptions, ChunkOffloadStrategy, MemoryOptions

    spec = contenders(args.ranks)[args.child]
    cuda = args.accelerator == "cuda"
    device_limit = parse_bytes(args.device_limit, field="--device-limit") if args.device_limit else None
    if spec["strategy"] == "chunk":
        strategy = ChunkOffloadStrategy(
            placement=spec["placement"],
            device_memory_limit=device_limit,
            step_in_backward=spec.get("step_in_backward", False),
            memory=MemoryOptions(materialize_on_teardown=False),
            checks=CheckOptions(log_memory_stats=False),
        )
    else:
        strategy = spec["strategy"]
    peak: dict = {}
    L.seed_everything(0, verbose=False)
    before = proc_bytes("VmRSS")  # the marginal bytes a parameter count from here
    model = make_gpt(args, deferred_init=spec.get("deferred", False))
    if spec.get("optimizer") == "adafactor":  # the example's groups and learning rate, no schedule
        model.configure_optimizers = lambda: torch.optim.Adafactor(param_groups(model), lr=model.hparams.lr)
    data = torch.randint(0, 256, (args.steps * args.batch * args.ranks, args.context + 1))
    trainer = quiet_trainer(args.ranks, strategy, args.steps, args.accelerator, callbacks=[train_end_peak(peak)])
    if cuda and device_limit and spec["strategy"] != "chunk":
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, device_limit / torch.cuda.get_device_properties(trainer.local_rank).total_memory),
            trainer.local_rank,
        )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    # chunk_offload's teardown leaves the parameters empty (materialize_on_teardown=False); a deferred model had none
    params = (
        int(strategy.memory_stats()["param_numel"])
        if spec["strategy"] == "chunk"
        else sum(p.numel() for p in model.parameters())
    )
    report = {
        "steps": trainer.global_step,
        "params": params,
        "peak_rss": peak["peak_rss"],
        "rss_before_model": before,
        "peak_device": torch.cuda.max_memory_allocated() if cuda else 0,
    }
    Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(report))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------- parent
def _group_rss(pgid: int) -> list[int]:
    """Resident bytes of every live process in process group ``pgid``."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            out.append(proc_bytes("VmRSS", pid))
    return out


def attempt(name: str, depth: int, args: argparse.Namespace, scratch: Path) -> dict:
    """Run one attempt under the watchdog; say whether it fits and what it used."""
    out = scratch / f"{name}-{depth}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out), "--depth", str(depth)]
    for k in ("width", "context", "batch", "steps", "ranks", "accelerator", "device_limit", "host_limit"):
        if getattr(args, k) is not None:
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    host_limit = parse_bytes(args.host_limit, field="--host-limit")
    env = clean_env()
    if args.glibc_tunables:
        env["GLIBC_TUNABLES"] = args.glibc_tunables
    killed: list[int] = []
    watched_peak = [0]

    def over_limit(pgid: int) -> bool:
        rss = _group_rss(pgid)
        watched_peak[0] = max([watched_peak[0], *rss])
        if any(r > host_limit for r in rss):
            killed.append(max(rss))
            return True
        return False

    t0 = time.perf_counter()
    code, log = run_ranks(cmd, args.ranks, env, timeout=3600, watch=over_limit)
    ranks = [
        json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(args.ranks) if Path(f"{out}.rank{r}").exists()
    ]
    res = {
        "depth": depth,
        "seconds": time.perf_counter() - t0,
        "params": ranks[0]["params"] if ranks else None,
        "peak_rss": [r["peak_rss"] for r in ranks] or [watched_peak[0]],
        "rss_before_model": [r["rss_before_model"] for r in ranks],
        "peak_device": [r["peak_device"] for r in ranks],
    }
    device_limit = parse_bytes(args.device_limit, field="--device-limit") if args.device_limit else None
    if killed:
        res["why"] = f"resident memory reached {killed[0] / 2**30:.2f} GiB > host limit"
    elif len(ranks) < args.ranks or any(r["steps"] < args.steps for r in ranks):
        tail = [ln for ln in log.strip().splitlines() if ln.strip()][-1:] or ["no output"]
        res["why"] = f"failed (exit {code}): {tail[0][:200]}"
    elif max(res["peak_rss"]) > host_limit:
        res["why"] = f"peak resident memory {max(res['peak_rss']) / 2**30:.2f} GiB > host limit"
    elif args.accelerator == "cuda" and device_limit and max(res["peak_device"]) > device_limit:
        res["why"] = f"peak device memory {max(res['peak_device']) / 2**30:.2f} GiB > device limit"
    res["fits"] = "why" not in res
    print(
        f"  {name:<14} depth {depth:>4}: "
        + ("fits" if res["fits"] else res["why"])
        + f" ({res['seconds']:.0f} s, peak RSS {max(res['peak_rss']) / 2**30:.2f} GiB)",
        flush=True,
    )
    return res


def largest(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    """Double the depth until an attempt fails, then bisect between the last fit and the first failure."""
    tried: dict[int, dict] = {}
    good, bad, depth = 0, None, 1
    while bad is None and depth <= args.max_depth:
        tried[depth] = attempt(name, depth, args, scratch)
        if tried[depth]["fits"]:
            good, depth = depth, depth * 2
        else:
            bad = depth
    if bad is None and good < args.max_depth:  # doubling overshot --max-depth: try it exactly
        tried[args.max_depth] = attempt(name, args.max_depth, args, scratch)
        good, bad = (args.max_depth, None) if tried[args.max_depth]["fits"] else (good, args.max_depth)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        tried[mid] = attempt(name, mid, args, scratch)
        good, bad = (mid, bad) if tried[mid]["fits"] else (good, mid)
    best = tried.get(good)
    row = {
        "contender": name,
        "depth": good,
        "params": best["params"] if best else 0,
        "bytes_per_param": (
            max(p - b for p, b in zip(best["peak_rss"], best["rss_before_model"], strict=True)) / best["params"]
            if best and best.get("rss_before_model")
            else None
        ),
        "peak_rss": best["peak_rss"] if best else [],
        "peak_device": best["peak_device"] if best else [],
        "first_failure": {"depth": bad, "why": tried[bad]["why"]} if bad is not None else None,
        "capped_by_max_depth": bad is None,
        "attempts": len(tried),
    }
    row["fraction_of_host_limit"] = (
        row["params"] * BYTES_PER_PARAM / (parse_bytes(args.host_limit, field="--host-limit") * args.ranks)
    )
    return row


def measure(args: argparse.Namespace) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="scale_"))  # per-attempt reports, not results
    rows = []
    names = [n for n in contenders(args.ranks) if not args.only or n in args.only.split(",")]
    for name in names:
        print(f"{name}:", flush=True)
        rows.append(largest(name, args, scratch))
    base = rows[0]["params"]
    for r in rows:
        r["vs_first"] = r["params"] / base if base else None
    return {
        "width": args.width,
        "context": args.context,
        "batch": args.batch,
        "steps": args.steps,
        "ranks": args.ranks,
        "accelerator": args.accelerator,
        "glibc_tunables": args.glibc_tunables,
        "host_limit": parse_bytes(args.host_limit, field="--host-limit"),
        "device_limit": parse_bytes(args.device_limit, field="--device-limit") if args.device_limit else None,
        "rows": rows,
    }


def render(res: dict) -> str:
    gib = 2**30
    dl = f", device limit {res['device_limit'] / gib:.1f} GiB" if res["device_limit"] else ""
    tun = f", GLIBC_TUNABLES={res['glibc_tunables']}" if res.get("glibc_tunables") else ""
    lines = [
        f"GPT width {res['width']}, context {res['context']}, batch {res['batch']} a rank, {res['steps']} steps, "
        f"{res['ranks']} rank(s) on {res['accelerator']}, host limit {res['host_limit'] / gib:.2f} GiB a rank{dl}{tun}",
        f"{'contender':<14} {'depth':>6} {'parameters':>14} {'x first':>8} {'of host limit':>14} "
        f"{'peak RSS GiB':>14} {'B/param':>8}  first failure",
    ]
    for r in res["rows"]:
        fail = r["first_failure"]
        why = f"depth {fail['depth']}: {fail['why']}" if fail else "none up to --max-depth"
        rss = ", ".join(f"{b / gib:.2f}" for b in r["peak_rss"])
        ratio = f"{r['vs_first']:.2f}" if r["vs_first"] is not None else "-"
        bpp = f"{r['bytes_per_param']:.1f}" if r.get("bytes_per_param") else "-"
        lines.append(
            f"{r['contender']:<14} {r['depth']:>6} {r['params']:>14,} {ratio:>8} "
            f"{100 * r['fraction_of_host_limit']:>13.1f}% {rss:>14} {bpp:>8}  {why}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ranks", type=int, choices=(1, 2), default=2)
    p.add_argument("--accelerator", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--host-limit", default="3GiB", help="resident memory a rank may use")
    p.add_argument("--device-limit", default=None, help="device memory a rank may use (chunk_offload's limit)")
    p.add_argument("--max-depth", type=int, default=256)
    p.add_argument("--only", default=None, help="comma-separated contenders to run (default: all)")
    p.add_argument(
        "--glibc-tunables",
        default=None,
        help="GLIBC_TUNABLES for every contender's processes, e.g. glibc.malloc.mmap_threshold=4194304 "
        "(blocks of 4 MiB or more mapped on their own: freed memory leaves the resident set at once)",
    )
    p.add_argument("--out", default="benchmarks/results/scale.json")
    p.add_argument("--depth", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--child", help=argparse.SUPPRESS)
    return run_or_child(p.parse_args(argv), {"*": child}, measure, render)


if __name__ == "__main__":
    main()
