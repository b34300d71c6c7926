"""A rank's training state moved off the device between steps, and back: ``offload_states`` / ``reload_states``.

[Note: offloading states between phases]
An RL loop (a generation engine runs between training phases) or a loop over several models needs, between steps,
the device memory that training holds: DeepSpeed's ``offload_states``, verl's parameter and optimizer offload. Here
every device-tier shard (master, compute copy, gradient, optimizer state) moves to the host tier and no payload
stays resident, so the ledger's device bytes go to 0, and on CUDA the caching allocator gives the memory back.

It takes the path every other change of tiers takes, ``ChunkEngine._place`` with the layout unchanged and the
device tier replaced by the host: values, the gradients the last step left (kept until ``zero_grad``, as in
PyTorch) and the optimizer state move by piece, the optimizers are rebound, the EMA follows. So training after
``reload`` is, bit for bit, the training that never offloaded, which a copy of our own beside the repack would have
to be tested into. The price is the repack's: on several ranks one all-gather of the shards each way, so every rank
must call it at the same point, as any collective. Disk-tier shards stay where they are (they hold no device
memory), and the host must hold the shards that come to it: ``host_memory_limit`` is not applied to them.

Between steps only: inside a micro-batch, or between a backward and its optimizer step, gradients are in flight
and a repack would lose them. A micro-batch that starts offloaded reloads first, so a forgotten ``reload`` costs a
repack, never a wrong step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..chunks.chunk import Tier
from ..errors import ChunkError
from ..memory.full_params import check_stray_writes
from ..system.host_heap import release_freed_memory

if TYPE_CHECKING:  # a type only: the engine owns this
    from .engine import ChunkEngine


class StateOffload:
    """Whether the engine's device-tier shards are parked on the host ([Note: offloading states between phases])."""

    def __init__(self, engine: ChunkEngine) -> None:
        self.engine = engine
        self.offloaded = False

    def offload(self) -> None:
        """Move every device-tier shard to the host tier and release every payload; a no-op when offloaded."""
        if self.offloaded:
            return
        mgr = self.engine.manager
        self._place({c.chunk_id: Tier.HOST if c.shard_tier is Tier.DEVICE else c.shard_tier for c in mgr.chunks})
        self.offloaded = True
        if mgr.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Put the shards back on the tiers the placement policy gives them; a no-op when not offloaded."""
        if not self.offloaded:
            return
        self._place(None)
        self.offloaded = False

    def _place(self, tiers: dict[int, Tier] | None) -> None:
        eng = self.engine
        mgr = eng.manager
        if not eng._no_grads_held:
            raise ChunkError(
                "offload_states() and reload_states() run between optimizer steps only: this step's gradients are "
                "being accumulated. Call them where a step begins or ends (on_train_batch_start or "
                "on_train_batch_end at an accumulation boundary), on every rank."
            )
        assert mgr.layout is not None
        check_stray_writes(mgr)  # a write into a payload outside a step would be lost with it
        for b in eng.bindings:  # a zero_grad() since the last step cleared what the repack would carry
            b.slots.sync_zero_grad()
        trace = eng.hooks.moments.trace
        views, planned = eng.description.plan_tiers(mgr.layout, trace)
        eng._place(mgr.layout, views, planned if tiers is None else tiers)
        if trace is not None:  # the pack reset the reduce schedule to its untraced default, as after any re-place
            mgr.grads.follow_trace(trace)
        eng._backward_ends()  # the views hold the gradients they held, as after any repack
        release_freed_memory()
