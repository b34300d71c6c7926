"""An optimizer's state kept past the engine's teardown, for a checkpoint saved after ``fit``.

[Note: optimizer state after fit]
At the end of ``fit`` the engine gives the parameters their whole values and points each optimizer back at them.
Plain Lightning's optimizer keeps its state there, and users go on with it: ``trainer.save_checkpoint()`` writes it,
``optimizer.state_dict()`` reads it, schedule-free's ``optimizer.eval()`` (``on_fit_end``, or after ``fit``) moves
each parameter to its average with the state's ``z``. An optimizer left without state did nothing there, silently:
the model kept its unaveraged weights.

On one rank each of the rank's pieces is a whole parameter's state, so the optimizer gets it back in the
parameters' shapes as views of the pieces (``KeptOptimizerState.into``): the state the rank held, on the host, no
byte copied where it was in host memory. On several ranks the whole state on every rank would hold it all on every
rank, so by default (``materialize_optimizer_state=None``) the teardown keeps this rank's pieces on the host (what
the rank held during training, no more) and a save gathers them to rank 0 in the plain format (parameter shapes,
the plain optimizer's positions): rank 0 alone, and only while the checkpoint is being written, holds the whole
state, as with DDP. The optimizer's own ``state`` there is ``StateKeptInPieces``: reading a parameter's state
(``optimizer.state[p]``, as every torch optimizer's ``step`` and schedule-free's ``eval()`` do) or
``optimizer.state_dict()`` raises naming ``materialize_optimizer_state=True``, which gathers the whole state into
every rank's optimizer. The pieces go when the next ``fit`` sets up its own optimizers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..chunks.chunk import Tier
from ..errors import ChunkError
from ..memory.consolidate import _pieces, optimizer_state_parts
from ..memory.manager import ChunkManager
from .binding import OptimizerBinding


@dataclass
class KeptOptimizerState:
    """One optimizer's state on this rank: per plain position, the flat pieces this rank held and where they start."""

    pieces: dict[int, tuple[int, dict[str, torch.Tensor]]]  # position -> (first element, key -> flat piece)
    scalars: dict[int, dict[str, Any]]  # position -> scalar state (``step``); the same on every rank
    shapes: dict[int, torch.Size]
    # position -> its per-element state keys ([Note: state keys a parameter has]); each piece keeps its own dtype
    held: dict[int, tuple[str, ...]]
    param_groups: list[dict[str, Any]]

    def plain_state_dict(self) -> dict[str, Any]:
        """``optimizer.state_dict()`` as the unchunked optimizer would write it, on rank 0; the other ranks get the
        param groups and no state (Lightning writes rank 0's). A collective with several ranks."""
        parts = [self.pieces]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rank0 = dist.get_rank() == 0
            gathered: Any = [None] * dist.get_world_size() if rank0 else None
            dist.gather_object(self.pieces, gathered, dst=0)
            if not rank0:
                return {"state": {}, "param_groups": self.param_groups}
            parts = gathered
        state: dict[int, dict[str, Any]] = {}
        for pos in sorted(self.scalars):
            st = dict(self.scalars[pos])
            shape = self.shapes[pos]
            for key in self.held.get(pos, ()):
                found = [part[pos] for part in parts if pos in part and key in part[pos][1]]
                if not found:
                    continue
                flat = torch.empty(shape.numel(), dtype=found[0][1][key].dtype)
                for start, values in found:
                    flat[start : start + values[key].numel()].copy_(values[key])
                st[key] = flat.view(shape)
            state[pos] = st
        return {"state": state, "param_groups": self.param_groups}

    def into(self, optimizer: torch.optim.Optimizer) -> None:
        """One rank: give ``optimizer`` (pointed back at its parameters) this state, each piece viewed in its
        parameter's shape: a piece there is the whole parameter's state, so nothing is copied."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for pos, scalars in self.scalars.items():
            start, values = self.pieces.get(pos, (0, {}))
            shape, p = self.shapes[pos], params[pos]
            whole = {key: v.view(shape) for key, v in values.items() if start == 0 and v.numel() == shape.numel()}
            missing = [key for key in self.held.get(pos, ()) if key not in whole]
            if missing and shape.numel():
                raise AssertionError(f"state {missing} of parameter {pos} is not whole on one rank")
            optimizer.state[p] = {**scalars, **whole, **{key: torch.zeros(shape, dtype=p.dtype) for key in missing}}


class StateKeptInPieces(defaultdict):
    """An optimizer's ``state`` after ``fit`` on several ranks, its pieces kept elsewhere ([Note: optimizer state
    after fit]): reading a parameter's state raises; iterating it (Lightning's teardown moves state) finds none."""

    def __init__(self, message: str) -> None:
        super().__init__(dict)
        self.message = message

    def __missing__(self, key: Any) -> Any:
        raise ChunkError(self.message)

    def __reduce__(self) -> Any:  # a copy of the optimizer (``copy.deepcopy``) keeps the mark
        return (type(self), (self.message,), None, None, iter(self.items()))


def _refuse_state_dict(optimizer: torch.optim.Optimizer) -> None:
    if isinstance(optimizer.state, StateKeptInPieces):  # a ``load_state_dict`` since gave it a state of its own
        raise ChunkError(optimizer.state.message)


def mark_state_kept_in_pieces(optimizer: torch.optim.Optimizer, world_size: int) -> None:
    """``optimizer`` holds no state after ``fit`` (several ranks, or ``materialize_optimizer_state=False``); reading
    it raises, saying where it is."""
    cls = type(optimizer)
    where = f"in pieces, one on each of the {world_size} ranks" if world_size > 1 else "kept apart from it"
    optimizer.state = StateKeptInPieces(
        f"{cls.__module__}.{cls.__qualname__}'s state after fit is {where} (trainer.save_checkpoint writes it "
        "whole); the optimizer itself holds none, where plain Lightning's holds it. Pass "
        "materialize_optimizer_state=True to the strategy to give every rank's optimizer the whole state when fit "
        "ends, or load it from a checkpoint ([Note: optimizer state after fit] in "
        "lightning_chunk/engine/optim/kept_state.py)."
    )
    if _refuse_state_dict not in optimizer._optimizer_state_dict_pre_hooks.values():
        optimizer.register_state_dict_pre_hook(_refuse_state_dict)


def keep_optimizer_state(mgr: ChunkManager, binding: OptimizerBinding) -> KeptOptimizerState:
    """This rank's pieces of ``binding``'s optimizer state on the host: the state itself where it is in host memory
    (the teardown then drops the optimizer's references, so no byte is held twice), a copy where it is on the
    device or in a disk file. A collective with several ranks (the scalar state and the keys are agreed as for a
    checkpoint)."""
    plain_pos = binding.plain_positions()
    parts = optimizer_state_parts(mgr, binding.views(), binding.optimizer.state, binding.whole_keys)
    pieces: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}
    for chunk in mgr.chunks:
        in_memory = chunk.shard_tier is Tier.HOST
        for t in chunk.tensors:
            i = t.slot.param_index
            a, b = _pieces(mgr, chunk, t)
            if i in plain_pos and i in parts.scalars and a < b:
                st = parts.local.get(i) or {}
                pieces[plain_pos[i]] = (
                    a - t.offset,
                    {
                        key: (
                            st[key].reshape(-1).to("cpu", copy=not in_memory)
                            if key in st
                            else torch.zeros(b - a, dtype=parts.dtype(key, chunk))
                        )
                        for key in sorted(parts.held.get(i, ()))
                    },
                )
    return KeptOptimizerState(
        pieces=pieces,
        scalars={plain_pos[i]: st for i, st in parts.scalars.items() if i in plain_pos},
        shapes={plain_pos[i]: mgr.params[i].shape for i in plain_pos},
        held={plain_pos[i]: tuple(sorted(ks)) for i, ks in parts.held.items() if i in plain_pos},
        param_groups=binding.plain_param_groups(plain_pos),
    )


def unbind_after_fit(
    mgr: ChunkManager, binding: OptimizerBinding, *, materialize: bool, whole_state: bool
) -> KeptOptimizerState | None:
    """Point ``binding``'s optimizer back at its parameters, with its whole state where ``whole_state`` (in place on
    one rank); else this rank's pieces, returned for a save, and a state that raises where it is read ([Note:
    optimizer state after fit]). Without ``materialize`` (the parameters left empty) the state is dropped."""
    alone = mgr.comm.world_size == 1
    kept = keep_optimizer_state(mgr, binding) if materialize and (alone or not whole_state) else None
    binding.unbind(whole_state=materialize and whole_state and not alone)
    if kept is not None and whole_state:
        kept.into(binding.optimizer)
        return None
    if kept is not None:
        mark_state_kept_in_pieces(binding.optimizer, mgr.comm.world_size)
    return kept
