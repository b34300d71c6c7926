"""``ChunkEMA``: Lightning's ``EMAWeightAveraging`` for ``chunk_offload``, with the average sharded like the weights.

Lightning's ``WeightAveraging`` callbacks keep a whole copy of the model on every rank and are refused by the
strategy; this one keeps each rank's share of the average beside its master shards ([Note: a sharded EMA] in
``engine/ema.py``) and does what ``EMAWeightAveraging(use_buffers=False)`` does, bit for bit: the average is
updated after optimizer steps (``update_every_n_steps``, ``update_starting_at_step``), validation during ``fit``
runs with the averaged weights, and at the end of training the averaged weights become the model's. Checkpoints
keep it: sharded ones save its shards beside the masters (any world size resumes it), full ones a whole copy under
``"chunk_ema"``.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning.pytorch as pl


class ChunkEMA(pl.Callback):
    """An exponential moving average of the weights: ``ema = decay * ema + (1 - decay) * weights``.

    Args:
        decay: in [0, 1].
        update_every_n_steps: update after every n-th optimizer step (counted from 0, as Lightning's callback).
        update_starting_at_step: the first optimizer step (0-based) that updates; the first update copies.
        validate_with_average: validation inside ``fit`` sees the averaged weights (Lightning's callback always does).
        average_at_end: at the end of training the averaged weights replace the trained ones.
    """

    def __init__(self, decay: float = 0.999, update_every_n_steps: int = 1,
                 update_starting_at_step: Optional[int] = None, validate_with_average: bool = True,
                 average_at_end: bool = True) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ChunkEMA(decay={decay!r}): the decay must be in [0, 1].")
        if update_every_n_steps < 1:
            raise ValueError(f"ChunkEMA(update_every_n_steps={update_every_n_steps!r}): must be 1 or more.")
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.validate_with_average = validate_with_average
        self.average_at_end = average_at_end
        self._latest_update_step = 0
        self._swapped = False

    def should_update(self, step_idx: int) -> bool:
        return ((self.update_starting_at_step is None or step_idx >= self.update_starting_at_step)
                and step_idx % self.update_every_n_steps == 0)

    @staticmethod
    def _ema(trainer: "pl.Trainer") -> Any:
        engine = getattr(trainer.strategy, "engine", None)
        return getattr(engine, "ema", None)

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if getattr(trainer.strategy, "strategy_name", None) != "chunk_offload":  # ChunkOffloadStrategy (no import:
            # the strategy imports this module)
            raise ValueError(f"ChunkEMA works with the chunk_offload strategy; this Trainer uses "
                             f"{type(trainer.strategy).__name__}. Use Lightning's EMAWeightAveraging there.")

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step_idx = trainer.global_step - 1
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx):
            self._ema(trainer).update(self.decay)
            self._latest_update_step = trainer.global_step

    def on_validation_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        ema = self._ema(trainer)
        if self.validate_with_average and trainer.state.fn == "fit" and ema is not None and ema.started:
            ema.swap()
            self._swapped = True

    def on_validation_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self._swapped:
            self._ema(trainer).swap()
            self._swapped = False

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        ema = self._ema(trainer)
        if self.average_at_end and ema is not None and ema.started:
            ema.copy_to_masters()

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]

    def on_save_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        """Sharded checkpoints carry the shards themselves; a full one gets the whole average (every rank gathers)."""
        ema = self._ema(trainer)
        if ema is None or not ema.started or getattr(trainer.strategy, "state_dict_type", "sharded") == "sharded":
            return
        names = ema.manager.names
        checkpoint["chunk_ema"] = {names[i]: v for i, v in ema.whole().items()}

    def on_load_checkpoint(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           checkpoint: dict[str, Any]) -> None:
        ema = self._ema(trainer)
        if ema is not None and "chunk_ema" in checkpoint:
            index = {n: i for i, n in enumerate(ema.manager.names)}
            ema.load({index[n]: v for n, v in checkpoint["chunk_ema"].items() if n in index})
