"""Two-rank cases whose ranks part, which must fail with a clear error or vote: a module one rank skips, blocks one
rank swaps, an fp16 overflow on one rank, a model built differently on each rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import torch

from lightning_chunk import CheckOptions, ChunkOffloadStrategy, ChunkPrecision, MemoryOptions
from tests.distributed.harness import chunk_strategy, trainer
from tests.models import ParityNet, token_data


class SkipOnRankOne(ParityNet):
    """From step 3 on, rank 1 skips the branch that rank 0 runs."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        use = not (self.global_step >= 3 and self.global_rank == 1)
        logits = self(x, use_branch=use)
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def run_skip(out: Path) -> None:
    L.seed_everything(7, verbose=False)
    model = SkipOnRankOne(variant="unused")
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(collective_timeout_s=10)
    )
    trainer(strategy).fit(model, token_data())
    print("UNEXPECTED-SUCCESS", flush=True)


class SwapOnRankOne(ParityNet):
    """From step 3 on, rank 1 runs the two blocks (chunks of one size) in the other order."""

    def forward(self, x: torch.Tensor, use_branch: bool = True) -> torch.Tensor:
        h = self.embed(x)
        swapped = self.global_step >= 3 and self.global_rank == 1
        for blk in reversed(self.blocks) if swapped else self.blocks:
            h = h + blk(h)
        return self.head(self.norm(h))


def run_swap(out: Path) -> None:
    """[Note: checking once a micro-batch]: the defaults name the disagreement before step 3 is taken."""
    from lightning_chunk.engine.comm.collectives import CollectiveMismatchError, CollectiveTimeoutError

    L.seed_everything(7, verbose=False)
    model = SwapOnRankOne()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    strategy = ChunkOffloadStrategy(
        placement="host", memory=MemoryOptions(chunk_numel=block), checks=CheckOptions(collective_timeout_s=10)
    )
    t = trainer(strategy)
    try:
        t.fit(model, token_data())
    except (CollectiveMismatchError, CollectiveTimeoutError) as e:
        print(f"SWAP-CAUGHT rank={t.global_rank} global_step={t.global_step}: {e}", flush=True)
        raise
    print("UNEXPECTED-SUCCESS", flush=True)


class OverflowOnRankOne(ParityNet):
    """At step 3, rank 1's loss overflows fp16; rank 0's does not."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == 3 and self.global_rank == 1:
            loss = loss * torch.tensor(float("inf"))
        if self.global_step in (3, 4):
            self.seen.append([p.detach().float().clone() for p in self.parameters()])
        return loss


def run_overflow(out: Path) -> None:
    L.seed_everything(7, verbose=False)
    model = OverflowOnRankOne()
    model.seen = []
    strategy = ChunkOffloadStrategy(
        memory=MemoryOptions(chunk_numel=4096), checks=CheckOptions(collective_timeout_s=60)
    )
    t = trainer(strategy, steps=6, plugins=[ChunkPrecision("16-mixed")])
    t.fit(model, token_data())
    before, after = model.seen
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    (out / f"overflow.rank{t.global_rank}.json").write_text(
        json.dumps({"unchanged": unchanged, "loss_scale": strategy.memory_stats()["loss_scale"]})
    )
    print(f"CASE-DONE fp16_overflow_one_rank rank={t.global_rank}", flush=True)


def run_models_differ(out: Path) -> None:
    """[Note: the same model on every rank]: rank 1 builds a wider block, then a block more. Before, the first
    broadcast of unequal size aborted rank 0 (gloo's ``EnforceNotMet``), or rank 1 waited for a broadcast nobody sent.
    Each rank saves the error each fit raised."""
    from lightning_chunk.engine.runtime.same_model import ModelsDifferError

    rank = int(os.environ.get("RANK", 0))
    done = {}
    for name, shape in (("wider", dict(hidden=64 + 8 * rank)), ("deeper", dict(depth=2 + rank))):
        L.seed_everything(7, verbose=False)
        try:
            trainer(chunk_strategy(), steps=2).fit(ParityNet(**shape), token_data())
            done[name] = "ran"
        except ModelsDifferError as e:
            done[name] = str(e)
    (out / f"models_differ.rank{rank}.json").write_text(json.dumps(done))
    print(f"CASE-DONE models_differ rank={rank}", flush=True)
