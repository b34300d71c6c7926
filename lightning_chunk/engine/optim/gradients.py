"""Passes over the gradient shards after backward: clipping by the global norm, fp16's unscale and overflow check,
each parameter's norm.

The gradients are the bound optimizers' views of the chunks' gradient shards, as ``(chunk, gradient)`` pairs in
chunk order. A pass takes them per device, in runs split where a disk-tier chunk begins or ends, so that it pages
one disk shard's gradients in at a time while memory-resident ones go in one ``_foreach`` call.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..chunks.chunk import Role, Tier


def by_device(pairs: Sequence[tuple[Any, torch.Tensor]]) -> dict[torch.device, list[tuple[Any, torch.Tensor]]]:
    out: dict[torch.device, list[tuple[Any, torch.Tensor]]] = {}
    for c, g in pairs:
        out.setdefault(g.device, []).append((c, g))
    return out


def paged_runs(grouped: dict[torch.device, list[tuple[Any, torch.Tensor]]]) -> Iterator[tuple[Any, list]]:
    """Gradients per device, in order, split where a disk-tier chunk begins or ends (the chunk that owns the run)."""
    for pairs in grouped.values():
        run: list[torch.Tensor] = []
        key = owner = None
        for c, g in pairs:
            k = c.chunk_id if c.shard_tier is Tier.DISK else None
            if run and k != key:
                yield owner, run
                run = []
            key, owner = k, c
            run.append(g)
        if run:
            yield owner, run


def clip_grad_norm(
    pairs: Sequence[tuple[Any, torch.Tensor]], max_norm: float, norm_type: float, manager: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip by the global norm over every shard of every rank; returns that norm and the coefficient applied.

    On one rank the arithmetic is ``torch.nn.utils.clip_grad_norm_``'s, step for step (per-tensor norms grouped by
    device, the norm of their stack, a clamped fp32 coefficient), so clipping is bit-exact with plain PyTorch.
    Several ranks all-reduce the local ``norm ** p`` (max for inf) on the collectives' device (NCCL takes device
    tensors only); every rank takes part, also one that holds no gradient piece."""
    comm = manager.comm
    norm_type = float(norm_type)
    grouped = by_device(pairs)
    first = pairs[0][1].device if pairs else torch.device("cpu")
    norms: list[torch.Tensor] = []
    for chunk, gs in paged_runs(grouped):
        with manager.tiers.reading(chunk, (Role.GRAD,)):
            norms.extend(n.to(first) for n in torch._foreach_norm(gs, norm_type))
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros((), device=first)
    if comm.world_size > 1:
        dev = comm.tensor_device()
        if math.isinf(norm_type):
            total = comm.all_reduce(total.reshape(1).to(dev), op="max", what="the gradient norm", shards=True)[0].to(
                first
            )
        else:
            acc = comm.all_reduce(
                total.double().pow(norm_type).reshape(1).to(dev), op="sum", what="the gradient norm", shards=True
            )[0]
            total = acc.pow(1.0 / norm_type).float().to(first)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for chunk, gs in paged_runs(grouped):
        with manager.tiers.writing(chunk, (Role.GRAD,)):
            torch._foreach_mul_(gs, coef.to(gs[0].device))
    return total, coef


def unscale_and_check(
    pairs: Sequence[tuple[Any, torch.Tensor]], scaler: Any, manager: Any, *, found: bool = False
) -> bool:
    """fp16: unscale the gradients; True when some rank overflowed (every rank then skips). ``found``: this rank
    already saw an overflow (in gradients unscaled before, [Note: speculating past the norm and the overflow])."""
    runs = ((manager.tiers.writing(c, (Role.GRAD,)), gs) for c, gs in paged_runs(by_device(pairs)))
    return scaler.unscale_and_check([], manager.comm, runs=runs, found_before=found)


def grad_norms(manager: Any, norm_type: float) -> dict[int, torch.Tensor]:
    """Each parameter's gradient ``norm_type``-norm (positive or inf) by its index in ``manager``, for those that
    got a gradient on some rank.

    [Note: gradient norms from the shards]
    Lightning's ``grad_norm(module)`` reads every ``param.grad``, which under chunk_offload is ``None``: the gradients
    are pieces of the chunks' gradient shards ([Note: gradients read where they are not] in ``precision.py``), and
    gathering them whole (``full_parameters(with_grads=True)``) costs a whole model of gradients on every rank. The
    norms need no gather: each rank takes the norm of each piece it holds (``torch._foreach_norm``, one disk shard
    paged in at a time), and several ranks all-reduce ``norm ** p`` (max for inf) with a flag per parameter in one
    tensor, so that a parameter is named where any rank holds a gradient of it (the vote's rule). On one rank a
    piece is the whole gradient, and its norm is ``param.grad.norm(p)``'s bit for bit; on several the root of a sum,
    as DDP's norm of the reduced gradient up to rounding, in the gradient shards' dtype."""
    pairs: list[tuple[Any, torch.Tensor]] = []
    index: dict[int, int] = {}  # id of a gradient piece -> its parameter
    for i, p in enumerate(manager.params):
        g = manager.grads.view(i)
        if g is not None and g.numel():
            pairs.append((manager.lookup(p)[0], g))
            index[id(g)] = i
    local: dict[int, torch.Tensor] = {}
    for chunk, gs in paged_runs(by_device(pairs)):
        with manager.tiers.reading(chunk, (Role.GRAD,)):
            local.update((index[id(g)], n) for g, n in zip(gs, torch._foreach_norm(gs, norm_type), strict=True))
    comm = manager.comm
    if comm.world_size == 1:
        return local
    first = pairs[0][1].device if pairs else torch.device("cpu")
    inf = math.isinf(norm_type)
    both = torch.zeros(2, len(manager.params), dtype=torch.float64)
    if local:  # one copy off the gradients' device, not one a parameter
        held = torch.tensor(list(local))
        values = torch.stack([n.to(first) for n in local.values()]).double().cpu()
        both[0, held] = values if inf else values.pow(norm_type)
        both[1, held] = 1.0
    both = comm.all_reduce(
        both.to(comm.tensor_device()), op="max" if inf else "sum", what="the gradient norms", shards=True
    ).cpu()
    sums = (both[0] if inf else both[0].pow(1.0 / norm_type)).to(first)
    dtypes = [manager.lookup(p)[0].master_dtype for p in manager.params]  # the gradient shards' (bf16-true: bf16)
    return {i: sums[i].to(dtypes[i]) for i in range(len(manager.params)) if both[1, i] > 0}
