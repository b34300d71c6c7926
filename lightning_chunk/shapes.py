"""Llama-shaped LightningModules for planning: ``lightning-chunk plan lightning_chunk.shapes:Llama --shapes-only``.

The shapes of Llama 2 (7B, 13B, 70B) and Llama 3 (8B, 70B): embedding, per layer the attention's four projections
(grouped key/value heads where the model has them), the SwiGLU MLP's three and two RMSNorm weights, the final norm
and an untied head; bf16-mixed keeps the norms in fp32 like every other parameter. It trains too (a plain causal
LM without rotary embeddings), which is what the tests use at a tiny ``size``: ``{"hidden": 64, "layers": 2, ...}``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

SIZES: dict[str, dict[str, int]] = {
    "7b": dict(hidden=4096, layers=32, intermediate=11008, heads=32, kv_heads=32, vocab=32000),
    "13b": dict(hidden=5120, layers=40, intermediate=13824, heads=40, kv_heads=40, vocab=32000),
    "70b": dict(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, vocab=32000),
    "llama3-8b": dict(hidden=4096, layers=32, intermediate=14336, heads=32, kv_heads=8, vocab=128256),
    "llama3-70b": dict(hidden=8192, layers=80, intermediate=28672, heads=64, kv_heads=8, vocab=128256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:  # what deferred init calls for a module built on the meta device
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * self.weight


class Layer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        kv = kv_heads * self.head_dim
        self.input_norm, self.post_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.q, self.k, self.v = (nn.Linear(hidden, n, bias=False) for n in (hidden, kv, kv))
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate, self.up = nn.Linear(hidden, intermediate, bias=False), nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


# AdamW keeps two moments a parameter; Adafactor a row and a column a matrix ([Note: Adafactor over sharded matrices])
OPTIMIZERS: dict[str, Any] = {"adamw": torch.optim.AdamW, "adafactor": torch.optim.Adafactor}


class Llama(L.LightningModule):
    """``size``: a name of ``SIZES`` or the fields themselves; ``optimizer``: a name of ``OPTIMIZERS``. Built in
    ``configure_model`` (on the meta device under chunk_offload: no rank holds the whole model)."""

    def __init__(self, size: str | dict[str, Any] = "7b", lr: float = 3e-4, optimizer: str = "adamw") -> None:
        super().__init__()
        if isinstance(size, str) and size not in SIZES:
            raise ValueError(f"size={size!r} is not one of {sorted(SIZES)}; or give the fields as a dict.")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is not one of {sorted(OPTIMIZERS)}.")
        self.shape = dict(SIZES[size]) if isinstance(size, str) else dict(size)
        self.lr, self.optimizer = lr, optimizer
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        s = self.shape
        self.model = nn.ModuleDict(
            dict(
                embed=nn.Embedding(s["vocab"], s["hidden"]),
                layers=nn.ModuleList(
                    Layer(s["hidden"], s["intermediate"], s["heads"], s["kv_heads"]) for _ in range(s["layers"])
                ),
                norm=RMSNorm(s["hidden"]),
                head=nn.Linear(s["hidden"], s["vocab"], bias=False),
            )
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m["embed"](ids)
        for layer in m["layers"]:
            x = layer(x)
        return m["head"](m["norm"](x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids = batch[0] if isinstance(batch, (list, tuple)) else batch
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZERS[self.optimizer](self.parameters(), lr=self.lr, weight_decay=0.1)
