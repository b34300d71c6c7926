"""Whole values out of the shards for the user's code between steps: the parameters (and their gradients) and their
gradient norms. ``ChunkOffloadStrategy`` inherits these methods."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable

import torch
from torch import Tensor

from .checkpointing import ChunkCheckpoints
from .engine.memory.full_params import full_parameters
from .grad_norms import sharded_grad_norm


class WholeValues(ChunkCheckpoints):
    """``full_parameters`` and ``grad_norm``: each gathers only what it is asked for."""

    @contextlib.contextmanager
    def full_parameters(
        self,
        module: torch.nn.Module | Tensor | Iterable[Tensor] | None = None,
        *,
        writeback: bool = True,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Generator[None, None, None]:
        """The parameters of ``module`` (the whole LightningModule by default, or parameters given as one or a list
        as DeepSpeed's ``GatheredParameters`` takes them: a scale to clamp) hold their whole trained values inside
        the block; with ``writeback``, what you write into them goes back into the sharded weights (elements you
        leave as they were keep their master precision). FSDP's ``summon_full_params``.

        With several ranks every rank must enter, with the same ``module``. No forward may run inside, and it
        cannot be entered between a forward and its backward. Every rank holds the parameters' whole values for
        the block's duration (on the host with ``offload_to_cpu``): ask for a submodule when the model is large.
        Outside a step, without this block, a parameter shows a stale copy or a placeholder that refuses reads and
        writes ([Note: parameters outside a step] in ``engine/memory/full_params.py``). Before ``fit`` and after it the
        parameters are plain and the block does nothing.

        ``with_grads=True`` (between a backward and the optimizer step, e.g. in ``on_before_optimizer_step``) also
        gives each parameter that got a gradient its whole ``.grad``, the one the optimizer will read: Lightning's
        ``grad_norm(self)`` works inside. Gradients changed inside are written back, one set to ``None`` is
        skipped by the step ([Note: gradients in full_parameters] in ``engine/memory/full_params.py``)."""
        if self.engine is None:
            yield
            return
        with full_parameters(
            self.engine, module, writeback=writeback, offload_to_cpu=offload_to_cpu, with_grads=with_grads
        ):
            yield

    def grad_norm(
        self, norm_type: float | str = 2.0, group_separator: str = "/", module: torch.nn.Module | None = None
    ) -> dict[str, Tensor]:
        """Lightning's ``grad_norm(self, norm_type)`` (of ``module``, the LightningModule by default), from the
        gradient shards without gathering them: ``self.log_dict(self.trainer.strategy.grad_norm(2))`` in
        ``on_before_optimizer_step``. Every rank calls it (one all-reduce on several); bit-exact on one rank."""
        target = module if module is not None else self.lightning_module
        assert target is not None
        return sharded_grad_norm(self.engine, target, norm_type, group_separator)
