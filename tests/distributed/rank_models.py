"""Models whose use differs across ranks, for the multi-rank cases (``parity_cases.CASES`` names them as it names
``tests.models``' ones): a buffer each rank starts differently, a parameter some ranks use and others not (DDP's
``find_unused_parameters=True`` case), a layer no rank uses, a mixture of experts."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import VOCAB, ParityNet


class RankBuffer(ParityNet):
    """A buffer initialised differently on each rank and used in forward: ranks must start from rank 0's."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        rank = int(os.environ.get("RANK", "0"))
        self.register_buffer("offset", torch.full((self.embed.embedding_dim,), 0.05 * (rank + 1)))

    def forward(self, x, use_branch=True):
        h = self.embed(x) + self.offset
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


class Gate(nn.Module):
    """A module that owns a parameter directly and uses it only when told: ``image_newline`` in a vision-language
    model, used only when the batch has images."""

    def __init__(self, dim: int, own_chunk: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        # a row (1, dim) decays with the weights, so it is packed beside its module's weight, away from the vector
        # params every rank uses: a chunk whose parameters one rank may all lack gradients for
        self.scale = nn.Parameter(torch.ones(1, dim) if own_chunk else torch.ones(dim))

    def forward(self, h: torch.Tensor, use: bool) -> torch.Tensor:
        h = self.proj(h)
        # a new tensor either way: returning ``h`` itself would put the gate's backward hook on the projection's
        # output, where it runs before or after the projection's by the order they were added, so ranks would run
        # the two backward moments in different orders (which the module check refuses)
        return h * self.scale if use else h * 1.0


class RankGatedNet(ParityNet):
    """Every rank runs the same modules, but a gate's own parameter gets a gradient on some ranks and not others,
    differently at each step (DDP's ``find_unused_parameters=True`` case): rank r uses it when ``r + batch_idx`` is
    even, so in the warm-up too one rank has it and the other not. Variant ``own_chunk``: the gate's parameter is a
    row, packed with the weights; ``pairs``: ranks 2p and 2p + 1 use it when ``p + batch_idx`` is even, so on four
    ranks in shard groups of two one group has it and the other not."""

    def build(self) -> None:
        super().build()
        own = self.variant == "own_chunk"
        self.gates = nn.ModuleList(Gate(self.shape["dim"], own) for _ in range(self.shape["depth"]))

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for blk, gate in zip(self.blocks, self.gates, strict=True):
            h = h + blk(h)
            h = h + gate(h, use_branch)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        who = self.global_rank // 2 if self.variant == "pairs" else self.global_rank
        logits = self(x, use_branch=(who + batch_idx) % 2 == 0)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))


class RootGatedNet(ParityNet):
    """A table the LightningModule owns itself, read in its own ``forward`` on some ranks and not others, differently
    at each step (rank r reads it when ``r + batch_idx`` is even): the root's backward spans the whole backward."""

    def build(self) -> None:
        super().build()
        self.extra = nn.Parameter(torch.randn(8, self.shape["dim"]) * 0.02)

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        if use_branch:
            h = h + self.extra.sum(0)
        for blk in self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))

    training_step = RankGatedNet.training_step


class SpareNet(ParityNet):
    """A layer no step ever uses (a head kept for later): it gets no gradient on any rank, so it never steps."""

    def build(self) -> None:
        super().build()
        self.spare = nn.Linear(self.shape["dim"], self.shape["dim"])


class Experts(nn.Module):
    """A mixture of experts as written by hand: each token goes to its router's top expert, and an expert no token
    chose is not run, so which experts run differs across ranks and steps (DDP's ``find_unused_parameters=True``).
    As a leaf (``leaf_modules=["Experts"]``) it is gathered whole at its forward, whichever experts then run."""

    def __init__(self, dim: int, hidden: int, n: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(n)
        )

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        weights = self.router(flat).softmax(-1)
        top = weights.argmax(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (top == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * weights[rows, e : e + 1])
        return out.reshape(h.shape)


class MixtureNet(ParityNet):
    """ParityNet with a mixture of experts after each block."""

    def build(self) -> None:
        super().build()
        self.mixtures = nn.ModuleList(Experts(self.shape["dim"], self.shape["hidden"]) for _ in self.blocks)

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for blk, mixture in zip(self.blocks, self.mixtures, strict=True):
            h = h + blk(h)
            h = h + mixture(h)
        return self.head(self.norm(h))
