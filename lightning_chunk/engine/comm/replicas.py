"""The sum of each gradient shard over the replicas of its shard group, once a step.

[Note: replicas summed once a step]
In shard groups ([Note: replicas of the shard group] in ``group.py``) each landed gradient shard is all-reduced over
its replicas: the one collective that crosses nodes. With k micro-batches a step accumulated in shards, that was k
all-reduces of every shard a step, where DDP accumulating under ``no_sync`` all-reduces once (as FSDP2's
``set_requires_all_reduce(False)`` does for HSDP). So a micro-batch that does not step (``defer``: Lightning's
accumulation, after the warm-up) lands its shard summed over its own group alone and leaves it ``owed``. The
micro-batch before the step adds what its group accumulated into the shard it lands, on the device (through a slice
of the gradient payload the reduce-scatter left dead), before the one all-reduce, whose sum replaces the shard.
Replicas hold different partial sums until then and end with the same bits, which an all-reduce gives every rank.
A step with shards still owed (every backward under ``block_backward_sync()``, by hand: Lightning refuses a
``training_step`` that returns ``None`` on several ranks) is refused (``refuse_owed``). Between micro-batches a
gradient read sees its group's partial sum, as DDP's local gradient under ``no_sync``. No repack moves an owed
shard: the first step's repack comes after its last micro-batch, and later ones wait for a micro-batch that holds no
gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..chunks.chunk import Chunk
from ..errors import ChunkError

if TYPE_CHECKING:  # the manager builds the reducer that holds this; no import at run time, so no cycle
    from ..memory.manager import ChunkManager


def spare_slice(lo: int, hi: int, capacity: int) -> slice:
    """Another shard's slice of a gradient payload than ``[lo, hi)``: a shard group has two ranks at least."""
    return slice(hi, 2 * hi - lo) if 2 * hi - lo <= capacity else slice(2 * lo - hi, lo)


class ReplicaSums:
    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        self.defer = False  # this backward's micro-batch does not step: leave the sums over replicas to a later one
        self.owed: set[int] = set()  # chunk ids whose gradient shard is summed within the shard group only

    def land(self, chunk: Chunk, out: torch.Tensor, target: torch.Tensor, add: bool) -> bool:
        """``out``, this backward's reduced shard of ``chunk``, summed over the replicas unless ``defer``, with what
        ``target`` (the shard, or a disk shard's buffer) accumulated when it is owed. Returns whether ``out`` is
        still to be added into ``target``."""
        comm = self.manager.comm
        if comm.replicas is None:
            return add
        if self.defer:
            self.owed.add(chunk.chunk_id)
            return add
        if add and chunk.chunk_id in self.owed:
            acc = target.reshape(-1)
            if acc.device != out.device:
                assert chunk.grad_payload is not None
                # queued on the compute stream (a pinned host shard): the offload stream's copy back waits for it
                spare = chunk.grad_payload[spare_slice(*chunk.shard_range, chunk.capacity_numel)]
                acc = spare.copy_(acc, non_blocking=True)
            out.add_(acc)
            add = False
        self.owed.discard(chunk.chunk_id)
        comm.replicate(out, chunk=chunk.chunk_id)
        return add

    def refuse_owed(self) -> None:
        """A step must follow a backward that summed the shards over the replicas."""
        if self.owed:
            raise ChunkError(
                f"[rank {self.manager.comm.all_rank}] the optimizer would step gradients of chunks {sorted(self.owed)} "
                "summed within this rank's shard group only: every backward since the last step ran under "
                "block_backward_sync(). Run a step's last backward outside it, as Lightning's gradient accumulation "
                "does (under DDP such a step takes each rank's own gradients)."
            )
