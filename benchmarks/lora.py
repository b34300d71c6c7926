"""Bytes a parameter a rank for a LoRA fine-tune of a Llama-shaped model against a full fine-tune, bf16-mixed.

    python benchmarks/lora.py                                         # 34M Llama, 1 and 2 ranks: ~13 minutes
    python benchmarks/lora.py --hidden 64 --layers 2 --vocab 512 --steps 3 --out /tmp/l.json     # seconds

Rows, each a ``Trainer.fit`` with ``chunk_offload``'s defaults in its own child process (two ranks started at once,
as torchrun starts them), a ``LlamaForCausalLM`` built from a config (nothing is downloaded), AdamW:

- ``full``: every parameter trained;
- ``lora``: ``peft`` adapters (rank 8) on the attention's query and value projections, the base frozen;
- ``lora, frozen in bf16``: the same with ``MemoryOptions(frozen_in_compute_dtype=True)`` ([Note: frozen weights in
  the compute dtype]): the frozen base keeps one bf16 copy instead of an fp32 master beside it.

Bytes a parameter: the chunk bytes rank 0 holds on every tier after the last step (``device_chunk_bytes`` +
``host_chunk_bytes``: payloads, masters, compute copies, gradients, optimizer state), over the model's parameters;
the ratio is to ``full`` on the same number of ranks. Checkpoint bytes a parameter: the sharded checkpoint
``trainer.save_checkpoint`` writes after the last step, all ranks' files. Step time: the median after the first
step, for scale only.
Needs ``transformers`` and ``peft`` (``pip install -e '.[lora]'``); without them the rows say skipped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import clean_env, quiet_trainer, run_or_child, run_ranks, step_timer  # noqa: E402

ROWS = ("full", "lora", "lora, frozen in bf16")


def child(args: argparse.Namespace) -> None:
    """One fit of row ``args.row`` on ``args.child`` ranks; rank 0 writes what it held."""
    import lightning as L
    import peft
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_chunk import ChunkOffloadStrategy, ChunkPrecision, MemoryOptions

    ranks, row = int(args.child), ROWS[args.row]
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=max(args.hidden // 64, 1),
        max_position_embeddings=args.context,
    )

    class Tune(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)
            if row != "full":
                lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
                self.model = peft.get_peft_model(self.model, lora)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)

    L.seed_everything(0, verbose=False)
    model = Tune()
    times: list[float] = []
    strategy = ChunkOffloadStrategy(
        memory=MemoryOptions(frozen_in_compute_dtype=row.endswith("bf16")), checks={"log_memory_stats": False}
    )
    ckpt = Path(args.out).with_suffix(".ckpt")

    class SavesAtTheEnd(L.Callback):  # inside fit: the sharded checkpoint, every rank writing its shards
        def on_train_batch_end(self, trainer: L.Trainer, *a: Any) -> None:
            if trainer.global_step == args.steps:
                trainer.save_checkpoint(ckpt)

    trainer = quiet_trainer(
        ranks,
        strategy,
        args.steps,
        plugins=[ChunkPrecision("bf16-mixed")],
        callbacks=[step_timer(times), SavesAtTheEnd()],
    )
    data = torch.randint(0, args.vocab, (args.steps * args.batch * ranks, args.context))
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=args.batch))
    stats = strategy.memory_stats()
    if trainer.global_rank == 0:
        params = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        held = stats["device_chunk_bytes"] + stats["host_chunk_bytes"]
    if trainer.global_rank == 0:
        saved = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        shutil.rmtree(ckpt)
        out = {"params": params, "trainable": trainable, "held": held, "saved": saved, "times": times}
        Path(args.out).write_text(json.dumps(out))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def measure(args: argparse.Namespace) -> dict:
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return {"rows": [], "skipped": f"{e}: pip install -e '.[lora]'"}
    tmp = Path(tempfile.mkdtemp(prefix="lora_"))  # per-run scratch, not results
    rows = []
    for ranks in args.ranks:
        full = full_saved = None
        for i, name in enumerate(ROWS):
            out = tmp / f"{ranks}-{i}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(ranks), "--row", str(i)]
            for k in ("hidden", "layers", "vocab", "context", "batch", "steps"):
                cmd += [f"--{k}", str(getattr(args, k))]
            _, log = run_ranks([*cmd, "--out", str(out)], ranks, clean_env(), timeout=1800)
            if not out.exists():
                raise RuntimeError(f"{name} on {ranks} ranks failed:\n{log[-3000:]}")
            res = json.loads(out.read_text())
            per_param, saved = res["held"] / res["params"], res["saved"] / res["params"]
            full, full_saved = (per_param, saved) if name == "full" else (full, full_saved)
            rows.append(
                {
                    "row": name,
                    "ranks": ranks,
                    "params": res["params"],
                    "trainable": res["trainable"],
                    "bytes_a_param": per_param,
                    "vs_full": per_param / full if full else None,
                    "checkpoint_bytes_a_param": saved,
                    "checkpoint_vs_full": saved / full_saved if full_saved else None,
                    "step_s": statistics.median(res["times"][1:] or res["times"]),
                }
            )
    return {**{k: getattr(args, k) for k in ("hidden", "layers", "vocab", "context", "batch", "steps")}, "rows": rows}


def render(res: dict) -> str:
    if not res["rows"]:
        return f"skipped: {res['skipped']}"
    lines = [
        f"LoRA against a full fine-tune, Llama of {res['rows'][0]['params'] / 1e6:.1f}M parameters, bf16-mixed, AdamW",
        "| row | ranks | trained | chunk bytes a parameter, rank 0 | × full | checkpoint bytes a parameter | × full "
        "| s a step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['row']} | {r['ranks']} | {r['trainable'] / r['params']:.2%} | {r['bytes_a_param']:.2f} | "
            f"{r['vs_full']:.2f} | {r['checkpoint_bytes_a_param']:.2f} | {r['checkpoint_vs_full']:.2f} | "
            f"{r['step_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 512), ("layers", 8), ("vocab", 8192), ("context", 128), ("batch", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--row", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default="benchmarks/results/lora.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return run_or_child(p.parse_args(argv), {"*": child}, measure, render)


if __name__ == "__main__":
    main()
