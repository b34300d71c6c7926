"""An optimizer's ``state`` while the engine steps it: keyed by the shard views its groups hold.

[Note: optimizer state keyed by shards]
During ``fit`` the optimizer's param groups hold views of this rank's master shards (``OptimizerBinding.bind``),
and its state is keyed by those views, as DeepSpeed's and FSDP1's flat parameters key theirs. A module parameter
is not among its keys. Plain ``defaultdict`` state answered ``optimizer.state[p]`` for one with a fresh empty dict,
silently: a callback that logs Adam's moments per parameter (or resets them) found none and logged nothing, and the
empty entry it left, keyed by a tensor no group holds, made a later ``optimizer.state_dict()`` fail with a bare
``KeyError``. The way in is ``full_optimizer_state`` ([Note: the whole optimizer state of a parameter] in
``full_state.py``). ``StateOfShards`` is that ``defaultdict`` with one difference: a missing key that is a module
parameter the engine manages raises, naming it and where its state is. The views' own first reads (every torch
optimizer's ``state = self.state[p]`` at its first step) still get their empty dict. ``p in state`` and
``state.get(p)`` answer that a module parameter is not there, as they must for code that asks before the first
step, and warn once an optimizer that this is so all through ``fit``. ``optimizer.load_state_dict`` replaces
``state`` with a plain ``defaultdict``, so the binding puts this one back after each load; when ``fit`` ends it
gives the optimizer a plain one again, keyed by the module parameters ([Note: optimizer state after fit] in
``kept_state.py``).
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any

import torch

from ..errors import ChunkError
from ..memory.manager import ChunkManager


class StateOfShards(defaultdict):
    """``optimizer.state`` during ``fit``: a ``defaultdict(dict)`` whose missing module parameters raise."""

    def __init__(self, manager: ChunkManager, items: Any = ()) -> None:
        super().__init__(dict, items)
        self.manager = manager
        self.warned = False

    def _module_param(self, key: Any) -> int | None:
        """The index of ``key`` where it is a module parameter the engine manages."""
        mgr = self.manager
        i = mgr.index_of.get(id(key)) if isinstance(key, torch.Tensor) else None
        return i if i is not None and mgr.params[i] is key else None

    def _asked(self, key: Any) -> None:
        i = self._module_param(key)
        if i is None or self.warned:
            return
        self.warned = True
        warnings.warn(
            f"`in optimizer.state` or optimizer.state.get() for module parameter {self.manager.names[i]!r}: under "
            "chunk_offload the state is keyed by this rank's pieces of the parameters, so during fit it holds no "
            "module parameter and this answers as if it had no state. Between steps "
            "trainer.strategy.full_optimizer_state(module) gives each parameter's whole state ([Note: optimizer "
            "state keyed by shards] in lightning_chunk/engine/optim/shard_state.py).",
            stacklevel=3,
        )

    def __contains__(self, key: Any) -> bool:
        found = super().__contains__(key)
        if not found:
            self._asked(key)
        return found

    def get(self, key: Any, default: Any = None) -> Any:
        if not super().__contains__(key):
            self._asked(key)
        return super().get(key, default)

    def __missing__(self, key: Any) -> Any:
        mgr = self.manager
        i = self._module_param(key)
        if i is not None:
            raise ChunkError(
                f"optimizer.state[{mgr.names[i]!r}]: under chunk_offload the optimizer steps this rank's pieces of "
                "the parameters (views of the chunks' shards), and its state is keyed by those pieces, not by the "
                "module's parameters, so it holds none for this one, where plain Lightning's optimizer would. "
                "Between steps, `with trainer.strategy.full_optimizer_state(module) as state:` gives each "
                "parameter's whole state as state[p] (on every rank), and writes back what you change in it. "
                "trainer.save_checkpoint writes the whole state in the parameters' shapes (lightning-chunk "
                "consolidate reads it back), and after fit materialize_optimizer_state=True gives every rank's "
                "optimizer the whole state keyed by the parameters ([Note: optimizer state keyed by shards] in "
                "lightning_chunk/engine/optim/shard_state.py)."
            )
        return super().__missing__(key)

    def __reduce__(self) -> Any:  # a copy (``copy.deepcopy`` of the optimizer) is a plain defaultdict
        return (defaultdict, (dict,), None, None, iter(self.items()))


def keyed_by_shards(optimizer: torch.optim.Optimizer, manager: ChunkManager) -> None:
    """Give ``optimizer`` a ``StateOfShards`` holding what its state holds now (no-op where it has one)."""
    if not isinstance(optimizer.state, StateOfShards):
        optimizer.state = StateOfShards(manager, optimizer.state.items())


def keyed_by_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` back a plain ``defaultdict(dict)`` state, as torch's constructor makes (emptied)."""
    optimizer.state = defaultdict(dict)
