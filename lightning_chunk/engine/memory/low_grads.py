"""A host chunk's gradients kept in bf16 from backward to its step in backward, read by the one-pass Adam as they are.

[Note: gradients in bf16 until the step]
In bf16-mixed a parameter's gradient is made in bf16. With one rank a host chunk took it into its fp32 gradient
shard: on a GPU the copy landed in a pinned bf16 staging slice and the worker widened it into the shard (2 bytes
read, 4 written, and the 4 its cache lines read before the write), then the one-pass Adam read the shard's 4 bytes
again: some 38 bytes an element of host memory traffic a step where the step itself needs 28 with a bf16 gradient
(``benchmarks/optimizer_step.py``), and the host Adam is what binds the step of a model several times the GPU's
memory. Widening a bf16 number to fp32 is exact, so a kernel that widens each gradient as it loads it computes the
same bits from the bf16 values (``load_grad`` in ``optim/adam_native.py``).

So where a chunk is stepped in backward by the native one-pass kernel (one rank, bf16-mixed, a host shard, Adam(W)
with nothing between backward and the step: no clipping, no loss scaling, not a micro-batch that accumulates), its
gradients of the step go into a bf16 buffer of the shard's size (``Chunk.grad_low``, pinned as the shards are, so
the device-to-host copy lands in it with no staging), the kernel reads them there, and the buffer goes back to the
host pool with the step, whence the next chunk takes its own (its first too: the few in flight serve every chunk).
The fp32 gradient shard stays given back all the while: half the gradient bytes held too.
The early step says which chunks may (``takes``, set for one backward).

What may read a gradient finds it in fp32, always: a second gradient for a parameter (pieces of one, summed in
fp32 as before), the end of backward for a chunk not stepped in it, and a step the native kernel could not take
widen the bf16 gradients into the fp32 shard first (``widen``), which is what the chunk would have held. The end of
every backward widens what is left (``widen_all``), also of one that raised ([Note: a backward that raised] in
``runtime/raised.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..chunks.chunk import Chunk, Role, TensorInfo, nbytes

if TYPE_CHECKING:  # the gradients' side of the manager builds this
    from .grads import ChunkGrads

LOW_GRADS = True  # False: every gradient goes to the fp32 shard (the benchmark's other row)


class LowGrads:
    """The bf16 gradient buffers of the host chunks stepped from them in this backward (``grads.low``)."""

    def __init__(self, grads: ChunkGrads) -> None:
        self.grads = grads
        self.manager = grads.manager
        self.takes: Callable[[Chunk], bool] | None = None  # for one backward: chunks the kernel steps from bf16
        self.taken = 0  # chunks whose gradients of a step were taken in bf16, since set-up
        self.widened = 0  # of those, the ones widened into the fp32 shard after all

    def target(self, chunk: Chunk, info: TensorInfo) -> torch.Tensor | None:
        """The buffer a gradient of ``info``'s parameter is copied into, overwriting its range: the chunk's bf16
        one, or ``None`` for the fp32 shard (as before, where ``has_grad`` says whether it adds)."""
        if chunk.grads_in_low:
            if not info.has_grad:
                return chunk.grad_low
            self.widen(chunk)  # a second gradient for this parameter: summed in fp32
            return None
        if not LOW_GRADS or self.takes is None or not self.takes(chunk) or any(t.has_grad for t in chunk.tensors):
            return None
        mgr = self.manager
        with mgr.ledger.tracked(chunk):
            chunk.release_grad(self.grads.host_pool)  # it holds nothing of this step: given back, if it was not
            pool, dtype, low = self.grads.host_pool, chunk.compute_dtype, chunk.grad_low

            def make() -> torch.UntypedStorage:
                return mgr.tiers.alloc(chunk, Role.GRAD, dtype).untyped_storage()

            # a chunk's first buffer comes from the pool too: the few in flight serve every chunk, where each
            # allocated its own at its first step from bf16 (on a GPU pinned), all but the pool's then freed
            if low is None:
                chunk.grad_low = (
                    pool.tensor(chunk.shard_numel, dtype, make)
                    if pool.enabled
                    else mgr.tiers.alloc(chunk, Role.GRAD, dtype)
                )
            elif low.untyped_storage().nbytes() == 0:
                pool.fill(low.untyped_storage(), nbytes(low), make)
            chunk.grad_low_lazy = False  # in use again (if it kept its bytes)
        chunk.grads_in_low = True
        self.taken += 1
        return chunk.grad_low

    def widen(self, chunk: Chunk) -> None:
        """On the autograd thread: the chunk's bf16 gradients of this step into its fp32 shard, which then holds
        what it would have held; the bf16 buffer goes back to the pool."""
        if not chunk.grads_in_low:
            return
        mgr = self.manager
        mgr.reducer.offload.drain()  # the copies into the bf16 buffer have landed
        self.grads.restore(chunk)
        assert chunk.grad is not None and chunk.grad_low is not None
        chunk.grad.copy_(chunk.grad_low)
        self.release(chunk)
        self.widened += 1

    def widen_all(self) -> None:
        """Every chunk whose gradients are still in bf16 (not stepped from them), widened."""
        for c in self.manager.chunks:
            self.widen(c)

    def release(self, chunk: Chunk) -> None:
        """The chunk stepped (or its gradients were widened): its bf16 buffer goes back to the pool."""
        chunk.grads_in_low = False
        low = chunk.grad_low
        if low is not None and low.untyped_storage().nbytes() and not chunk.grad_low_lazy:
            with self.manager.ledger.tracked(chunk):
                chunk.grad_low_lazy = self.grads.host_pool.empty(low.untyped_storage())
