"""Each parameter's optimizer-state norms, from this rank's pieces, without gathering the state.

[Note: optimizer state norms from the pieces]
Runs that log Adam's moments per parameter (the norm of ``exp_avg_sq`` before a loss spike) read them from
``optimizer.state[p]``. Under chunk_offload the state is in pieces, and ``full_optimizer_state`` ([Note: the whole
optimizer state of a parameter] in ``full_state.py``) gathers it whole onto every rank: at 7B, 56 GB of moments on
each rank's host to log a few numbers. As the gradient norms do ([Note: gradient norms from the shards] in
``gradients.py``), each rank takes the norm of each piece it holds (``torch._foreach_norm``, one disk shard paged
in at a time), and several ranks all-reduce ``norm ** p`` (max for inf) with a flag per parameter and key in one
tensor. On one rank a piece is the whole state, and its norm is ``optimizer.state[p][key].norm(p)``'s bit for bit;
on several, the root of a sum, to rounding. Per-element state only (Adam's moments, Muon's momentum); a parameter
the optimizer has not stepped has none.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..chunks.chunk import Role
from ..memory.consolidate import _per_element
from .full_state import settled_state
from .gradients import by_device, paged_runs


def state_norms(engine: Any, binding: Any, norm_type: float) -> dict[int, dict[str, torch.Tensor]]:
    """``{parameter index: {key: norm}}`` for the per-element state ``binding``'s optimizer keeps, every parameter
    that has some on any rank. A collective with several ranks: every rank calls it."""
    settled_state(engine, "optimizer_state_norms()")
    mgr = engine.manager
    views, state = binding.views(), binding.optimizer.state
    pieces: dict[str, list[tuple[Any, torch.Tensor, int]]] = {}  # key -> (chunk, piece, parameter index)
    for i, v in views.items():
        for key, val in (state.get(v) or {}).items():
            if _per_element(key, val, v.numel(), binding.whole_keys) and val.numel():
                pieces.setdefault(key, []).append((mgr.lookup(mgr.params[i])[0], val, i))
    keys = sorted(pieces)
    if mgr.comm.world_size > 1:  # every rank the same keys, in the same order (a rank may hold no piece of one)
        keys = sorted({k for part in mgr.comm.all_gather_object(keys) for k in part})
    local: dict[tuple[int, int], torch.Tensor] = {}  # (key's position, parameter index) -> this rank's piece's norm
    for k, key in enumerate(keys):
        owner = {id(t): i for _, t, i in pieces.get(key, [])}
        for chunk, ts in paged_runs(by_device([(c, t) for c, t, _ in pieces.get(key, [])])):
            with mgr.tiers.reading(chunk, (Role.OPTIM,)):
                norms = torch._foreach_norm(ts, norm_type)
                local.update(((k, owner[id(t)]), n) for t, n in zip(ts, norms, strict=True))
    if mgr.comm.world_size == 1:
        return _by_param(keys, local)
    inf, n = math.isinf(norm_type), len(mgr.params)
    both = torch.zeros(2, len(keys) * n, dtype=torch.float64)
    if local:  # one copy off the state's device, not one a piece
        at = torch.tensor([k * n + i for k, i in local])
        first = next(iter(local.values())).device
        values = torch.stack([v.to(first) for v in local.values()]).double().cpu()
        both[0, at] = values if inf else values.pow(norm_type)
        both[1, at] = 1.0
    both = mgr.comm.all_reduce(
        both.to(mgr.comm.tensor_device()), op="max" if inf else "sum", what="the optimizer state norms", shards=True
    ).cpu()
    sums = both[0] if inf else both[0].pow(1.0 / norm_type)
    # the state's dtype where this rank holds a piece, else its master's, as the moments' is
    dtypes = {(k, i): t.dtype for k, key in enumerate(keys) for _, t, i in pieces.get(key, [])}
    masters = [mgr.lookup(p)[0].master_dtype for p in mgr.params]
    found = {
        (k, i): sums[k * n + i].to(dtypes.get((k, i), masters[i]))
        for k in range(len(keys))
        for i in range(n)
        if both[1, k * n + i] > 0
    }
    return _by_param(keys, found)


def _by_param(keys: list[str], norms: dict[tuple[int, int], torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    out: dict[int, dict[str, torch.Tensor]] = {}
    for (k, i), v in sorted(norms.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.setdefault(i, {})[keys[k]] = v
    return out
