"""Tensors in the containers users hand a step or return from a module, against plain Lightning: a dict, a
``UserDict`` (what a Hugging Face collator's ``BatchEncoding`` is), a dataclass, a named tuple. Before, only the
containers torch's pytree knows were searched (``engine/runtime/batches.py``): a ``UserDict`` or a
dataclass batch read as 0 bytes, so inputs that grew after the warm-up went unseen, and a module that owns parameters
and returned one got no pre-backward hook and failed in backward."""

import dataclasses
from collections import UserDict, namedtuple

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.options import grouped
from tests.models import VOCAB, ParityNet, quiet_trainer, token_data

GROW_AT, STEPS = 4, 8


@dataclasses.dataclass
class TokenBatch:
    input_ids: torch.Tensor
    labels: torch.Tensor


Pair = namedtuple("Pair", "input_ids labels")

KINDS = {
    "dict": lambda x, y: {"input_ids": x, "labels": y},
    "user_dict": lambda x, y: UserDict(input_ids=x, labels=y),  # what BatchEncoding is
    "dataclass": TokenBatch,
    "namedtuple": Pair,
}


class ReadsFields(ParityNet):
    def training_step(self, batch, batch_idx):
        x, y = (batch.input_ids, batch.labels) if hasattr(batch, "input_ids") else (batch["input_ids"], batch["labels"])
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))


def _batches(kind):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(STEPS):
        x = torch.randint(0, VOCAB, (4, 8 if i < GROW_AT else 32), generator=g)
        out.append(KINDS[kind](x, torch.roll(x, -1, dims=1)))
    return DataLoader(out, batch_size=None, collate_fn=lambda b: b)


def _fit(strategy, kind):
    L.seed_everything(3, verbose=False)
    model = ReadsFields(dim=64, hidden=256, depth=4)
    t = quiet_trainer(strategy=strategy, max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0)
    t.fit(model, _batches(kind))
    return model


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_batch_of_any_kind_that_grows_is_traced_again_and_trains_like_plain_lightning(kind):
    strategy = ChunkOffloadStrategy(**grouped({"device_memory_limit": 1_800_000, "optimizer_kernel": "loop"}))
    got = _fit(strategy, kind)
    assert strategy.memory_stats()["replans"] == 1
    for a, b in zip(_fit("auto", kind).parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


class Block(torch.nn.Module):
    """Owns its weights and returns its output in the container ``kind`` makes."""

    def __init__(self, kind: str, dim: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.kind = kind
        self.w1 = torch.nn.Parameter(torch.randn(dim, hidden) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(hidden, dim) * 0.1)

    def forward(self, h):
        y = h + F.gelu(h @ self.w1) @ self.w2
        return KINDS[self.kind](y, y.detach())


class ReturnsContainers(ParityNet):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        super().__init__()

    def build(self) -> None:
        super().build()
        self.blocks = torch.nn.ModuleList(Block(self.kind) for _ in range(2))

    def forward(self, x, use_branch=True):
        h = self.embed(x)
        for blk in self.blocks:
            out = blk(h)
            h = out.input_ids if hasattr(out, "input_ids") else out["input_ids"]
        return self.head(self.norm(h))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_module_returning_its_output_in_any_container_trains_like_plain_lightning(kind):
    """Host placement: each block's weights are gathered again for its backward by the hook on its output."""

    def fit(strategy):
        L.seed_everything(7, verbose=False)
        model = ReturnsContainers(kind)
        quiet_trainer(strategy=strategy, max_steps=6, limit_val_batches=0, num_sanity_val_steps=0).fit(
            model, token_data()
        )
        return model

    got = fit(ChunkOffloadStrategy(**grouped({"placement": "host", "chunk_numel": 4000, "optimizer_kernel": "loop"})))
    for a, b in zip(fit("auto").parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
