"""A GPT trained with chunk_offload, driven by LightningCLI. One file, top to bottom.

    python examples/gpt/main.py fit --config examples/gpt/configs/cpu_tiny.yaml

- ``GPT``: a causal transformer with tied input/output embeddings, configurable depth, width,
  heads and context, and optional activation checkpointing (recompute each block in backward).
  ``--model.deferred_init=true`` builds it in ``configure_model``: under ``chunk_offload`` on the
  meta device, initialised chunk by chunk, so no rank ever holds the whole model.
- ``ByteCorpus``: byte-level language modelling over text. The default corpus needs no download:
  the source files of the Python standard library of the interpreter running this script, split
  into train and validation by file (every 10th file is validation). ``--data.corpus PATH`` takes
  any text file or folder of text files instead.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.cli import LightningCLI
from torch.utils.checkpoint import checkpoint

import lightning_chunk  # noqa: F401  (registers the chunk_offload strategy names)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corpus import WindowsData  # noqa: E402  (examples/corpus.py: the text, no download)

# ----------------------------------------------------------------------------- config
# Everything is set from the YAML configs in examples/gpt/configs/ (or --model.*, --data.* flags).


# ----------------------------------------------------------------------------- model
class Linear(nn.Linear):
    """GPT-2's init: small weights (the first loss is about ln(256), not in the hundreds), zero bias. Each layer
    initialises its own tensors in ``reset_parameters()``, so the model can also be built on the meta device and
    initialised chunk by chunk (``deferred_init``)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = Linear(width, 3 * width), Linear(width, width)
        self.fc, self.out = Linear(width, 4 * width), Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(L.LightningModule):
    """``deferred_init=True`` builds the layers in ``configure_model``: under ``chunk_offload`` on the meta device,
    initialised chunk by chunk at setup (no rank ever holds the whole model); under other strategies as usual."""

    def __init__(
        self,
        width: int = 256,
        depth: int = 4,
        heads: int = 4,
        context: int = 64,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        activation_checkpointing: bool = False,
        deferred_init: bool = False,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"model.width={width} must be a multiple of model.heads={heads}.")
        self.save_hyperparameters()
        self.blocks: nn.ModuleList | None = None
        if not deferred_init:
            self.configure_model()

    def configure_model(self) -> None:
        if self.blocks is not None:  # built already (in __init__, or by an earlier fit)
            return
        width, context = self.hparams.width, self.hparams.context
        self.tok = Embedding(256, width)
        self.pos = Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, self.hparams.heads) for _ in range(self.hparams.depth))
        self.ln = nn.LayerNorm(width)
        self.head = Linear(width, 256, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            if self.hparams.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)  # keep only block inputs; recompute in backward
            else:
                x = blk(x)
        return self.head(self.ln(x))

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        other = [p for p in self.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": other, "weight_decay": 0.0}],
            lr=self.hparams.lr,
            betas=(0.9, 0.95),
        )
        total, warmup = max(self.trainer.max_steps, 1), max(self.hparams.warmup_steps, 1)

        def schedule(step: int) -> float:  # linear warm-up, then cosine decay to zero
            return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


# ------------------------------------------------------------------------------ data
class ByteCorpus(WindowsData):
    def __init__(
        self,
        corpus: str | None = None,
        context: int = 64,
        batch_size: int = 4,
        max_bytes: int = 4_000_000,
        train_windows: int = 20_000,
        val_windows: int = 256,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def tokens(self, text: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(text), dtype=torch.uint8)  # a token a byte


def main(args: list[str] | None = None) -> LightningCLI:
    torch.set_float32_matmul_precision("high")
    return LightningCLI(GPT, ByteCorpus, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    try:
        main()
    except (ValueError, lightning_chunk.engine.ChunkError) as e:  # a configuration mistake: its message, not a wall
        sys.exit(f"error: {e}")
