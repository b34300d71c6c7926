"""Which optimizers can step flat shards, how many bytes of state they keep an element, and the kernel each param
group steps with ([Note: the kernel and the user's param groups])."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..config import ChunkConfig
from ..errors import UnsupportedOptimizerError
from .elementwise import Dependence, dependence, twin_settings
from .whole import needs_whole

ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "NAdam", "RAdam", "ASGD", "Rprop", "Adadelta"}
)
# by name: Hugging Face's Adafactor too (torch's returns before, stepped whole)
SHAPE_DEPENDENT = frozenset({"LBFGS", "SparseAdam", "Adafactor"})


def is_known(optimizer: torch.optim.Optimizer) -> bool:
    """One of torch's element-wise optimizers."""
    return type(optimizer).__module__.startswith("torch.optim") and type(optimizer).__name__ in ELEMENTWISE


def check_optimizer(optimizer: torch.optim.Optimizer, config: ChunkConfig, world_size: int = 1) -> None:
    """Refuse an optimizer that cannot step flat pieces of parameters, or one taken as element-wise whose twins show
    otherwise where this run would split its update ([Note: an optimizer said to be element-wise])."""
    name = type(optimizer).__name__
    known = is_known(optimizer)
    whole = needs_whole(optimizer)
    if whole is not None:  # [Note: optimizers that need whole parameters] in whole.py
        where = "step_in_backward=True on several ranks" if config.step_in_backward and world_size > 1 else None
        where = where or ("a host_memory_limit (the disk tier)" if config.host_memory_limit is not None else None)
        if where is not None:
            raise UnsupportedOptimizerError(
                f"{whole}, is stepped whole: on several ranks after backward, with one gather a chunk over the "
                f"ranks, and never through the disk tier's steps of one chunk at a time; here {where} would step it "
                f"otherwise. Use step_in_backward=False or None (on one rank True works too) and no host_memory_limit "
                f"with {type(optimizer).__name__}."
            )
        return
    if name in SHAPE_DEPENDENT:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} needs parameter shapes (or a closure over "
            "whole tensors), but chunk_offload steps flat shards of parameters; use one of "
            f"{', '.join(sorted(ELEMENTWISE))}, or torch.optim.Adafactor or Muon, which it steps whole."
        )
    if not known and not config.assume_elementwise_optimizer:
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__module__}.{type(optimizer).__qualname__} is not known to update each element on its "
            "own; chunk_offload steps flat shards of parameters. Known element-wise optimizers: "
            f"{', '.join(sorted(ELEMENTWISE))}. "
            "If yours is element-wise, pass assume_elementwise_optimizer=True to the strategy."
        )
    if not known:
        _check_the_word(optimizer, config, world_size)


def _check_the_word(optimizer: torch.optim.Optimizer, config: ChunkConfig, world_size: int) -> None:
    found = dependence(optimizer)
    splits = [f"{world_size} ranks each step their own pieces"] if world_size > 1 else []
    if found is Dependence.ACROSS:
        splits += ["step_in_backward=True steps each chunk in a call of its own"] if config.step_in_backward else []
        if config.host_memory_limit is not None:
            splits.append("a host_memory_limit may put chunks on the disk tier, stepped one at a time")
    if found is None or not splits:
        return
    cls = type(optimizer)
    alone = (
        "one rank" if found is Dependence.WITHIN else "one rank with step_in_backward=False and no host_memory_limit"
    )
    raise UnsupportedOptimizerError(
        f"{cls.__module__}.{cls.__qualname__} was taken as element-wise (assume_elementwise_optimizer=True), but its "
        f"update of an element reads other elements {found}: stepped on twins, 64 elements as one parameter, as two "
        "parameters and in two optimizers gave different updates (a norm over a parameter as in LAMB or LARS, a sum "
        f"over the group as in Prodigy). Here {' and '.join(splits)}, so each would compute another update, "
        f"silently. Use an element-wise optimizer ({', '.join(sorted(ELEMENTWISE))}); on {alone} this one steps "
        "as in plain PyTorch ([Note: an optimizer said to be element-wise] in engine/optim/elementwise.py)."
    )


