"""``lightning-chunk plan``'s dry runs: one step of a model built for real, under a strategy's arguments; and, after a
limit was refused, the smallest limit that fits ([Note: the smallest limit plan names] in
``engine/runtime/layout_choice.py``)."""

from __future__ import annotations

from typing import Any

import lightning as L

from .engine.config import format_bytes
from .engine.errors import DeviceMemoryLimitError
from .options import grouped
from .strategy import ChunkOffloadStrategy


def one_step_trainer(strategy: ChunkOffloadStrategy, precision: Any, **kw: Any) -> L.Trainer:
    """One rank on the CPU, one step, nothing logged, saved or shown."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        precision=precision,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


def dry_run(
    model_cls: type,
    model_args: dict[str, Any],
    data_cls: type | None,
    data_args: dict[str, Any],
    strategy_args: dict[str, Any],
    precision: str,
    probe: L.Callback,
) -> None:
    model = model_cls(**model_args)
    datamodule = data_cls(**data_args) if data_cls is not None else None
    strategy = ChunkOffloadStrategy(**grouped({**strategy_args, "log_memory_stats": False}))
    trainer = one_step_trainer(strategy, precision, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(model, datamodule=datamodule)


class _Smallest(L.Callback):
    """A dry run without a limit: the smallest limit its trace allows ([Note: the smallest limit plan names])."""

    parts: tuple[int, int, int] | None = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        self.parts = engine.layouts.smallest_limit(engine.hooks.moments.trace)


def smallest_limit(*args: Any) -> str:
    """What follows a refusal: the smallest limit a dry run without it allows, checked by a dry run at it
    ([Note: the smallest limit plan names] in ``engine/runtime/layout_choice.py``)."""
    model_cls, model_args, data_cls, data_args, strategy_args, precision = args
    traced = _Smallest()
    dry_run(
        model_cls, model_args, data_cls, data_args, {**strategy_args, "device_memory_limit": None}, precision, traced
    )
    assert traced.parts is not None, "the dry run never reached an optimizer step"
    shards, chunks, activations = traced.parts
    limit = shards + chunks + activations
    said = (
        f"A dry run without the limit needs {format_bytes(chunks)} of chunks at once"
        + (f" beside {format_bytes(shards)} of shards the placement keeps on the device" if shards else "")
        + f" and traced {format_bytes(activations)} of activations: it fits under device_memory_limit={limit}"
    )
    try:
        dry_run(
            model_cls,
            model_args,
            data_cls,
            data_args,
            {**strategy_args, "device_memory_limit": limit},
            precision,
            L.Callback(),
        )
    except DeviceMemoryLimitError as again:
        return f"{said}, but a dry run under it was refused too: {again}"
    return said + " (a dry run under it fit)."
