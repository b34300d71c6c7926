"""``ChunkEMA``: Lightning's ``EMAWeightAveraging`` for ``chunk_offload``, with the average sharded like the weights.

Lightning's ``WeightAveraging`` callbacks keep a whole copy of the model on every rank and are refused by the
strategy; this one keeps each rank's share of the average beside its master shards ([Note: a sharded EMA] in
``engine/optim/ema.py``; in files under ``disk_dir`` with ``host_memory_limit``, [Note: the average under a host
limit]) and does what ``EMAWeightAveraging`` does, bit for bit: the average is updated after optimizer
steps (``update_every_n_steps``, ``update_starting_at_step``), the buffers (BatchNorm's running statistics) are
averaged with the weights (``use_buffers=True``, Lightning's default) or copied at each update, validation during
``fit`` runs with the averaged weights and those buffers, and at the end of training they become the model's.
Checkpoints keep it: sharded ones save its shards beside the masters (any world size resumes it); full ones are
laid out as Lightning's (the average as ``state_dict``, the trained weights as ``current_model_state``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch

from .engine.optim.ema import BufferAverage, ShardedEMA


class ChunkEMA(pl.Callback):
    """An exponential moving average of the weights: ``ema = decay * ema + (1 - decay) * weights``.

    Args:
        decay: in [0, 1].
        use_buffers: average the module's buffers with the weights (as ``EMAWeightAveraging``, whose default this
            is); ``False`` keeps a copy of them made at each update, as ``AveragedModel`` does then.
        update_every_n_steps: update after every n-th optimizer step (counted from 0, as Lightning's callback).
        update_starting_at_step: the first optimizer step (0-based) that updates; the first update copies.
        validate_with_average: validation inside ``fit`` sees the averaged weights (Lightning's callback always does).
        average_at_end: at the end of training the averaged weights replace the trained ones.
    """

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        validate_with_average: bool = True,
        average_at_end: bool = True,
        use_buffers: bool = True,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"ChunkEMA(decay={decay!r}): the decay must be in [0, 1].")
        if update_every_n_steps < 1:
            raise ValueError(f"ChunkEMA(update_every_n_steps={update_every_n_steps!r}): must be 1 or more.")
        if not isinstance(use_buffers, bool):
            raise ValueError(f"ChunkEMA(use_buffers={use_buffers!r}): must be True or False.")
        self.decay = decay
        self.use_buffers = use_buffers
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.validate_with_average = validate_with_average
        self.average_at_end = average_at_end
        self._latest_update_step = 0
        self._n_averaged = 0  # updates so far (AveragedModel's n_averaged, for full checkpoints in its layout)
        self._swapped = False

    def average(self, engine: Any, module: torch.nn.Module) -> ShardedEMA:
        """The engine's average for this callback ([Note: a sharded EMA]); in files under the engine's host limit,
        the one every rank agreed on ([Note: the average under a host limit], [Note: one limit for every rank])."""
        in_files = engine.config.host_memory_limit is not None
        return ShardedEMA(engine.manager, BufferAverage(module, average=self.use_buffers), in_files=in_files)

    def should_update(self, step_idx: int) -> bool:
        return (
            self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
        ) and step_idx % self.update_every_n_steps == 0

    @staticmethod
    def _ema(trainer: pl.Trainer) -> Any:
        engine = getattr(trainer.strategy, "engine", None)
        return getattr(engine, "ema", None)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if getattr(trainer.strategy, "strategy_name", None) != "chunk_offload":  # ChunkOffloadStrategy (no import:
            # the strategy imports this module)
            raise ValueError(
                f"ChunkEMA works with the chunk_offload strategy; this Trainer uses "
                f"{type(trainer.strategy).__name__}. Use Lightning's EMAWeightAveraging there."
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_idx = trainer.global_step - 1
        if trainer.global_step > self._latest_update_step and self.should_update(step_idx):
            self._ema(trainer).update(self.decay)
            self._latest_update_step = trainer.global_step
            self._n_averaged += 1

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ema = self._ema(trainer)
        if self.validate_with_average and trainer.state.fn == "fit" and ema is not None and ema.started:
            ema.swap()
            self._swapped = True

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._swapped:
            self._ema(trainer).swap()
            self._swapped = False

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ema = self._ema(trainer)
        if self.average_at_end and ema is not None and ema.started:
            ema.copy_to_masters()

    def state_dict(self) -> dict[str, Any]:
        return {"latest_update_step": self._latest_update_step, "n_averaged": self._n_averaged}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]
        self._n_averaged = state_dict.get("n_averaged", self._n_averaged)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Sharded checkpoints carry the shards themselves. A full one is laid out as Lightning's ``WeightAveraging``
        lays out its own (every rank gathers): the average as ``state_dict`` (what ``load_from_checkpoint`` and
        ``validate(ckpt_path=...)`` read), the trained weights as ``current_model_state``, so plain Lightning with
        ``EMAWeightAveraging`` resumes from it and the reverse."""
        ema = self._ema(trainer)
        if ema is None or not ema.started or getattr(trainer.strategy, "state_dict_type", "sharded") == "sharded":
            return
        mgr = ema.manager
        average = ema.whole()
        current = checkpoint["state_dict"]
        owner = {
            k: mgr.index_of[id(v)] for k, v in pl_module.state_dict(keep_vars=True).items() if id(v) in mgr.index_of
        }
        buffers = ema.buffers.saved(current) if ema.buffers is not None else {}  # [Note: averaged buffers]
        checkpoint["current_model_state"] = current
        checkpoint["state_dict"] = {k: average.get(owner.get(k, -1), buffers.get(k, v)) for k, v in current.items()}
        checkpoint["averaging_state"] = {"n_averaged": torch.tensor(self._n_averaged, dtype=torch.long)}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A full checkpoint in Lightning's layout: the strategy loaded its ``state_dict`` (the average) into the
        model; the average goes into the shards and the trained weights back into the model."""
        ema = self._ema(trainer)
        if ema is None or "current_model_state" not in checkpoint:
            return
        mgr = ema.manager
        owner = {
            k: mgr.index_of[id(v)] for k, v in pl_module.state_dict(keep_vars=True).items() if id(v) in mgr.index_of
        }
        trainable = {t.slot.param_index for c in mgr.chunks if c.trainable for t in c.tensors}
        ema.load(
            {
                i: checkpoint["state_dict"][k]
                for k, i in owner.items()
                if i in trainable and k in checkpoint["state_dict"]
            }
        )
        ema.after_load()
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        engine.load_full_state_dict(dict(checkpoint["current_model_state"]), strict=False)
        if ema.buffers is not None:  # the module's buffers are the trained ones now; the average keeps its own
            names = {n for n, _ in pl_module.named_buffers()}
            ema.buffers.load({k: v for k, v in checkpoint["state_dict"].items() if k in names})
        self._n_averaged = int(checkpoint.get("averaging_state", {}).get("n_averaged", self._n_averaged))
