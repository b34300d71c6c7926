"""An optimizer's state kept past the engine's teardown, for a checkpoint saved after ``fit``.

[Note: optimizer state after fit]
At the end of ``fit`` the engine gives the parameters their whole values and points each optimizer back at them,
by default with no state: building every rank's whole optimizer state there would hold it all on every rank. But
``trainer.save_checkpoint()`` after ``fit`` (or after a ``validate`` that followed it) writes the optimizers' states,
as plain Lightning does, and a resume from that file must go on with Adam's moments, not restart them. So the
teardown keeps this rank's pieces of each optimizer's state on the host (what the rank held during training, no
more), and a save gathers them to rank 0 in the plain format (parameter shapes, the plain optimizer's positions):
rank 0 alone, and only while the checkpoint is being written, holds the whole state, as with DDP. The pieces are
the state itself where it was in host memory, not a copy (the optimizers let go of it), and go when the next
``fit`` sets up its own optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..chunks.chunk import Tier
from ..memory.consolidate import _pieces, optimizer_state_parts
from ..memory.manager import ChunkManager
from .binding import OptimizerBinding


@dataclass
class KeptOptimizerState:
    """One optimizer's state on this rank: per plain position, the flat pieces this rank held and where they start."""

    pieces: dict[int, tuple[int, dict[str, torch.Tensor]]]  # position -> (first element, key -> flat piece)
    scalars: dict[int, dict[str, Any]]  # position -> scalar state (``step``); the same on every rank
    shapes: dict[int, torch.Size]
    keys: tuple[str, ...]  # per-element state keys; each piece keeps its own dtype
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
            for key in self.keys:
                found = [part[pos] for part in parts if pos in part and key in part[pos][1]]
                if not found:
                    continue
                flat = torch.empty(shape.numel(), dtype=found[0][1][key].dtype)
                for start, values in found:
                    flat[start : start + values[key].numel()].copy_(values[key])
                st[key] = flat.view(shape)
            state[pos] = st
        return {"state": state, "param_groups": self.param_groups}


def keep_optimizer_state(mgr: ChunkManager, binding: OptimizerBinding) -> KeptOptimizerState:
    """This rank's pieces of ``binding``'s optimizer state on the host: the state itself where it is in host memory
    (the teardown then drops the optimizer's references, so no byte is held twice), a copy where it is on the
    device or in a disk file. A collective with several ranks (the scalar state and the keys are agreed as for a
    checkpoint)."""
    plain_pos = binding.plain_positions()
    parts = optimizer_state_parts(mgr, binding.views(), binding.optimizer.state)
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
                        for key in parts.keys
                    },
                )
    return KeptOptimizerState(
        pieces=pieces,
        scalars={plain_pos[i]: st for i, st in parts.scalars.items() if i in plain_pos},
        shapes={plain_pos[i]: mgr.params[i].shape for i in plain_pos},
        keys=tuple(parts.keys),
        param_groups=binding.plain_param_groups(plain_pos),
    )
