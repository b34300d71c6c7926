"""Models with parameters a mixed precision must compute in their own dtype, for the single-process tests and the
two-rank parity cases alike."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models
from tests.models import VOCAB, ParityNet


class Codebook(nn.Module):
    """A soft vector-quantiser look-up whose forward runs with autocast off, as VQ-VAE codebooks' do."""

    def __init__(self, n: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Parameter(torch.randn(n, dim))

    @torch.autocast("cpu", enabled=False)
    def forward(self, h):
        return torch.softmax(-torch.cdist(h.float(), self.embed), -1) @ self.embed


class AutocastOff(ParityNet):
    """Linears under autocast beside a router, a codebook and a temperature computed with autocast off (mixture of
    experts recipes keep their router in fp32 so): every op rounds as under plain Lightning's bf16-mixed.
    ``variant="checkpointed"``: the router and the codebook under activation checkpointing; ``"late"``: the router
    under autocast until step 2 (after the warm-up), without it from there."""

    def build(self) -> None:
        d = self.shape["dim"]
        self.proj, self.head = nn.Linear(VOCAB, d), nn.Linear(d, VOCAB)
        self.router, self.codebook = nn.Linear(d, 4, bias=False), Codebook(8, d)
        self.temperature = nn.Parameter(torch.zeros(()))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x, use_branch=True):
        h = self.proj(F.one_hot(x, VOCAB).float())
        if self.variant == "checkpointed":
            return self.head(torch.utils.checkpoint.checkpoint(self.routed, h, use_reentrant=False))
        return self.head(self.routed(h))

    def routed(self, h):
        with torch.autocast("cpu", enabled=self.variant == "late" and self.trainer.global_step < 2):
            gate = torch.softmax(self.router(h.float()) * self.temperature.exp(), -1)
        return self.codebook(h) * gate[..., :1] + h

    def val_dataloader(self):
        """For a validation sanity check (``num_sanity_val_steps``), which finds what is read with autocast off."""
        return models.token_data(8)


class FourierFeatures(ParityNet):
    """A spectral branch (``torch.fft`` computes in fp32) into a LayerNorm, which CPU autocast does not cast: plain
    Lightning's fp32 weights take the fp32 input, a bf16 payload failed ("mixed dtype (CPU)"). A gain after it
    promotes to fp32 where plain Lightning's fp32 gain computes whole."""

    def build(self) -> None:
        d = self.shape["dim"]
        self.proj, self.norm, self.head = nn.Linear(VOCAB, d), nn.LayerNorm(d), nn.Linear(d, VOCAB)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x, use_branch=True):
        h = self.proj(F.one_hot(x, VOCAB).float())
        spectrum = torch.fft.fft(h.float(), dim=1).abs()
        return self.head(self.norm(spectrum) * self.gain)

    def val_dataloader(self):
        return models.token_data(8)


class ShiftedNorm(nn.LayerNorm):
    """Nemotron's ``LayerNorm1P`` on CPU: the weight shifted by one where autocast is on, then ``layer_norm`` with
    autocast off. Reading the bias with autocast off moved it to fp32, beside the shifted weight left in bf16."""

    def forward(self, x):
        weight = self.weight + 1.0
        with torch.autocast("cpu", enabled=False):
            return F.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)


class MaskedLinear(nn.Linear):
    """A weight pruned by a fixed boolean mask where autocast is on, applied with autocast off."""

    def forward(self, x):
        weight = self.weight * self.mask
        with torch.autocast("cpu", enabled=False):
            return F.linear(x.float(), weight, self.bias)


class DerivedWeights(ParityNet):
    """Weights computed from parameters by ops under autocast (bf16 from bf16 payloads), then read by ops with
    autocast off, which failed ("self and mat2 must have the same dtype")."""

    def build(self) -> None:
        d = self.shape["dim"]
        self.proj, self.norm, self.head = nn.Linear(VOCAB, d), ShiftedNorm(d), nn.Linear(d, VOCAB)
        self.masked = MaskedLinear(d, d)
        self.masked.register_buffer("mask", torch.arange(d * d).reshape(d, d) % 3 != 0)  # bool: keeps the dtype
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x, use_branch=True):
        h = self.proj(F.one_hot(x, VOCAB).float())
        return self.head(self.masked(self.norm(h)) + h)

    def val_dataloader(self):
        return models.token_data(8)


class LinearsOnly(ParityNet):
    """Every weight a ``nn.Linear``'s (one-hot tokens in, no embedding or norm): autocast casts each fp32 weight to
    bf16 for its op, which a bf16 payload computes with as it is. ``variant="twice"``: each block runs twice a step,
    so its weights have two uses whose gradients autograd sums ([Note: a weight used twice under mixed precision])."""

    def build(self) -> None:  # registered head first: used in another order than registered
        self.head = nn.Linear(models.DIM, VOCAB)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(models.DIM, models.HIDDEN), nn.GELU(), nn.Linear(models.HIDDEN, models.DIM))
            for _ in range(2)
        )
        self.inp = nn.Linear(VOCAB, models.DIM)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.built = True

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.inp(F.one_hot(x, VOCAB).float())
        for blk in self.blocks:
            h = h + blk(h)
            if self.variant == "twice":
                h = h + blk(h)
        return self.head(h)


class SigmoidLogits(ParityNet):
    """A learnt temperature and bias read in the root's forward, scaling the logits of a sigmoid loss, as SigLIP's
    ``logit_scale`` and ``logit_bias``: autocast computes them in fp32 (``exp``, an add), and the bias's gradient sums
    every logit's."""

    def build(self) -> None:
        super().build()
        self.logit_scale = nn.Parameter(torch.tensor([0.0]))
        self.logit_bias = nn.Parameter(torch.tensor([0.0]))

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        return super().forward(x, use_branch) * self.logit_scale.exp() + self.logit_bias

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x).float()
        return F.binary_cross_entropy_with_logits(logits, F.one_hot(y, VOCAB).float(), reduction="sum") / y.numel()
