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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..chunks.chunk import Chunk, Tier, storage_of

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
