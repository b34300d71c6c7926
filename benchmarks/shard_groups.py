"""What crosses nodes: chunks sharded over every rank against shard groups of a node's ranks (``shard_size``).

    python benchmarks/shard_groups.py                                          # the example GPT (10.8M), 4 ranks
    python benchmarks/shard_groups.py --width 64 --depth 2 --context 16 --batch 2 --steps 3   # seconds

Four gloo ranks stand for two nodes of two. Sharded over every rank, each chunk's all-gathers and reduce-scatters
span both nodes. With ``shard_size=2`` they stay within a node, and one all-reduce of each gradient shard over its
replica crosses, once a step however many micro-batches it accumulates ([Note: replicas summed once a step]).
Contenders: both layouts, with one and with ``--accumulate`` micro-batches a step.

Counted per rank and optimizer step after the warm-up step, from ``memory_stats()``: the bytes each kind of chunk
collective was handed (``all_gather_bytes``, ``reduce_scatter_bytes``, ``replica_all_reduce_bytes``), and of those
the bytes handed to collectives whose ranks span both nodes (every one, sharded over every rank; the replica
all-reduces, in groups). Bytes handed, not bytes on the wire: a ring sends about twice an all-reduce's and once an
all-gather's. Also each rank's chunk bytes (``shard_bytes``), the price of replicating. Counts, not times: four
ranks on a small CPU say nothing of a network's speed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, clean_env, gpt_parser, make_gpt, quiet_trainer, run_or_child, run_ranks  # noqa: E402

RANKS = 4
KINDS = ("all_gather_bytes", "reduce_scatter_bytes", "replica_all_reduce_bytes")
CONTENDERS = [(shard, k) for k in (1, None) for shard in (None, 2)]  # None: --accumulate


def name(shard: int | None, k: int) -> str:
    return f"{'every rank' if shard is None else f'groups of {shard}'}, {k} micro-batch{'es' if k > 1 else ''} a step"


def child(args: argparse.Namespace) -> None:
    import lightning as L
    import torch

    from lightning_chunk import CheckOptions, ChunkOffloadStrategy, MemoryOptions

    shard, k = json.loads(args.child)
    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(shard_size=shard), checks=CheckOptions(log_memory_stats=False)
    )
    seen: list[dict] = []

    class AfterWarmUp(L.Callback):
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == 1 and not seen:  # the warm-up step's counts are left out
                seen.append(trainer.strategy.memory_stats())

    trainer = quiet_trainer(RANKS, strategy, args.steps, accumulate_grad_batches=k, callbacks=[AfterWarmUp()])
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.steps * k * args.batch * RANKS, args.context + 1), generator=g)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    end = trainer.strategy.memory_stats()
    steps = args.steps - 1
    row = {kind: (end[kind] - seen[0][kind]) / steps for kind in KINDS}
    row["shard_bytes"] = end["shard_bytes"]
    row["params"] = sum(p.numel() for p in model.parameters())
    Path(f"{args.out}.rank{trainer.global_rank}").write_text(json.dumps(row))
    torch.distributed.destroy_process_group()


def measure(args: argparse.Namespace) -> dict:
    rows = []
    for shard, k in CONTENDERS:
        k = k or args.accumulate
        given = ["--child", json.dumps([shard, k])]
        cmd = [sys.executable, __file__, *given, *_sizes(args), "--out", args.out]
        code, log = run_ranks(cmd, RANKS, {**clean_env(), "PYTHONPATH": str(ROOT)}, timeout=1800)
        if code:
            raise RuntimeError(f"{name(shard, k)} failed:\n{log[-3000:]}")
        ranks = [json.loads(Path(f"{args.out}.rank{r}").read_text()) for r in range(RANKS)]
        for r in range(RANKS):
            Path(f"{args.out}.rank{r}").unlink()
        row = {kind: max(x[kind] for x in ranks) for kind in (*KINDS, "shard_bytes")}
        row["across_nodes_bytes"] = (
            row["replica_all_reduce_bytes"] if shard else row["all_gather_bytes"] + row["reduce_scatter_bytes"]
        )
        rows.append(
            {"contender": name(shard, k), "shard_size": shard, "accumulate": k, "params": ranks[0]["params"], **row}
        )
    full = {r["accumulate"]: r["across_nodes_bytes"] for r in rows if r["shard_size"] is None}
    for r in rows:
        r["across_vs_every_rank"] = r["across_nodes_bytes"] / full[r["accumulate"]]
    return {"results": [{"ranks": RANKS, "rows": rows}], "steps": args.steps}


def _sizes(args: argparse.Namespace) -> list[str]:
    return [f"--{n}={getattr(args, n)}" for n in ("width", "depth", "context", "batch", "steps")]


def render(res: dict) -> str:
    mb = 1e6
    lines = [
        "| contender | all-gather MB | reduce-scatter MB | replica all-reduce MB | across nodes MB | x every rank | "
        "chunk MB a rank |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["results"][0]["rows"]:
        lines.append(
            f"| {r['contender']} | {r['all_gather_bytes'] / mb:.1f} | {r['reduce_scatter_bytes'] / mb:.1f} | "
            f"{r['replica_all_reduce_bytes'] / mb:.1f} | {r['across_nodes_bytes'] / mb:.1f} | "
            f"{r['across_vs_every_rank']:.3f} | {r['shard_bytes'] / mb:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/shard_groups.json", width=384, depth=6, context=128, batch=4, steps=5)
    p.add_argument("--accumulate", type=int, default=4)
    args = p.parse_args(argv)
    return run_or_child(args, {"*": child}, measure, render)


if __name__ == "__main__":
    main()
