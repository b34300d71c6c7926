"""Host chunks stepped in backward from their bf16 gradients, against widening them into the fp32 shard first.

    python benchmarks/bf16_grads.py                                   # a 57.7M GPT, 8 rounds
    python benchmarks/bf16_grads.py --width 64 --depth 2 --context 16 --batch 2 --steps 4 --rounds 1   # seconds

One rank, bf16-mixed, ``placement="host"`` (every shard and its Adam step on the host), ``step_in_backward=True``,
the one-pass kernel, the example GPT's AdamW, chunks of ``--chunk-numel`` elements: 16M by default, whose fp32
gradients (64 MB) do not fit the 32 MB of the CI machine's last cache level, as a 7B Llama's block of 202M does not
fit a GPU host's (with 4M, 14 chunks of the 57.0M GPT, a chunk's gradients stayed in the cache from their widening
to the step, and the two rows were 0.94x apart in host time). Two contenders, fitted one after the other in this
process, ``--rounds`` times in an order shuffled each round:

- ``bf16 gradients``: each chunk's gradients go into a bf16 buffer and the native loop widens them as it loads them
  ([Note: gradients in bf16 until the step] in ``engine/memory/low_grads.py``);
- ``widened first``: ``LOW_GRADS = False``, as before: each gradient is widened into the fp32 shard as it arrives,
  and the loop reads the shard.

The host work those change is the gradients' copy into their chunk (``time_grad_copy_s``) and the step
(``time_optimizer_s``): their sum a step is the column the ratio is taken of, with the whole step's beside it (on a
CPU the model's compute shares the cores; on a GPU the host work runs beside it). Ratios: medians of the per-round
ratios, with a distribution-free 95% interval. The parameters after the last step are compared: the same bits.
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

CONTENDERS = {"bf16 gradients": True, "widened first": False}
HOST = ("time_grad_copy_s", "time_optimizer_s")


def fit(args: argparse.Namespace, low: bool) -> dict[str, Any]:
    import lightning as L
    import torch

    from lightning_chunk import CheckOptions, ChunkOffloadStrategy, MemoryOptions, OffloadOptions
    from lightning_chunk.engine.memory import low_grads

    low_grads.LOW_GRADS = low
    L.seed_everything(0, verbose=False)
    model = make_gpt(args)
    data = torch.randint(0, 256, (args.steps * args.batch, args.context + 1))
    strategy = ChunkOffloadStrategy(
        placement="host",
        step_in_backward=True,
        memory=MemoryOptions(chunk_numel=args.chunk_numel),
        offload=OffloadOptions(optimizer_kernel="one_pass"),
        checks=CheckOptions(log_memory_stats=False),
    )
    times: list[float] = []
    seen: list[dict[str, float]] = []

    class HostSeconds(L.Callback):  # the engine's clock after each step: the host work of the steps timed
        def on_train_batch_end(self, *_: Any) -> None:
            seen.append({k: strategy.memory_stats()[k] for k in HOST})

    trainer = quiet_trainer(
        1, strategy, args.steps, precision="bf16-mixed", callbacks=[step_timer(times), HostSeconds()]
    )
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    stats = strategy.memory_stats()
    low_grads.LOW_GRADS = True
    skip = min(args.skip, len(times) - 1)
    host = sum(seen[-1][k] - seen[skip - 1][k] for k in HOST) / (len(times) - skip) if skip else 0.0
    return {
        "ms": 1000 * statistics.median(times[skip:]),
        "host_ms": 1000 * host,
        "params": sum(p.numel() for p in model.parameters()),
        "from_bf16": stats.get("chunks_stepped_from_bf16_grads", 0),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def measure(args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    rounds: list[dict[str, dict[str, Any]]] = []
    for _ in range(args.rounds):
        order = list(CONTENDERS)
        rng.shuffle(order)
        rounds.append({n: fit(args, CONTENDERS[n]) for n in order})
    import torch

    last = rounds[-1]
    same = all(torch.equal(v, last["widened first"]["state"][k]) for k, v in last["bf16 gradients"]["state"].items())
    rows = []
    for n in CONTENDERS:
        step, steps = round_ratios([r[n]["ms"] for r in rounds], [r["widened first"]["ms"] for r in rounds])
        host, hosts = round_ratios([r[n]["host_ms"] for r in rounds], [r["widened first"]["host_ms"] for r in rounds])
        rows.append(
            {
                "contender": n,
                "ms": statistics.median(r[n]["ms"] for r in rounds),
                "host_ms": statistics.median(r[n]["host_ms"] for r in rounds),
                "host_ratio": host,
                "host_interval": list(median_interval(hosts)),
                "step_ratio": step,
                "step_interval": list(median_interval(steps)),
                "chunks_from_bf16": last[n]["from_bf16"],
            }
        )
    for r in rounds:
        for res in r.values():
            del res["state"]
    return {"params": rounds[0]["widened first"]["params"], "same_bits": same, "rounds": rounds, "rows": rows}


def render(res: dict) -> str:
    title = (
        f"GPT of {res['params'] / 1e6:.1f}M parameters, one rank, placement='host', bf16-mixed, stepped in backward, "
        f"{len(res['rounds'])} rounds; the same bits: {res['same_bits']}"
    )
    columns = ["contender", "host ms a step (copy + step)", "x widened first", "95% interval", "ms a step"]
    rows = [
        [r["contender"], f"{r['host_ms']:.1f}", f"{r['host_ratio']:.3f}", "{:.3f}..{:.3f}".format(*r["host_interval"])]
        + [f"{r['ms']:.1f} ({r['step_ratio']:.3f}x)"]
        for r in res["rows"]
    ]
    return markdown_table(title, columns, rows)


def main(argv: list[str] | None = None) -> dict:
    p = gpt_parser(__doc__, "benchmarks/results/bf16_grads.json", width=768, depth=8, context=64, batch=1, steps=8)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--chunk-numel", type=int, default=1 << 24, help="elements a chunk (default: 64 MB of fp32)")
    args = p.parse_args(argv)
    return run_or_child(args, {}, measure, render)


if __name__ == "__main__":
    main()
