"""Whether a fit steps each chunk during backward: the checks of ``step_in_backward=True`` and the choice ``None``
makes.

[Note: stepping in backward by default]
``step_in_backward=True`` is bit-identical to stepping after backward and costs less: each chunk gives its gradient
shard back once it stepped, and on a GPU the host Adam runs beside backward on a worker thread ([Note: the host Adam
beside backward] in ``engine/optim/step_thread.py``). With the disk tier it is also the faster step by far: a disk chunk
steps from the gradients backward left in memory, so no gradient file is written or read and its master and optimizer
state are read while backward computes ([Note: stepping disk chunks in backward]); on ``benchmarks/disk.py``'s GPT in a
1 GiB cgroup it took 1.51 s a step against 1.94 s (medians of ten paired rounds), with 60 MiB less peak memory. What it
changes is plain PyTorch's gradient semantics: after ``backward()`` the gradients of the chunks that stepped are gone
([Note: stepping in backward] in ``engine/optim/early_step.py``). So ``step_in_backward=None`` (the default) turns it on
where nothing that Lightning lets read the gradients between backward and the optimizer step is in the fit: no clipping
by norm and no fp16 loss scaling (with them ``True`` steps on a guess and keeps a copy of the state until the step, more
memory than stepping after backward: the user's choice, [Note: speculating past the norm and the overflow]), one
optimizer, automatic optimization, and no override of the hooks that run in that window (``on_after_backward``,
``on_before_optimizer_step``, ``configure_gradient_clipping``, ``optimizer_step``) on the module or on a callback other
than this package's; no ``optimizer_zero_grad`` of the module's own, since ``zero_grad(set_to_none=False)`` keeps a zero
gradient, which steps a parameter that gets none in the next backward (Adam's moments and weight decay move it), where a
chunk that stepped in backward has no gradient left to keep; and no step hooks on the optimizer, which ``step()`` runs
around each call, once a chunk when stepping in backward. Clipping by value is applied chunk by chunk. Where one of them
is there, the fit steps after backward and rank 0 says which one held it back. A read of the gradients the checks cannot
see (``full_parameters(with_grads=True)`` after the step, or from another hook) gets the engine's error, which names the
flag."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .engine import ChunkEngine
from .engine.config import ChunkConfig
from .engine.optim.binding import ENGINE_HOOK
from .engine.optim.speculation import refusal
from .engine.optim.whole import needs_whole

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.optim import Optimizer

# the hooks that run between backward and the optimizer step, where a user can read or change the gradients
MODULE_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")
CALLBACK_HOOKS = ("on_after_backward", "on_before_optimizer_step")


def _speculates(trainer: pl.Trainer, precision: str) -> str | None:
    """What in this fit makes chunks stepped in backward step on a guess ([Note: speculating past the norm and the
    overflow] in ``engine/optim/speculation.py``), or ``None``."""
    if precision == "16-mixed":
        return "fp16 loss scaling (precision='16-mixed')"
    if clips_by_norm(trainer):
        return f"gradient clipping by norm (gradient_clip_val={trainer.gradient_clip_val!r})"
    return None


def clips_by_norm(trainer: pl.Trainer) -> bool:
    """Lightning clips by the global norm in this fit (it clips nothing at 0)."""
    return bool(trainer.gradient_clip_val) and clip_value(trainer) is None


def _refused(
    trainer: pl.Trainer, module: pl.LightningModule, precision: str, host_memory_limit: int | None
) -> tuple[str, str] | None:
    """What ``step_in_backward=True`` refuses in this fit, as ``(what it is, the error that refuses it)``."""
    guess = _speculates(trainer, precision)
    if guess is not None and host_memory_limit is not None:
        return guess, refusal(guess, host_memory_limit)
    if not module.automatic_optimization:
        return (
            "manual optimization (automatic_optimization=False)",
            "step_in_backward=True is not allowed with manual optimization (automatic_optimization=False): the "
            "chunks step during backward, before your training_step could read or change the gradients. Use "
            "step_in_backward=False.",
        )
    return None


def clip_value(trainer: pl.Trainer) -> float | None:
    """Lightning's clipping by value, which each chunk applies to its own gradients as it steps ([Note: clipping by
    value in backward] in ``engine/optim/early_step.py``); ``None`` without it."""
    from lightning.pytorch.utilities import GradClipAlgorithmType

    val = trainer.gradient_clip_val
    if val is None or trainer.gradient_clip_algorithm != GradClipAlgorithmType.VALUE or float(val) <= 0:
        return None
    return float(val)


def check_step_in_backward(
    trainer: pl.Trainer, module: pl.LightningModule, precision: str, host_memory_limit: int | None
) -> None:
    """Before anything is built: what ``step_in_backward=True`` cannot do ([Note: stepping in backward])."""
    refused = _refused(trainer, module, precision, host_memory_limit)
    if refused is not None:
        raise ValueError(refused[1])


def reads_gradients(trainer: pl.Trainer, module: pl.LightningModule, precision: str, optimizers: int) -> str | None:
    """What in this fit can read the gradients after backward (so its chunks must step after it), or ``None``."""
    guess = _speculates(trainer, precision)  # stepping in backward would keep a copy of the state: not by default
    if guess is not None:
        return guess
    refused = _refused(trainer, module, precision, None)
    if refused is not None:
        return refused[0]
    if optimizers != 1:
        return f"{optimizers} optimizers (stepping in backward needs exactly one)"
    import lightning.pytorch as pl

    for hook in MODULE_HOOKS:
        if is_overridden(hook, module, pl.LightningModule):
            return f"{type(module).__name__}.{hook}, which runs between backward and the optimizer step"
    if is_overridden("optimizer_zero_grad", module, pl.LightningModule):
        return f"{type(module).__name__}.optimizer_zero_grad, which may keep gradients as zeros (set_to_none=False)"
    for cb in trainer.callbacks:  # type: ignore[attr-defined]
        if type(cb).__module__.split(".")[0] == __name__.split(".")[0]:
            continue  # this package's callbacks read no gradient
        for hook in CALLBACK_HOOKS:
            if is_overridden(hook, cb, Callback):
                return f"the callback {type(cb).__name__}.{hook}, which runs between backward and the optimizer step"
    return None


def choose_step_in_backward(
    trainer: pl.Trainer, module: pl.LightningModule, precision: str, optimizers: int
) -> tuple[bool, str | None]:
    """``step_in_backward=None`` made concrete for one fit ([Note: stepping in backward by default]): ``(True,
    None)`` where nothing reads gradients after backward, else ``(False, why)``."""
    why = reads_gradients(trainer, module, precision, optimizers)
    return why is None, why


def step_hooks(optimizers: Sequence[Optimizer]) -> str | None:
    """The step hooks a user registered on ``optimizers`` or on every optimizer, which ``step()`` runs around each
    call: stepping in backward calls it once a chunk, with the other chunks not stepped yet; ``None`` without.
    torch's own (the profiler's step counter, under ``KINETO_USE_DAEMON``) reads nothing and is left out."""
    from torch.optim import optimizer as torch_optimizer

    every = [
        *torch_optimizer._global_optimizer_pre_hooks.values(),
        *torch_optimizer._global_optimizer_post_hooks.values(),
    ]
    if any(not getattr(h, "__module__", "").startswith("torch.") for h in every):
        return "step hooks registered for every optimizer (register_optimizer_step_pre_hook or _post_hook)"
    for opt in optimizers:
        opt = getattr(opt, "_optimizer", opt)  # a LightningOptimizer wraps it
        hooks = [*getattr(opt, "_optimizer_step_pre_hooks", {}).values()]
        hooks += getattr(opt, "_optimizer_step_post_hooks", {}).values()
        if any(not getattr(h, ENGINE_HOOK, False) for h in hooks):
            return f"step hooks on {type(opt).__name__} (register_step_pre_hook or _post_hook), which run once a step"
    return None


def config_for_fit(
    config: ChunkConfig,
    trainer: pl.Trainer,
    module: pl.LightningModule,
    precision: str,
    optimizers: Sequence[Optimizer],
) -> ChunkConfig:
    """This fit's config: ``step_in_backward=None`` made concrete, said once on rank 0."""
    if config.step_in_backward is not None:
        return config
    if not optimizers:  # configure_optimizers() returned None: nothing steps
        return config.replace(step_in_backward=False)
    chosen, why = choose_step_in_backward(trainer, module, precision, len(optimizers))
    hooked = step_hooks(optimizers) if chosen else None
    if hooked is not None:
        chosen, why = False, hooked
    whole = [w for o in optimizers if (w := needs_whole(getattr(o, "_optimizer", o))) is not None]
    if chosen and whole and trainer.world_size > 1:  # [Note: optimizers that need whole parameters] in whole.py
        chosen, why = False, f"{whole[0]}, stepped whole after backward on several ranks"
    if chosen:
        rank_zero_info(
            "chunk_offload: each chunk steps during backward (step_in_backward=None: nothing in this fit reads "
            "the gradients after backward); step_in_backward=False keeps them."
        )
    else:
        rank_zero_info(
            f"chunk_offload: the chunks step after backward, not during it, because of {why} "
            "(step_in_backward=None; docs/faq.md says what stepping in backward gives)."
        )
    return config.replace(step_in_backward=chosen)


def after_failure(engine: ChunkEngine, alone: bool) -> str | None:
    """What to say of the module's parameters after a fit that failed, where they are not what plain Lightning
    leaves (the values of the last step): on several ranks they stay empty, since a rank may be stuck in a
    collective; on one, a failure inside a step whose chunks had begun stepping in backward leaves that step half
    taken ([Note: a save inside a step] in ``checkpointing.py``)."""
    if not alone:
        return (
            "chunk_offload: the fit failed, and the module's parameters are left empty on this rank: gathering them "
            "would need every rank, one of which may be stuck. The weights are in the checkpoints "
            "(`lightning-chunk consolidate` writes one file)."
        )
    stepped = len(engine.early.stepped) if engine.early is not None else 0
    if not stepped:
        return None
    trainable = sum(c.trainable for c in engine.manager.chunks)
    held = "for those chunks only" if stepped < trainable else "although Lightning did not count it"
    return (
        f"chunk_offload: the fit failed inside a step, after {stepped} of {trainable} trainable chunks had stepped "
        f"in backward: the module's parameters hold that step's update {held}. The checkpoints hold whole steps."
    )
