"""Whole values out of the shards for the user's code between steps: the parameters (and their gradients), their
gradient norms, and the optimizer's state of them. ``ChunkOffloadStrategy`` inherits these methods."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterable
from typing import Any

import torch
from lightning.pytorch.core.optimizer import _MockOptimizer
from torch import Tensor
from torch.optim import Optimizer

from .checkpointing import ChunkCheckpoints
from .engine.memory.full_params import full_parameters
from .engine.optim.full_state import full_optimizer_state
from .engine.optim.kept_state import StateKeptInPieces
from .engine.optim.state_norms import state_norms
from .grad_norms import sharded_grad_norm


class WholeValues(ChunkCheckpoints):
    """``full_parameters``, ``grad_norm``, ``full_optimizer_state`` and ``optimizer_state_norms``: each gathers only
    what it is asked for, the norms nothing."""

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

    @contextlib.contextmanager
    def full_optimizer_state(
        self,
        module: torch.nn.Module | Tensor | Iterable[Tensor] | None = None,
        *,
        optimizer: int | Optimizer = 0,
        writeback: bool = True,
    ) -> Generator[dict[Tensor, dict[str, Any]], None, None]:
        """The whole state ``optimizer`` (its index in ``configure_optimizers``' order, or itself) keeps for the
        parameters of ``module`` (the whole LightningModule by default, or parameters given as one or a list),
        as ``{parameter: state}``: what plain torch holds in ``optimizer.state[parameter]``, the same keys, Adam's
        moments in the parameter's shape on the host, ``{}`` before its first step. With ``writeback``, values you
        change in place or assign to a key go back into the shards: ``state[p]["exp_avg"].zero_()`` for a layer
        you re-initialised. DeepSpeed's ``safe_get_full_optimizer_state`` and ``safe_set_full_optimizer_state``.

        With several ranks every rank must enter, with the same ``module``; every rank then holds the whole state
        of those parameters for the block's duration. Not inside a backward. Before ``fit`` there is no state;
        after it, the optimizer's own (``materialize_optimizer_state=True`` on several ranks: [Note: optimizer
        state after fit] in ``engine/optim/kept_state.py``); [Note: the whole optimizer state of a parameter] in
        ``engine/optim/full_state.py``."""
        opt = self._optimizer_for(optimizer)
        binding = self._binding_of(opt)
        if self.engine is None or binding is None:  # outside fit (validate, test, predict after it): its own state
            params = list(self._own_params(module, opt))
            state = opt.state
            yield {p: state[p] if p in state or isinstance(state, StateKeptInPieces) else {} for p in params}
            return
        with full_optimizer_state(self.engine, binding, module, writeback=writeback) as got:
            yield got

    def optimizer_state_norms(
        self,
        norm_type: float | str = 2.0,
        group_separator: str = "/",
        module: torch.nn.Module | None = None,
        *,
        optimizer: int | Optimizer = 0,
    ) -> dict[str, Tensor]:
        """The ``norm_type``-norm of each per-element state (Adam's ``exp_avg`` and ``exp_avg_sq``) of each parameter
        of ``module`` (the LightningModule by default), from the pieces without gathering them, named as Lightning's
        ``grad_norm`` names gradient norms: ``exp_avg_sq_2.0_norm/head.weight``, and ``exp_avg_sq_2.0_norm_total``
        over the parameters. ``self.log_dict(self.trainer.strategy.optimizer_state_norms())`` in
        ``on_train_batch_end``. Every rank calls it (one all-reduce on several); bit-exact on one rank ([Note:
        optimizer state norms from the pieces] in ``engine/optim/state_norms.py``)."""
        p = float(norm_type)
        if not p > 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type!r}")
        opt = self._optimizer_for(optimizer)
        target = module if module is not None else self.lightning_module
        assert target is not None
        binding = self._binding_of(opt)
        if self.engine is None or binding is None:  # outside fit: the optimizer's own state, keyed by parameters
            stepped = {id(q) for g in opt.param_groups for q in g["params"]}
            state = opt.state
            norms = {
                name: {k: v.norm(p) for k, v in state[q].items() if torch.is_tensor(v) and v.shape == q.shape}
                for name, q in target.named_parameters()
                if id(q) in stepped and (q in state or isinstance(state, StateKeptInPieces))
            }
        else:
            by_index, index_of = state_norms(self.engine, binding, p), self.engine.manager.index_of
            norms = {
                name: by_index[index_of[id(q)]]
                for name, q in target.named_parameters()
                if index_of.get(id(q)) in by_index
            }
        out: dict[str, Tensor] = {}
        for key in sorted({k for st in norms.values() for k in st}):
            each = {f"{key}_{p}_norm{group_separator}{name}": st[key] for name, st in norms.items() if key in st}
            out.update(each)
            out[f"{key}_{p}_norm_total"] = torch.stack([v.float().cpu() for v in each.values()]).norm(p)
        return out

    def _optimizer_for(self, optimizer: int | Optimizer) -> Optimizer:
        """The torch optimizer ``optimizer`` names: an index, it, or Lightning's wrapper of it."""
        opts = [o for o in self.optimizers if not isinstance(o, _MockOptimizer)]
        if not opts:
            raise ValueError(
                "full_optimizer_state(): this Trainer has no optimizer yet; the state exists from the first step of "
                "fit (configure_optimizers runs at its set-up)."
            )
        if isinstance(optimizer, int) and not isinstance(optimizer, bool):
            if not 0 <= optimizer < len(opts):
                raise ValueError(
                    f"full_optimizer_state(optimizer={optimizer}): configure_optimizers returned {len(opts)} "
                    f"optimizer(s); pass an index from 0 to {len(opts) - 1}, or the optimizer itself."
                )
            return opts[optimizer]
        inner = getattr(optimizer, "_optimizer", optimizer)  # LightningModule.optimizers() gives Lightning's wrapper
        for o in opts:
            if o is inner:
                return o
        raise ValueError(
            f"full_optimizer_state(optimizer={type(optimizer).__name__}): not one of the {len(opts)} optimizer(s) "
            "configure_optimizers returned; pass one of those, or its index."
        )

    def _own_params(self, module: torch.nn.Module | Tensor | Iterable[Tensor] | None, opt: Optimizer) -> Any:
        """The parameters ``module`` names that ``opt`` steps, in the module's order, as the engine gives them."""
        wanted = module if module is not None else self.lightning_module
        if isinstance(wanted, torch.nn.Module):
            wanted = wanted.parameters()
        elif isinstance(wanted, Tensor):
            wanted = [wanted]
        stepped = {id(p) for g in opt.param_groups for p in g["params"]}
        return (p for p in wanted if id(p) in stepped)  # type: ignore[union-attr]