def state_bytes_per_element(optimizer: torch.optim.Optimizer, group: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes of optimizer state per parameter element, found by stepping a 4-element twin once (``twin_settings``:
    given ``AdamW``'s ``decoupled_weight_decay`` it raised, and the fallback's two moments under-counted
    ``amsgrad=True`` by a third: a disk shard's state file too small at the first step, a device shard's state
    under-planned)."""
    kwargs = twin_settings(optimizer, group) or {}
    # Muon steps matrices alone; Adafactor's state for a matrix is a row and a column, next to nothing an element
    probe = torch.zeros(2, 2, dtype=dtype) if needs_whole(optimizer) else torch.zeros(4, dtype=dtype)
    probe.grad = torch.zeros_like(probe)
    try:
        twin = type(optimizer)([probe], **kwargs)
        twin.step()
    except Exception:  # an unusual constructor: assume Adam's two moments
        return 2 * probe.element_size()
    return (
        sum(v.numel() * v.element_size() for v in twin.state[probe].values() if torch.is_tensor(v) and v.numel() == 4)
        // 4
    )


def split_at_cache_lines(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group is stepped by torch's fused CPU Adam(W), which splits its work between threads at
    cache-line boundaries: its bits do not depend on the thread count (``beside_io`` in ``tiers/disk_io.py``).
    Other kernels split element-wise loops anywhere, and a scalar tail may round differently from the vector
    body."""
    return type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) and all(
        g.get("fused") for g in optimizer.param_groups
    )


def kernel_flags(optimizer: torch.optim.Optimizer, kernel: str) -> list[dict[str, Any]]:
    """The flags each param group steps with under ``optimizer_kernel=kernel``."""
    out: list[dict[str, Any]] = []
    for g in optimizer.param_groups:
        has_fused = "fused" in g
        flags: dict[str, Any] = {}
        if kernel == "auto":
            unset = g.get("fused") is None and g.get("foreach") is None and not g.get("differentiable")
            if has_fused and unset and _fused_rounds_as_well(optimizer, g):
                flags["fused"] = True
        elif kernel in ("fused", "one_pass"):  # one_pass: torch's fused kernel wherever the one pass does not run
            if not has_fused:
                raise UnsupportedOptimizerError(
                    f"optimizer_kernel={kernel!r} but {type(optimizer).__name__} has no fused kernel; "
                    "use optimizer_kernel='auto' or 'foreach'."
                )
            flags.update(fused=True, foreach=False)
        elif kernel == "foreach":
            flags["foreach"] = True
            if has_fused:
                flags["fused"] = False
        else:  # loop
            flags["foreach"] = False
            if has_fused:
                flags["fused"] = False
        out.append(flags)
    return out


def _fused_rounds_as_well(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether torch's fused kernel is no less exact than its loop for ``group``: Adam(W) always; the others (SGD,
    Adagrad) on fp32 parameters ([Note: the kernel and the user's param groups])."""
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        return True
    return all(p.dtype == torch.float32 for p in group["params"])


@contextlib.contextmanager
def flags_set(optimizer: torch.optim.Optimizer, flags: list[dict[str, Any]]) -> Iterator[None]:
    """The groups carry ``flags`` inside this block, the user's own outside it.

    [Note: the kernel and the user's param groups]
    ``optimizer_kernel="auto"`` steps Adam(W) with torch's fused kernel where the user chose none (torch's own
    default on CPU tensors is the single-tensor loop, which rounds otherwise in the last bit), and the other
    optimizers that have one (SGD, Adagrad) on fp32 groups only, where it gives the loop's bits (SGD) or differs in
    the last one (Adagrad). On bf16 masters (``bf16-true``) torch's fused CPU SGD with momentum and weight decay
    strays from fp32 seven times as far as its loop (3.8% against 0.54% relative after 9 steps), so such a group
    steps with the loop, as plain Lightning does. The flags that select it are set for the step alone:
    ``optimizer.param_groups``, ``optimizer.state_dict()`` and every checkpoint keep what the user built the
    optimizer with, so a checkpoint resumed under another strategy steps with that strategy's default, and a user
    who reads the groups sees their own settings."""
    groups = optimizer.param_groups
    saved = [{k: g[k] for k in f if k in g} for g, f in zip(groups, flags, strict=True)]
    for g, f in zip(groups, flags, strict=True):
        g.update(f)
    try:
        yield
    finally:
        for g, f, old in zip(groups, flags, saved, strict=True):
            for k in f:
                if k in old:
                    g[k] = old[k]
                else:
                    g.pop(k, None)
