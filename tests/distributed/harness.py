"""What every multi-rank case runs with: the trainer, a record of the device bytes at every moment, a fit that
can stop at a step and resume from its checkpoint. Imported by ``runner.py`` (the script each rank runs) and the
case modules; importing it patches ``MomentClock.tick`` to record the device bytes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L

from lightning_chunk import ChunkOffloadStrategy
from lightning_chunk.engine.chunks.chunk import Tier
from lightning_chunk.engine.runtime.moments import MomentClock
from lightning_chunk.options import grouped
from tests.models import quiet_trainer, token_data

WORLD = int(os.environ.get("WORLD_SIZE", 2))  # read once: Lightning's teardown deletes the variable
PER_NODE = int(os.environ.get("LOCAL_WORLD_SIZE", WORLD))  # ranks a node: several nodes where fewer than WORLD
# the device bytes at every moment of a case's fit, which ranks plan evictions from: the same on every rank
# ([Note: the same bytes on every rank after a step])
DEVICE_BYTES: list[int] = []
_tick = MomentClock.tick


def _ticked(self: MomentClock, kind: Any, key: str) -> tuple[int, ...]:
    out = _tick(self, kind, key)
    DEVICE_BYTES.append(self.manager.ledger[Tier.DEVICE])
    return out


MomentClock.tick = _ticked  # type: ignore[method-assign]
STEPS = 16  # a case's own "steps" shortens it: the wide models' cases run 8 (warm-up, repack, six steady steps)


def trainer(strategy, steps=STEPS, **kw):
    defaults = dict(devices=PER_NODE, num_nodes=WORLD // PER_NODE, strategy=strategy, max_steps=steps)
    defaults.update(limit_val_batches=0, num_sanity_val_steps=0)
    return quiet_trainer(**{**defaults, **kw})


def chunk_strategy(**flat: Any) -> ChunkOffloadStrategy:
    """chunk_offload with its options given flat, with the cases' defaults: the loop kernel of the host Adam (the
    one bit-exact with torch's Adam) and collectives that time out in 60 s."""
    return ChunkOffloadStrategy(**grouped({"optimizer_kernel": "loop", "collective_timeout_s": 60, **flat}))


class CommMode(L.Callback):
    """How the engine's collectives ran: one communicator or a group per kind, the agreement check on or off."""

    seen: dict = {}

    def on_train_start(self, trainer, pl_module):
        comm = trainer.strategy.engine.comm
        self.seen = dict(
            as_nccl=comm.as_nccl, groups_per_kind=bool(comm._op_groups), checked=comm.agreement is not None
        )


def fit_or_resume(make: Any, steps: int, resume_at: int | None, ckdir: Path, callbacks=(), **kw: Any):
    """``make()`` gives a fresh (model, strategy, plugins). One fit to ``steps``; with ``resume_at``, a fit to that
    step that saves a checkpoint, then a fresh model resumed from it to ``steps`` (the one returned, with its
    trainer and strategy; the device bytes recorded are the resumed fit's)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    model, strategy, plugins = make()
    if resume_at:
        save = ModelCheckpoint(dirpath=ckdir, every_n_train_steps=resume_at, filename="{step}", save_top_k=-1)
        trainer(strategy, resume_at, plugins=plugins, callbacks=[save], enable_checkpointing=True, **kw).fit(
            model, token_data()
        )
        DEVICE_BYTES.clear()
        model, strategy, plugins = make()
    t = trainer(strategy, steps, plugins=plugins, callbacks=list(callbacks), **kw)
    t.fit(model, token_data(), ckpt_path=ckdir / f"step={resume_at}.ckpt" if resume_at else None)
    return t, model, strategy
