"""``lightning-chunk plan``'s dry runs: one step of a model built for real, under a strategy's arguments; and, after a
limit was refused, the smallest limit that fits ([Note: the smallest limit plan names] in
``engine/runtime/layout_choice.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning as L

from .engine.config import format_bytes
from .engine.errors import DeviceMemoryLimitError
from .options import grouped
from .plan_inputs import chunk_precision
from .precision import ChunkPrecision
from .strategy import ChunkOffloadStrategy


def one_step_trainer(strategy: ChunkOffloadStrategy, precision: ChunkPrecision, **kw: Any) -> L.Trainer:
    """One rank on the CPU, one step, nothing logged, saved or shown. ``precision`` is a plugin: a Trainer on the CPU
    given ``precision="16-mixed"`` runs bf16-mixed, and the plan is for the GPU's."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        plugins=[precision],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


@dataclass(frozen=True)
class DryRun:
    """One throwaway step of ``model_cls(**model_args)`` on ``data_cls(**data_args)``'s first batch, under
    ``ChunkOffloadStrategy(**strategy_args)``: what ``plan`` measures a model by."""

    model_cls: type
    model_args: dict[str, Any]
    data_cls: type | None
    data_args: dict[str, Any]
    strategy_args: dict[str, Any]
    precision: str
    plugin_args: dict[str, Any] | None = None  # a config's ChunkPrecision's (``chunk_precision_args``): made anew a run

    def run(self, probe: L.Callback, **strategy_args: Any) -> None:
        """The step, ``probe`` among its callbacks; ``strategy_args`` over this run's own."""
        model = self.model_cls(**self.model_args)
        datamodule = self.data_cls(**self.data_args) if self.data_cls is not None else None
        args = {**self.strategy_args, **strategy_args, "log_memory_stats": False}
        trainer = one_step_trainer(
            ChunkOffloadStrategy(**grouped(args)),
            chunk_precision(self.precision, self.plugin_args or {}),  # 16-mixed too, which a CPU Trainer makes bf16
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[probe],
        )
        trainer.fit(model, datamodule=datamodule)

    def smallest_limit(self) -> str:
        """What follows a refusal: the smallest limit a dry run without it allows, checked by a dry run under it
        ([Note: the smallest limit plan names] in ``engine/runtime/layout_choice.py``)."""
        traced = _Smallest()
        self.run(traced, device_memory_limit=None)
        assert traced.parts is not None, "the dry run never reached an optimizer step"
        shards, chunks, activations = traced.parts
        limit = shards + chunks + activations
        said = (
            f"A dry run without the limit needs {format_bytes(chunks)} of chunks at once"
            + (f" beside {format_bytes(shards)} of shards the placement keeps on the device" if shards else "")
            + f" and traced {format_bytes(activations)} of activations: it fits under device_memory_limit={limit}"
        )
        try:
            self.run(L.Callback(), device_memory_limit=limit)
        except DeviceMemoryLimitError as again:
            return f"{said}, but a dry run under it was refused too: {again}"
        return said + " (a dry run under it fit)."


class _Smallest(L.Callback):
    """A dry run without a limit: the smallest limit its trace allows ([Note: the smallest limit plan names])."""

    parts: tuple[int, int, int] | None = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        self.parts = engine.layouts.smallest_limit(engine.hooks.moments.trace)
