"""Models a user writes with torch layers that keep their own hold on their parameters, or that call the model more
than once a step: recurrent layers (a list of their weights made at construction, read by one fused kernel),
parametrizations (``weight`` computed from ``original0``/``original1`` in the forward), two forwards whose outputs
meet in one loss (R-Drop), a teacher pass of the same model under ``no_grad`` in eval mode; and modules that read a
child's weight, or the root's forward an embedding's, without calling the module that owns it."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations

from tests.models import SEQ, VOCAB, ParityNet, ReorderedNet


class RecurrentNet(ParityNet):
    """A two-layer bidirectional recurrent encoder over token embeddings. ``variant``: ``"lstm"``, ``"gru"`` or
    ``"lstm_proj"`` (an LSTM with ``proj_size``, whose weights include ``weight_hr``)."""

    def build(self) -> None:
        d = self.shape["dim"]
        kind = self.variant if self.variant != "plain" else "lstm"
        hidden, extra = (24, dict(proj_size=16)) if kind == "lstm_proj" else (d, {})
        layer = nn.GRU if kind == "gru" else nn.LSTM
        self.embed = nn.Embedding(VOCAB, d)
        self.rnn = layer(d, hidden, num_layers=2, batch_first=True, bidirectional=True, **extra)
        self.head = nn.Linear(2 * extra.get("proj_size", hidden), VOCAB)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x, use_branch=True):
        h, _ = self.rnn(self.embed(x))
        return self.head(h)


class ParametrizedNet(ParityNet):
    """Weight norm on a linear layer and a convolution, spectral norm (its power-iteration buffers updated in every
    training forward) and an orthogonal map: each layer's ``weight`` is computed from its parametrization's
    parameters when read."""

    def build(self) -> None:
        d = self.shape["dim"]
        self.embed = nn.Embedding(VOCAB, d)
        self.conv = parametrizations.weight_norm(nn.Conv1d(d, d, 3, padding=1))
        self.up = parametrizations.weight_norm(nn.Linear(d, self.shape["hidden"]))
        self.down = parametrizations.spectral_norm(nn.Linear(self.shape["hidden"], d))
        self.mix = parametrizations.orthogonal(nn.Linear(d, d, bias=False))
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        h = h + self.conv(h.transpose(1, 2)).transpose(1, 2)
        h = h + self.down(F.gelu(self.up(h)))
        return self.head(self.mix(h))


class TwoPassNet(ParityNet):
    """Dropout everywhere and the model called twice a training step. ``"rdrop"``: two forwards with different
    masks, both in the graph, tied by a KL term (R-Drop); ``"teacher"``: the same model in eval mode under
    ``no_grad`` on reversed inputs first, its outputs a target for the training forward (self-distillation)."""

    def build(self) -> None:
        super().build()
        self.drop = nn.Dropout(0.1)

    def forward(self, x, use_branch=True):
        h = self.drop(self.embed(x))
        for blk in self.blocks:
            h = h + self.drop(blk(h))
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch

        def ce(logits: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))

        if self.variant == "teacher":
            self.eval()
            with torch.no_grad():
                target = self(torch.flip(x, [1]))
            self.train()
            out = self(x)
            return ce(out) + F.mse_loss(out.float(), target.float())
        a, b = self(x), self(x)
        kl = F.kl_div(a.float().log_softmax(-1), b.float().log_softmax(-1), log_target=True, reduction="batchmean")
        return ce(a) + ce(b) + kl


class ReorderedTwoPassNet(TwoPassNet, ReorderedNet):
    """TwoPassNet registered in another order than it runs (ReorderedNet's: head, norm, the blocks backwards,
    embed)."""


class Peek(nn.Module):
    """Reads its child's weight in its own forward (``F.linear``) instead of calling the child."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        return F.linear(self.norm(x), self.proj.weight, self.proj.bias)


class PeekNet(ParityNet):
    def build(self) -> None:
        super().build()
        self.blocks = nn.ModuleList(Peek(self.shape["dim"]) for _ in range(self.shape["depth"]))


class RootTiedNet(ParityNet):
    """GPT-2's tied head written in the LightningModule's own ``forward``: ``F.linear(h, self.embed.weight)``
    (variant "matmul": ``h @ self.embed.weight.T``), beside a position table read by index there. Nothing is tied
    by assignment, so only the reads say that the root uses the embedding's weight."""

    def build(self) -> None:
        super().build()
        del self.head
        self.pos = nn.Embedding(SEQ, self.shape["dim"])

    def forward(self, x, use_branch=True):
        h = self.embed(x) + self.pos.weight[: x.shape[1]]
        for blk in self.blocks:
            h = h + blk(h)
        h = self.norm(h)
        return h @ self.embed.weight.T if self.variant == "matmul" else F.linear(h, self.embed.weight)
