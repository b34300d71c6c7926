"""``ChunkOffloadStrategy.grad_norm``: Lightning's ``grad_norm`` read from the gradient shards, without gathering
([Note: gradient norms from the shards] in ``engine/optim/gradients.py``)."""

from __future__ import annotations

import torch
from lightning.pytorch.utilities import grad_norm

from .engine import ChunkEngine
from .engine.optim.gradients import grad_norms


def sharded_grad_norm(
    engine: ChunkEngine | None, module: torch.nn.Module, norm_type: float | str, group_separator: str
) -> dict[str, torch.Tensor]:
    """What ``grad_norm(module, norm_type, group_separator)`` returns in plain Lightning: each parameter's gradient
    norm under ``grad_{p}_norm{separator}{name}`` and their overall norm under ``grad_{p}_norm_total``, for the
    parameters that got a gradient. Without an engine (before and after ``fit``) it is Lightning's own."""
    if engine is None:
        return grad_norm(module, norm_type, group_separator)  # type: ignore[return-value]  # tensors, not floats
    p = float(norm_type)
    if not p > 0:  # Lightning's check, before any rank takes part in the all-reduce
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type!r}")
    if engine.early is not None:  # [Note: stepping in backward]: each chunk's gradients are gone once it stepped
        raise ValueError(
            "strategy.grad_norm() reads the gradients after backward, and this fit steps each chunk during backward "
            "(step_in_backward=True, or None choosing it where no hook it knows of reads gradients), after which "
            "they are gone. Call it in on_before_optimizer_step or on_after_backward (overriding either keeps the "
            "step after backward under step_in_backward=None), or pass step_in_backward=False."
        )
    engine.grads_ready("reading the gradient norms")
    norms, index_of = grad_norms(engine.manager, p), engine.manager.index_of
    out = {
        f"grad_{p}_norm{group_separator}{name}": norms[index_of[id(t)]]
        for name, t in module.named_parameters()
        if index_of.get(id(t)) in norms
    }
    if out:  # as Lightning takes it: the norm of the per-parameter norms
        out[f"grad_{p}_norm_total"] = torch.tensor(list(out.values())).norm(p)
    return out
