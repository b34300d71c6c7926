"""When one call of a module has finished its backward: frozen parameters, and modules called more than once.

[Note: frozen parameters in backward]
A trainable parameter leaves COMPUTE when its gradient lands. A frozen one (LoRA's base weights, a frozen
encoder in the middle of a model) never gets a gradient, so it used to stay in use from its module's
pre-backward to the end of backward: every frozen chunk pinned at once, and under a device limit the first
backward failed. So a module owning frozen parameters hooks its inputs that require grad (all of them at once,
``register_multi_grad_hook``): when their gradients are computed its backward is done, and its frozen
parameters go to HOLD_AFTER_BWD, free to be evicted. A count per module covers a module called several
times; a non-reentrant recomputation (whose inputs never get gradients) does not add to it.

[Note: a module called again before its backward]
Autograd sums every use's contribution to a parameter's gradient before it lands, so a module called twice in one
graph (R-Drop's two forwards under different dropout masks, a siamese or contrastive encoder on two views, a block
applied twice) has its parameters in use from the backward of its later call, which autograd runs first (its
nodes are newer), to that of the earlier one, which lands the gradient. For a model called twice that is every
chunk at once: the whole model's payloads stayed on the device through backward, so under a limit the first step
failed, and each error named as the smallest working limit one chunk more than the last (an 8.5 MB model in 1 MB
chunks: ten limits in a row; after the warm-up it needs two chunks and its activations). So once a module is seen
called more than once with grad in a training micro-batch, its later calls (and from the next micro-batch, every
call) hook their inputs as above, and when one call's backward is done its parameters still in use go to
HOLD_AFTER_FWD (backward needs them again): free to be evicted, gathered again by the next call's pre-backward. The
first call of the micro-batch that shows the reuse is not hooked: its backward runs last, where the landing
gradient lets the parameters go. A call's backward can end while another call's has begun only when one call ran
inside the other's forward (a module calling itself); such a module keeps its parameters until the gradient lands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ..chunks.states import TensorState
from .batches import tensors_in
from .moments import in_backward

if TYPE_CHECKING:
    from ..memory.manager import ChunkManager
    from .owners import ModuleOwners

S = TensorState
_eager = torch.compiler.disable  # [Note: hooks under torch.compile] in hooks.py


class ModuleBackwards:
    """The end of each module call's backward, where it matters ([Note: frozen parameters in backward], [Note: a
    module called again before its backward]). ``held``: parameters read by iteration, in use to the end of
    backward (the hooks' set, shared)."""

    def __init__(self, manager: ChunkManager, owners: ModuleOwners, held: set[int]) -> None:
        self.manager, self.owners, self._held = manager, owners, held
        self._hooks: dict[str, Callable[[Any], None]] = {}  # module key -> its inputs' hook
        self._open: dict[str, int] = {}  # module key -> hooked calls whose backward has not finished
        self._calls: dict[str, int] = {}  # module key -> its calls with grad in this training micro-batch
        self._running: dict[str, int] = {}  # module key -> its calls whose forward is running
        self.reused: set[str] = set()  # modules called more than once with grad in a micro-batch, once seen
        self._recursive: set[str] = set()  # modules called inside their own forward
        for key in owners.owned:
            self.add(key)

    def add(self, key: str) -> None:
        """``key``'s module owns parameters (at install, or having adopted one)."""
        self._hooks[key] = self._make_hook(key)

    def forward(self, key: str) -> None:
        """A training micro-batch's forward of ``key``'s module begins, with grad, outside backward."""
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        running = self._running[key] = self._running.get(key, 0) + 1
        if calls > 1:
            self.reused.add(key)
        if running > 1:
            self._recursive.add(key)

    def done_forward(self, key: str) -> None:
        if self._running.get(key):
            self._running[key] -= 1

    def _releases_between_calls(self, key: str) -> bool:
        return key in self.reused and key not in self._recursive

    def hook_inputs(self, key: str, inputs: Any) -> None:
        """After a forward of ``key``'s module: hook the call's inputs that require grad, where the end of its
        backward lets parameters go."""
        if not torch.is_grad_enabled():
            return
        params, owned = self.manager.params, self.owners.owned.get(key, ())
        if not self._releases_between_calls(key) and all(params[i].requires_grad for i in owned):
            return
        if in_backward() and self._open.get(key, 0):
            return  # a recomputation whose backward never runs: the first forward's hook is the one that fires
        leaves = [t for t in tensors_in(inputs) if t.requires_grad]
        if not leaves:
            return  # no backward reaches its inputs: its frozen parameters are never pinned by one
        self._open[key] = self._open.get(key, 0) + 1
        torch.autograd.graph.register_multi_grad_hook(leaves, self._hooks[key], mode="all")

    def _make_hook(self, key: str) -> Callable[[Any], None]:
        @_eager
        def hook(grads: Any) -> None:
            with self.manager.clock.measure("hooks"):
                left = self._open.get(key, 0) - 1
                self._open[key] = max(left, 0)
                between = self._releases_between_calls(key)
                if left > 0 and not between:
                    return  # another call of the module still has its backward ahead
                params = self.manager.params
                for i in self.owners.owned.get(key, ()):
                    if i in self._held:
                        continue
                    chunk, info = self.manager.lookup(params[i])
                    if info.state is not S.COMPUTE or (params[i].requires_grad and not between):
                        continue
                    done = left <= 0 and not params[i].requires_grad
                    chunk.set_state(info, S.HOLD_AFTER_BWD if done else S.HOLD_AFTER_FWD)

        return hook

    def backward_ended(self) -> None:
        self._open.clear()

    def reset(self) -> None:
        """A micro-batch begins."""
        self._open.clear()
        self._calls.clear()
        self._running.clear()
