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
differ in training, validation or test, every rank raises ``CollectiveMismatchError`` at that batch, before any rank
runs it, naming each rank's count where its dataloader has a length.

Predict is where counts differ by default: Lightning splits its data without padding
(``UnrepeatedDistributedSamplerWrapper``, so that no sample is predicted twice): 5 samples on 2 ranks are 3 and 2.
There a rank whose last batch comes first runs it, then runs it again, output dropped, a turn for each batch the
others still run (``Turn.REPEAT`` in the exchange), and leaves the loop with them: the forward passes, and so the
collectives, stay paired, as Hugging Face's ``synced_gpus`` keeps ranks generating different lengths in step. The
repeats call ``predict_step`` (its output goes nowhere: no hook, no writer sees it) with the batch's inputs, whose
forward issues the same collectives as the others' when the model takes the same path for any batch. Training,
validation and test are not repeated: a repeated step would count twice in metrics, logs and gradients.

A rank with no batch at all (a stream shorter than the ranks), or that skips the rest of an epoch
(``on_train_batch_start`` returning -1), never starts one: the others time out naming this exchange. A step that
takes ``dataloader_iter`` fetches its own batches; it is not checked.
"""

from __future__ import annotations

import enum
import functools
import math
import operator
from collections.abc import Callable
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
}


class Turn(enum.IntEnum):
    """What a rank says at the start of a batch ([Note: the same number of batches on every rank])."""

    MORE = 0  # batches follow this one
    LAST = 1  # this is the rank's last batch
    REPEAT = 2  # predict only: the rank's batches ended; it repeats its last while the others run theirs


def check_same_batches(trainer: Any, comm: Collectives, written: bool, signals: int = 0) -> tuple[bool, bool, int]:
    """Every rank calls this at the start of each batch ([Note: the same number of batches on every rank]). First:
    True where this rank must repeat the batch after running it (``repeat_while_others_run``): predict, when it is
    this rank's last and another rank has more. Second: whether any rank's masters were ``written`` outside a step
    ([Note: the optimizer's views written outside its step] in ``engine/memory/master_writes.py``), told with it.
    Third: the ``signals`` masks of every rank or-ed ([Note: signals on several ranks] in ``signals.py``)."""
    if comm.world_size == 1:
        return False, written, signals
    kind = None if trainer is None else next((k for a, k in _KIND.items() if getattr(trainer, a, False)), None)
    loop = None if kind is None else trainer.fit_loop.epoch_loop if kind == "training" else trainer._active_loop
    fetcher = None if loop is None else (trainer.fit_loop if kind == "training" else loop)._data_fetcher
    if loop is None or isinstance(fetcher, _DataLoaderIterDataFetcher):
        told = comm.values_of_ranks(written | signals << 1, what="the ranks telling whether their masters were written")
        return False, any(v & 1 for v in told), functools.reduce(operator.or_, (v >> 1 for v in told), 0)
    assert kind is not None
    progress = loop.batch_progress
    index = progress.current.ready - 1  # this batch's position in the loop (ready counts it already)
    skipped = " or that skipped the rest of its epoch (on_train_batch_start returned -1)" if kind == "training" else ""
    turn = Turn.LAST if progress.is_last_batch else Turn.MORE
    told = comm.values_of_ranks(
        turn | written << 2 | signals << 3,
        what=f"the check that every rank runs {kind} batch {index} (not a rank whose batches ended{skipped})",
    )
    last, written = [v & 3 for v in told], any(v >> 2 & 1 for v in told)
    signals = functools.reduce(operator.or_, (v >> 3 for v in told), 0)
    if len(set(last)) == 1:
        return False, written, signals
    if kind == "predict":
        return turn == Turn.LAST and Turn.MORE in last, written, signals
    count = trainer.num_training_batches if kind == "training" else sum(loop.max_batches)
    counts = comm.all_gather_object_on(count, comm.all_host_group())
    named = (
        ", ".join(f"rank {r}: {f'{c:.0f}' if math.isfinite(c) else 'no length'}" for r, c in enumerate(counts))
        if any(math.isfinite(c) for c in counts)
        else "the dataloaders have no length"
    )
    ends = [str(r) for r, v in enumerate(last) if v]
    who = f"rank {ends[0]}'s dataloader ends" if len(ends) == 1 else f"the dataloaders of ranks {', '.join(ends)} end"
    peers = "DDP, ZeRO-3 or FSDP" if kind == "training" else "ZeRO-3 or FSDP"
    raise CollectiveMismatchError(
        f"[rank {comm.all_rank}] the ranks run different numbers of {kind} batches ({named}): at the loop's batch "
        f"{index} (from 0): {who} and the others' go on. chunk_offload gathers every sharded chunk from every rank "
        f"in each forward, so every rank must run the same number of batches (as under {peers}): keep Lightning's "
        "distributed sampler (use_distributed_sampler=True, the default), or give every rank the same count "
        f"({_LIMIT[kind]}, or equal shards)."
    )


def repeat_while_others_run(comm: Collectives, step: Callable[[], object]) -> None:
    """Predict, after this rank's last batch: run ``step`` again, its output dropped, once for each batch another
    rank still runs, then return with them ([Note: the same number of batches on every rank])."""
    while True:
        turns = comm.values_of_ranks(
            Turn.REPEAT, what="a rank whose predict batches ended, repeating its last while the others run theirs"
        )
        step()
        if Turn.MORE not in turns:
            return
