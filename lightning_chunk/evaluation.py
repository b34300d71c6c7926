"""The same number of evaluation batches on every rank.

[Note: evaluation batches on every rank]
An evaluation forward gathers each sharded chunk from every rank, so every rank must run the same number of
validation, test or predict batches: as under ZeRO-3 and FSDP, and unlike DDP, whose forward needs no collective.
Ranks whose batches differ (``use_distributed_sampler=False`` with a dataset split by hand, an ``IterableDataset``
whose shards differ in length) paired one rank's extra forward with whatever the others issued next: a
``CollectiveTimeoutError`` after ``collective_timeout_s`` blaming control flow on gloo, a hang or mixed chunks on
NCCL; and where the extra batch found every chunk gathered it ran, leaving that rank's cache ahead of the others'.
So at the start of every evaluation batch the ranks exchange whether it is their last (Lightning's loop knows, having
fetched the next batch ahead: ``batch_progress.is_last_batch``), one small all-gather that rides on the agreement
check's where that is on. Where they differ, every rank raises ``CollectiveMismatchError`` at that batch, before
any rank runs it, naming each rank's count where its dataloader has a length. A rank with no batch at all never
starts one: the others wait for it and time out naming this exchange. A step that takes ``dataloader_iter`` fetches
its own batches; it is not checked.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher

from .engine import Collectives
from .engine.comm.agreement import CollectiveMismatchError

_KIND = {"validating": "validation", "sanity_checking": "validation", "testing": "test", "predicting": "predict"}


def check_same_batches(trainer: Any, comm: Collectives) -> None:
    """Every rank calls this at the start of each evaluation batch ([Note: evaluation batches on every rank])."""
    if comm.world_size == 1 or trainer is None:
        return
    loop = trainer._active_loop
    progress = getattr(loop, "batch_progress", None)
    if progress is None or isinstance(loop._data_fetcher, _DataLoaderIterDataFetcher):
        return
    kind = next((k for a, k in _KIND.items() if getattr(trainer, a, False)), "evaluation")
    index = progress.current.ready - 1  # this batch's position in the loop (ready counts it already)
    last = comm.values_of_ranks(
        int(progress.is_last_batch),
        what=f"the check that every rank runs {kind} batch {index} (a rank with no batches left does not)",
    )
    if len(set(last)) == 1:
        return
    counts = comm.all_gather_object_on(sum(loop.max_batches), comm.host_group())
    named = (
        ", ".join(f"rank {r}: {f'{c:.0f}' if math.isfinite(c) else 'no length'}" for r, c in enumerate(counts))
        if any(math.isfinite(c) for c in counts)
        else "the dataloaders have no length"
    )
    ends = [str(r) for r, v in enumerate(last) if v]
    who = f"rank {ends[0]}'s dataloader ends" if len(ends) == 1 else f"the dataloaders of ranks {', '.join(ends)} end"
    raise CollectiveMismatchError(
        f"[rank {comm.rank}] the ranks run different numbers of {kind} batches ({named}): at the loop's batch "
        f"{index} (from 0): {who} and the others' go on. chunk_offload gathers every sharded chunk from every rank "
        "in each forward, so every rank must run the same number of batches (as under ZeRO-3 or FSDP): "
        "keep Lightning's distributed sampler (use_distributed_sampler=True, the default), or give every rank the "
        "same count (limit_val_batches / limit_test_batches / limit_predict_batches, or equal shards)."
    )
