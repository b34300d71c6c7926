"""The same number of batches on every rank.

[Note: the same number of batches on every rank]
Every forward gathers each sharded chunk from every rank, so every rank must run the same number of training,
validation, test and predict batches: as under ZeRO-3 and FSDP, and in training as under DDP (whose evaluation
forward needs no collective). Ranks whose batches differ (``use_distributed_sampler=False`` with a dataset split by
hand, an ``IterableDataset`` whose shards differ in length) paired one rank's extra forward with whatever the others
issued next: a ``CollectiveTimeoutError`` after ``collective_timeout_s`` blaming control flow, at a collective far
from the cause (a buffer broadcast, the teardown's), or a hang or mixed chunks on NCCL; an evaluation batch that found
every chunk gathered ran, leaving that rank's cache ahead of the others'. So at the start of every batch the ranks
exchange whether it is their last of the loop (Lightning's loop knows, having fetched the next batch ahead:
``batch_progress.is_last_batch``): one small all-gather, riding on the agreement check's where that is on. Where they
differ, every rank raises ``CollectiveMismatchError`` at that batch, before any rank runs it, naming each rank's count
where its dataloader has a length. A rank with no batch at all, or that skips the rest of an epoch
(``on_train_batch_start`` returning -1), never starts one: the others time out naming this exchange. A step that
takes ``dataloader_iter`` fetches its own batches; it is not checked.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

from .engine import Collectives
from .engine.comm.agreement import CollectiveMismatchError

_KIND = {
    "training": "training",
    "validating": "validation",
    "sanity_checking": "validation",
    "testing": "test",
    "predicting": "predict",
}
_LIMIT = {
    "training": "limit_train_batches or max_steps",
    "validation": "limit_val_batches",
    "test": "limit_test_batches",
    "predict": "limit_predict_batches",
}


def check_same_batches(trainer: Any, comm: Collectives) -> None:
    """Every rank calls this at the start of each batch ([Note: the same number of batches on every rank])."""
    if comm.world_size == 1 or trainer is None:
        return
    kind = next((k for a, k in _KIND.items() if getattr(trainer, a, False)), None)
    if kind is None:
        return
    loop = trainer.fit_loop.epoch_loop if kind == "training" else trainer._active_loop
    fetcher = (trainer.fit_loop if kind == "training" else loop)._data_fetcher
    if isinstance(fetcher, _DataLoaderIterDataFetcher):
        return
    progress = loop.batch_progress
    index = progress.current.ready - 1  # this batch's position in the loop (ready counts it already)
    skipped = " or that skipped the rest of its epoch (on_train_batch_start returned -1)" if kind == "training" else ""
    last = comm.values_of_ranks(
        int(progress.is_last_batch),
        what=f"the check that every rank runs {kind} batch {index} (not a rank whose batches ended{skipped})",
    )
    if len(set(last)) == 1:
        return
    count = trainer.num_training_batches if kind == "training" else sum(loop.max_batches)
    counts = comm.all_gather_object_on(count, comm.host_group())
    named = (
        ", ".join(f"rank {r}: {f'{c:.0f}' if math.isfinite(c) else 'no length'}" for r, c in enumerate(counts))
        if any(math.isfinite(c) for c in counts)
        else "the dataloaders have no length"
    )
    ends = [str(r) for r, v in enumerate(last) if v]
    who = f"rank {ends[0]}'s dataloader ends" if len(ends) == 1 else f"the dataloaders of ranks {', '.join(ends)} end"
    peers = "DDP, ZeRO-3 or FSDP" if kind == "training" else "ZeRO-3 or FSDP"
    raise CollectiveMismatchError(
        f"[rank {comm.rank}] the ranks run different numbers of {kind} batches ({named}): at the loop's batch "
        f"{index} (from 0): {who} and the others' go on. chunk_offload gathers every sharded chunk from every rank "
        f"in each forward, so every rank must run the same number of batches (as under {peers}): keep Lightning's "
        "distributed sampler (use_distributed_sampler=True, the default), or give every rank the same count "
        f"({_LIMIT[kind]}, or equal shards)."
    )
