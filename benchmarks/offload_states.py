"""An offload/reload round trip of the training state between steps, against copying the same bytes there and back.

    python benchmarks/offload_states.py                               # the 99.5M GPT, 1 and 2 ranks, 3 round trips
    python benchmarks/offload_states.py --width 64 --depth 2 --steps 3 --trips 1 --out /tmp/o.json   # seconds

Each row is one ``Trainer.fit`` of the example GPT with ``placement="device"`` (every shard on the device tier) in its
own child process (two ranks started at once, as torchrun starts them). After the warm-up's step a callback runs
``--trips`` round trips: ``strategy.offload_states()``, then ``reload_states()``, each timed, with the device chunk
bytes before, while offloaded and after. The floor is what the bytes moved cost at least: this rank's device-tier
bytes copied into a fresh host buffer and back (``torch.empty`` + ``copy_``, twice). The ratio is the round trip over
that floor, the median over trips; on two ranks a round trip also all-gathers the shards each way ([Note:
offloading states between phases]). The training steps before and after are not timed here: that a reload trains
bit for bit as before is the tests' part (tests/integration/test_offload_states.py).
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
from _common import clean_env, gpt_parser, make_gpt, quiet_trainer, run_or_child, run_ranks  # noqa: E402


def child(args: argparse.Namespace) -> None:
    """One fit with ``args.ranks`` ranks; rank 0 writes the trips it timed."""
    import lightning as L
    import torch

    from lightning_chunk import ChunkOffloadStrategy

    ranks = int(args.child)
    trips: list[dict[str, float]] = []

    class RoundTrips(L.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            if trainer.global_step != 1:  # after the warm-up's step: the layout is the one training keeps
                return
            s = trainer.strategy
            for _ in range(args.trips):
                before = s.memory_stats()["device_chunk_bytes"]
                t0 = time.perf_counter()
                s.offload_states()
                t1 = time.perf_counter()
                parked = s.memory_stats()["device_chunk_bytes"]
                s.reload_states()
                t2 = time.perf_counter()
                after = s.memory_stats()["device_chunk_bytes"]
                trips.append(
                    {"before": before, "offloaded": parked, "after": after, "offload_s": t1 - t0, "reload_s": t2 - t1}
                )
                trips[-1]["floor_s"] = copy_floor(int(before))

    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    data = torch.randint(0, 256, (args.steps * args.batch * ranks, args.context + 1))
    strategy = ChunkOffloadStrategy(placement="device", checks={"log_memory_stats": False})
    trainer = quiet_trainer(ranks, strategy, args.steps, callbacks=[RoundTrips()])
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    if trainer.global_rank == 0:
        params = sum(p.numel() for p in model.parameters())
        Path(args.out).write_text(json.dumps({"trips": trips, "params": params}))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def copy_floor(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` into a fresh host buffer and back: what moving the bytes costs at least."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    away = torch.empty_like(src).copy_(src)
    torch.empty_like(away).copy_(away)
    return time.perf_counter() - t0


def measure(args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="offload_states_"))  # per-run scratch, not results
    rows = []
    params = 0
    for ranks in args.ranks:
        out = tmp / f"{ranks}.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(ranks), "--out", str(out)]
        for k in ("width", "depth", "context", "batch", "steps", "trips"):
            cmd += [f"--{k}", str(getattr(args, k))]
        _, log = run_ranks(cmd, ranks, clean_env(), timeout=1800)
        if not out.exists():
            raise RuntimeError(f"{ranks} ranks failed:\n{log[-3000:]}")
        res = json.loads(out.read_text())
        params, trips = res["params"], res["trips"]
        trip_s = [t["offload_s"] + t["reload_s"] for t in trips]
        rows.append(
            {
                "ranks": ranks,
                "device_bytes": trips[0]["before"],
                "offloaded_bytes": max(t["offloaded"] for t in trips),
                "reloaded_bytes": trips[-1]["after"],
                "offload_s": statistics.median(t["offload_s"] for t in trips),
                "reload_s": statistics.median(t["reload_s"] for t in trips),
                "floor_s": statistics.median(t["floor_s"] for t in trips),
                "vs_floor": statistics.median(s / t["floor_s"] for s, t in zip(trip_s, trips, strict=True)),
                "trips": trips,
            }
        )
    return {"params": params, **{k: getattr(args, k) for k in ("width", "depth", "context", "batch")}, "rows": rows}


def render(res: dict) -> str:
    lines = [
        f"offload/reload round trip, GPT of {res['params'] / 1e6:.1f}M parameters, placement='device'",
        "| ranks | device MiB a rank | offloaded | offload s | reload s | copy floor s | round trip / floor |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['ranks']} | {r['device_bytes'] / 2**20:.1f} | {r['offloaded_bytes'] / 2**20:.1f} | "
            f"{r['offload_s']:.3f} | {r['reload_s']:.3f} | {r['floor_s']:.3f} | {r['vs_floor']:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/offload_states.json", width=768, depth=14, context=64, batch=2, steps=3)
    p.add_argument("--trips", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = p.parse_args(argv)
    return run_or_child(args, {"*": child}, measure, render)


if __name__ == "__main__":
    main()
