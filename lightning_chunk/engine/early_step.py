"""``step_in_backward=True``: each chunk steps as soon as its gradients are final, and gives its gradient shard back.

[Note: stepping in backward]
ZeRO-3 holds a rank's gradient shard (in fp32 on two ranks, 2 of the 8 bytes a parameter of training state)
from the reduce-scatter that fills it to the optimizer step that reads it, that is, across most of backward.
Here a chunk steps the moment its gradients are final: with several ranks when its reduce-scatter lands, with
one when its last parameter's gradient is copied in. Its gradient shard's memory is then given back
(``Chunk.release_grad``: the storage shrinks to nothing and every view of it stays valid) until the next
gradient, so a rank holds the gradients of a few chunks at a time instead of all of them.

The update is the plain step's, bit for bit: the optimizer is element-wise (``check_optimizer``), so stepping a
chunk's views alone computes what one ``step()`` over every view computes, with the same hyperparameters
(the LR scheduler steps after ``optimizer.step()``, so the learning rate is the step's). It is exact only when
nothing after backward may change the gradients or veto the step, hence what is refused up front:

- gradient clipping and fp16 loss scaling read every gradient before any step (norm, overflow);
- several optimizers and manual optimization step at times of the user's choosing;
- the disk tier steps its chunks one by one from their files after backward.

Which parameters got a gradient: the plain step skips a parameter that got none (no weight decay, no ``step``),
and with several ranks the ranks vote on that after backward (one if it got one on any rank, DDP's rule). A chunk
steps early only where this rank saw a gradient for each of its trainable parameters, which the vote can only
confirm; a chunk with a parameter that got none (a branch not taken this step) waits for the vote and steps after
backward, chunk by chunk, also giving its gradient shard back. (Every rank runs the same modules, which the
module-sequence check enforces, so the ranks decide alike; the rule would stay exact if they did not, since a step
touches this rank's shard alone and the agreement check before it, [Note: checking once a micro-batch] in
``agreement.py``, runs before the decision.) The warm-up step, a micro-batch traced again and the micro-batches
of gradient accumulation that do not step (``ChunkEngine.accumulating``) step after backward as usual.

One more condition is the model's: the chunk's parameters must not be read by backward after their gradients
are final. Autograd runs a parameter's last use before it accumulates its gradient, so that holds unless a
module saves a detached alias of a parameter for a later backward (an in-place step would then be reported by
autograd's version check on one rank; with several ranks the payload is a gathered copy and is not touched).

Costs: ``optimizer.step()`` runs once per chunk (its step hooks too, as on the disk tier), and after
``backward()`` the stepped parameters have no gradient to read (``on_before_optimizer_step`` sees ``None``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .chunk import Chunk
from .errors import UnsupportedOptimizerError
from .manager import ChunkManager
from .optim import OptimizerBinding

# the refusal of fp16 loss scaling, raised by the strategy at set-up and by the engine at the first backward
FP16_REFUSED = ("step_in_backward=True is not allowed with fp16 loss scaling (precision='16-mixed'): a step that "
                "overflowed must be skipped, which is known only after every gradient. Use precision='bf16-mixed' "
                "or '32-true', or step_in_backward=False.")


class EarlyStep:
    """Steps each chunk of the one optimizer when its gradients are final; the rest after backward, chunk by chunk."""

    def __init__(self, manager: ChunkManager, bindings: Sequence[OptimizerBinding]) -> None:
        if len(bindings) != 1:
            raise UnsupportedOptimizerError(
                f"step_in_backward=True needs exactly one optimizer; got {len(bindings)}. Each chunk steps during "
                "backward, before a second optimizer could step or read its gradients: use step_in_backward=False.")
        self.manager = manager
        self.binding = bindings[0]
        self.active = False  # this backward may step: set when it starts (not in a warm-up or a traced step)
        self.stepped: set[int] = set()  # chunk ids stepped since the last ``finish``
        self.early = 0  # chunks stepped during backward since set-up (the rest stepped after it)
        manager.reducer.on_final = self.grads_final

    def grads_final(self, chunk: Chunk) -> None:
        """The chunk's gradients of this backward are all in its shard (the reducer's and one rank's path)."""
        if not (self.active and self.manager.sync_grads) or chunk.chunk_id in self.stepped or not chunk.trainable:
            return
        # before anything is kept, and before this rank's own decision below ([Note: checking once a micro-batch])
        self.manager.comm.verify_issued()
        if not all(t.has_grad for t in chunk.tensors if t.requires_grad):
            return  # the vote decides which of its parameters step: after backward
        self._step(chunk, {}, pool=True)
        self.early += 1

    def step_rest(self, **kwargs: Any) -> Any:
        """``optimizer.step()`` after backward: the chunks not stepped yet, one at a time, each giving its gradient
        shard back as it goes (so the first step, which creates the optimizer state, never holds both)."""
        out = None
        mgr = self.manager
        for c in mgr.chunks:
            if c.chunk_id not in self.stepped and c.trainable and not c.grad_released and \
                    any(t.has_grad for t in c.tensors):
                out = self._step(c, kwargs, pool=False)
        return out

    def _step(self, chunk: Chunk, kwargs: dict[str, Any], *, pool: bool) -> Optional[Any]:
        """Step the chunk and give its gradient shard back: during backward to the manager's pool, whose block the
        next chunk's gradients take (so the gradient shards stop going through malloc, whose holes the resident
        set keeps); after backward, when the shards of every chunk may be let go at once (the warm-up), to the
        allocator, so that the pool never keeps a whole model's gradients."""
        mgr = self.manager
        mgr.reducer.offload.drain()  # CUDA: a gradient copied to a host shard on the side stream must be in
        with mgr.clock.measure("optimizer"):
            out = self.binding.step_chunk(chunk, **kwargs)
        with mgr.tracked(chunk):
            chunk.release_grad(mgr.pool if pool else None)
        self.stepped.add(chunk.chunk_id)
        return out

    def finish(self) -> None:
        """After the step: the released gradients are gone, as after ``zero_grad()``: the next backward writes
        fresh ones (the flags say overwrite, not add)."""
        mgr = self.manager
        for c in mgr.chunks:
            if c.grad_released:
                c.grad_written = False
                for t in c.tensors:
                    t.has_grad = False
        self.binding.detach_released()
        self.stepped = set()
        self.active = False
