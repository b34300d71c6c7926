"""One rank of a Lightning run through every phase of [Note: host memory by phase] in lightning_chunk/phases.py,
its CPU allocations recorded by torch's profiler: set-up, the warm-up step, its repack, training steps, a save, the
end of fit, then a second fit that resumes from the save. Writes each phase's peak bytes this rank held at once, and
the activation peak the warm-up traced.

    RANK=.. WORLD_SIZE=.. python tests/scale/phases_worker.py OUTDIR [PRECISION [ema] [background]]

``ema``: with a ChunkEMA (decay 0.9), whose average is saved and resumed with the rest. ``background``: the save is
written in the background (``AsyncCheckpointIO``), its writer held until the step after it has copied aside every
item it changes (the most a background save holds); the "save" phase is that step. The writer frees those copies
on its own thread, where the profiler sees no frees: the run stops after the first fit.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from lightning_chunk import ChunkEMA, ChunkOffloadStrategy  # noqa: E402
from lightning_chunk.engine.chunks.chunk import Tier  # noqa: E402
from lightning_chunk.engine.runtime.moments import MomentClock  # noqa: E402
from lightning_chunk.engine.runtime.warmup import Replan, WarmUpPlanner  # noqa: E402
from lightning_chunk.engine.state.background_save import BackgroundSave  # noqa: E402
from lightning_chunk.engine.tiers.pool import BlockPool  # noqa: E402
from lightning_chunk.options import grouped  # noqa: E402
from lightning_chunk.shapes import Llama  # noqa: E402
from tests.models import quiet_trainer  # noqa: E402

SHAPE = dict(hidden=128, layers=8, intermediate=256, heads=4, kv_heads=4, vocab=512)
# stepping in backward (the default here, said outright so that the plan, which cannot know whether a fit clips by
# norm, counts the gradient shards given back between steps)
STRATEGY: dict[str, Any] = dict(
    device_memory_limit=10 << 20,
    chunk_numel=1 << 16,
    log_memory_stats=False,
    materialize_on_teardown=None,
    step_in_backward=True,
)
STEPS, SAVE_AT = 4, 3


def mark(name: str) -> None:
    """An instant in the profile: the phases are the spans between marks."""
    with record_function(f"mark:{name}"):
        pass


DEVICE_BYTES: list[int] = []  # at every moment: what ranks plan their evictions from, the same on every rank
HELD: list[BackgroundSave] = []  # background saves whose writer waits for the step after the save
START = BackgroundSave.start


def instrument() -> None:
    """Mark the repack; return payload memory to the allocator, as on a GPU ([Note: a pool of payload blocks] keeps
    it on a CPU device); record the device bytes at each moment ([Note: the same bytes on every rank after a step])."""
    replan, pool_init, tick = WarmUpPlanner.replan, BlockPool.__init__, MomentClock.tick

    def ticked(self: MomentClock, kind: Any, key: str) -> tuple[int, ...]:
        out = tick(self, kind, key)
        DEVICE_BYTES.append(self.manager.ledger[Tier.DEVICE])
        return out

    MomentClock.tick = ticked  # type: ignore[method-assign]

    def marked(self: WarmUpPlanner, reason: Replan) -> None:
        if reason is not Replan.WARM_UP:
            return replan(self, reason)
        mark("warm-up repack")
        replan(self, reason)
        mark("training step")  # the rest of the step runs in the new layout, as every later step

    WarmUpPlanner.replan = marked  # type: ignore[method-assign]

    def pool(
        self: BlockPool, device: Any, enabled: bool = True, per_size: int | None = None, lazy: bool = False
    ) -> None:
        # the payloads' pool off, as on a GPU; the host gradient shards' on, as on a GPU ([Note: gradient shards
        # pinned to the byte])
        pool_init(self, device, enabled=per_size is not None, per_size=per_size, lazy=lazy)

    BlockPool.__init__ = pool  # type: ignore[method-assign]


class Phases(L.Callback):
    def __init__(self, out: Path, first: bool) -> None:
        self.out, self.first = out, first
        self.activations = 0
        self.beside = False  # the next step runs beside a background save: it is the save's phase

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, i: int) -> None:
        if self.beside:
            self.beside = False
            return
        # by the step, not the batch: an epoch here is a few batches a rank
        mark(("training step" if trainer.global_step else "warm-up step") if self.first else "resumed step")

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        mark("between steps")
        for save in HELD:  # the step beside the save has copied aside what it changed
            START(save)
        HELD.clear()
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        if self.first and engine.hooks.moments.trace is not None:  # the activations the warm-up traced, for the plan
            self.activations = engine.hooks.moments.trace.nonmodel_peak_bytes
        if self.first and trainer.global_step == SAVE_AT:
            mark("save")
            trainer.save_checkpoint(self.out / "ckpt")
            self.beside = bool(HELD)
            if not self.beside:
                mark("between steps")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        mark("end of fit")


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    return torch.utils.data.DataLoader(torch.randint(0, SHAPE["vocab"], (STEPS + 2, 9), generator=g), batch_size=1)


def fit(out: Path, first: bool, world: int, precision: str = "32-true", ema: bool = False, bg: bool = False) -> int:
    gc.collect()
    mark("set-up" if first else "resume")
    phases = Phases(out, first)
    trainer = quiet_trainer(
        devices=world,
        precision=precision,
        strategy=ChunkOffloadStrategy(**grouped(STRATEGY)),
        max_steps=STEPS if first else STEPS + 2,
        callbacks=[phases, *([ChunkEMA(decay=0.9)] if ema else [])],
        plugins=[AsyncCheckpointIO()] if bg else None,
    )
    trainer.fit(Llama(SHAPE), train_dataloaders=data(), ckpt_path=None if first else str(out / "ckpt"))
    mark("done")
    return phases.activations


def peaks(prof: Any) -> dict[str, int]:
    """Each phase's peak live bytes, from the signed allocation events in time order (everything the profile saw
    begin: the model is built inside it)."""
    events = sorted(
        (
            (e.start_ns(), e.name(), e.nbytes())
            for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" or e.name().startswith("mark:")
        ),
        key=lambda t: t[0],
    )
    live, phase, out = 0, "before", {}
    for _, name, nbytes in events:
        if name.startswith("mark:"):
            phase = name[len("mark:") :]
            out[phase] = max(out.get(phase, 0), live)
        else:
            live += nbytes
            out[phase] = max(out.get(phase, 0), live)
    return out


def main(out: Path, precision: str, ema: bool, background: bool) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # Lightning's teardown deletes the latter
    instrument()
    if background:
        BackgroundSave.start = lambda self: HELD.append(self)  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        activations = fit(out, first=True, world=world, precision=precision, ema=ema, bg=background)
        if not background:
            fit(out, first=False, world=world, precision=precision, ema=ema)
    got = {**peaks(prof), "traced activations": activations, "device bytes by moment": DEVICE_BYTES}
    (out / f"phases.{rank}.json").write_text(json.dumps(got))


if __name__ == "__main__":
    flags = sys.argv[3:]
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "32-true", "ema" in flags, "background" in flags)
