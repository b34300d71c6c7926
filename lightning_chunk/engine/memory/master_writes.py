"""Master shards written through the optimizer's views outside its step, and the compute copies made again from them.

[Note: the optimizer's views written outside its step]
The optimizer's param groups hold views of this rank's master shards ([Note: per-parameter views of the master
shards] in ``optim/binding.py``), and some optimizers write their parameters outside ``step()``: schedule-free
AdamW's ``optimizer.eval()`` moves each parameter to its averaged point (``p.lerp_(z, ...)``) before evaluation
and ``optimizer.train()`` moves it back, as its documentation asks a training loop to call around validation and
saving; SAM-style optimizers perturb the weights between two backward passes. Plain PyTorch computes with what they
wrote. Here such a write changed the master and nothing else: the compute copies (a resident gathered payload, a
bf16 ``low`` copy, an aliased chunk's compute shard) kept the old values, and a payload gathered afterwards took
the new ones. Under a device limit a schedule-free run validated on a mixture of averaged and unaveraged chunks
and then trained on averaged ones a chunk at a time: its losses and weights left plain Lightning's, silently.

A write through a view moves the version counter it shares with its master. So every time the compute copies are
made from the masters (``ChunkManager.pack``, ``write_back`` after a step, an EMA swap, a speculated step undone, a
load) the chunk notes its master's storage and version (``copies_made``), and before every training and evaluation
batch ``written`` looks for a master whose counter moved since. Where one did on any rank (the ranks tell each other
with the batch exchange, [Note: the same number of batches on every rank] in ``same_batches.py``: a rank whose shard
holds no piece of a parameter sees no write), every rank makes every compute copy again from its masters, as after a
step (``refresh``), so the ranks keep the same chunks resident. A write through ``.data`` (``p.data.lerp_(...)``)
has a version counter of its own and is not seen: the kernels of the optimizers we know write through the views. A
master that is the payload (one rank, fp32, shard on the device) needs none of this: the write is in the compute
copy already.

A forward outside a step (a callback's sample or a hand-written evaluation in ``on_train_epoch_end``, between
``optimizer.eval()`` and ``.train()``) looks as a batch does, after its roll call ([Note: a forward outside a step] in
``comm/group.py``) has every rank there: ``refresh_outside_a_step`` (one all-reduce of a flag on several ranks). One
rank, with no rank to agree with, also looks before each later module's forward outside a step, at that module's
chunks (``refresh_where_written``).

Between two forwards of one training micro-batch the copies are not made again: a write there is a step that moves
the weights to take gradients elsewhere (SAM's ``first_step`` in the manual recipe Lightning's users follow), and
the second forward computed with the old copies while plain PyTorch computes at the moved weights, silently.
``refuse_written_in_a_step`` raises where a forward's chunks were written since their copies were made (outside a
step on several ranks: after the first forward since the last step, where the ranks agreed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ..chunks.chunk import Chunk, Tier, storage_of
from ..errors import ChunkError

if TYPE_CHECKING:
    from .manager import ChunkManager


def master_key(c: Chunk) -> tuple[int, int] | None:
    """The master shard's storage and version counter; ``None`` where writes into it need no copy made again (the
    master is the payload), none is kept in memory (a disk shard's lives in its file), or it was made under
    ``torch.inference_mode`` (an evaluation alone: no version counter, and no write outside that mode)."""
    if c.master is None or c.master_is_payload() or c.shard_tier is Tier.DISK or c.master.is_inference():
        return None
    return storage_of(c.master), c.master._version


def copies_made(c: Chunk) -> None:
    """``c``'s compute copies were just made from its master: note the master as it is."""
    c.master_seen = master_key(c)


def written(mgr: ChunkManager) -> bool:
    """Whether some master of this rank was written since its compute copies were made."""
    return any(master_key(c) != c.master_seen for c in mgr.chunks)


def refresh(mgr: ChunkManager) -> None:
    """Make every compute copy again from its master, on every rank alike (some rank's masters were written)."""
    mgr.write_back(chunks=[c for c in mgr.chunks if master_key(c) is not None], waiting_grads=True)
    mgr.transfers.masters_written += 1


def refresh_outside_a_step(mgr: ChunkManager) -> None:
    """Before the first forward outside a step, with every rank there: make the compute copies again where some
    rank's masters were written since they were made."""
    seen = written(mgr)
    if mgr.comm.world_size > 1:
        flag = torch.tensor([int(seen)], dtype=torch.int32, device=mgr.comm.tensor_device())
        seen = bool(mgr.comm.all_reduce(flag, "max", what="the masters written before a forward outside a step"))
    if seen:
        refresh(mgr)


def refresh_where_written(mgr: ChunkManager, chunk_ids: Iterable[int]) -> None:
    """One rank, before a later forward outside a step (no rank to agree with): make the compute copies again where
    one of ``chunk_ids`` (the module's) was written since they were made. The module's chunks alone, not every chunk:
    this runs for every module of every forward outside a step (a generation loop's)."""
    if any(master_key(mgr.chunks[i]) != mgr.chunks[i].master_seen for i in chunk_ids):
        refresh(mgr)


def refuse_written_in_a_step(mgr: ChunkManager, chunk_ids: Sequence[int], module: str, *, in_step: bool) -> None:
    """Raise where a training forward is about to compute with copies of masters written since the copies were made
    (by the user's code in this micro-batch: between batches they are made again first; outside a step on several
    ranks, since the first forward after the last step)."""
    for cid in chunk_ids:
        c = mgr.chunks[cid]
        if master_key(c) == c.master_seen:
            continue
        if not in_step:
            raise ChunkError(
                f"the optimizer's parameters in chunk {cid} (module {module!r}) were written after the first forward "
                "since the last step: outside a step, the ranks agree to make the modules' copies of the weights "
                "again at that first forward only. Write them (optimizer.eval(), .train()) before it."
            )
        raise ChunkError(
            f"the optimizer's parameters in chunk {cid} (module {module!r}) were written during this training "
            "step, before a forward that reads them: an optimizer that moves the weights between two forward "
            "and backward passes of one step (SAM's first_step, then a second forward) wants gradients at weights "
            "chunk_offload has not gathered; it makes the modules' copies of the weights again only between "
            "steps. Such optimizers cannot step under chunk_offload; write the optimizer's parameters (eval(), "
            "train()) between steps only."
        )
