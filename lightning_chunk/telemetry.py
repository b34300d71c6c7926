"""``ChunkTelemetry``: what a user looks at rather than reads.

- Step timings (``chunk/step_time_ms``) logged every step to the Trainer's loggers (CSV by default,
  TensorBoard when it is installed); memory figures too when the strategy does not log them itself.
- After the warm-up, one training step recorded moment by moment and drawn as a PNG: which chunks
  are resident on the device at each moment (shards kept there, payloads fetched, evictions,
  prefetches), and chunk bytes plus the traced non-model bytes against the device limit.
  matplotlib is optional (``pip install 'lightning_chunk[plot]'``); without it the callback says so
  once and carries on.
- Where each step's time went on this rank (``chunk/time_<cause>_ms``: waiting on all-gathers, on
  reduce-scatters, on agreement collectives, tier copies, the optimizer, the engine's hooks, and the rest:
  the model's compute), and at the end of ``fit`` one table of every rank's totals, printed by rank 0 and
  kept in ``breakdown`` ([Note: where a step's time goes] in ``engine/system/timing.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from .engine.schedule.tracer import BACKWARD, FORWARD, MomentEvent
from .engine.system.timing import CAUSES

# the memory_stats() entries logged by default (with the time_*_s breakdown): where the bytes are and what moved
LOGGED_STATS = frozenset(
    {
        "device_chunk_bytes",
        "device_chunk_bytes_peak",
        "host_chunk_bytes",
        "disk_chunk_bytes",
        "evictions",
        "gathers",
        "loss_scale",
        "grad_norm",
    }
)


def log_memory_stats(module: pl.LightningModule, stats: Callable[[], dict[str, float]], every: bool) -> None:
    """The strategy's ``log_memory_stats``: its figures as ``chunk/<name>`` (all of them, or ``LOGGED_STATS`` and
    the time breakdown), only on the steps Lightning writes logs (every ``log_every_n_steps``: ``self.log`` costs
    about 2 ms a call)."""
    trainer = module._trainer
    if trainer is None or not trainer.loggers or not getattr(trainer._logger_connector, "should_update_logs", True):
        return
    logged = {f"chunk/{k}": float(v) for k, v in stats().items() if every or k in LOGGED_STATS or k.startswith("time_")}
    module.log_dict(logged, on_step=True, on_epoch=False, prog_bar=False, logger=True, batch_size=1)


class ChunkTelemetry(pl.Callback):
    """Log step timings and draw one step's chunk placement (``chunk_placement.png`` in the log dir).

    Args:
        picture: record and draw one step after the warm-up.
        filename: the picture's file name, in the logger's directory (else ``default_root_dir``).
        breakdown_skip: training batches at the start left out of the end-of-fit totals (the first is the
            warm-up, which traces, re-packs and places: not what the following steps cost).
    """

    def __init__(self, picture: bool = True, filename: str = "chunk_placement.png", breakdown_skip: int = 1) -> None:
        if isinstance(breakdown_skip, bool) or not isinstance(breakdown_skip, int) or breakdown_skip < 0:
            raise ValueError(f"breakdown_skip={breakdown_skip!r} is not allowed; it must be an integer >= 0.")
        self.breakdown_skip = breakdown_skip
        self._batches = 0
        self.picture = picture
        self.filename = filename
        self.picture_path: Path | None = None
        self._t0 = 0.0
        self._events: list[MomentEvent] | None = None
        self._done = False
        self._folder: Path | None = None
        self._times0: dict[str, float] = {}
        self._totals = dict.fromkeys(("step",) + CAUSES, 0.0)  # seconds on this rank, summed over training steps
        self.breakdown: list[dict[str, float]] = []  # per rank, filled at the end of fit

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Trainer.log_dir broadcasts from rank 0: a collective, so every rank resolves it here, together;
        # reading it later from rank 0 alone would leave rank 0 waiting in a broadcast no other rank joins
        self._folder = Path(trainer.log_dir or trainer.default_root_dir)

    # ----------------------------------------------------------------- hooks
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._t0 = time.perf_counter()
        engine = getattr(trainer.strategy, "engine", None)
        self._times0 = dict(engine.manager.clock.seconds) if engine is not None else {}
        if self.picture and not self._done and engine is not None and engine.warmed_up and trainer.is_global_zero:
            self._events = []
            engine.hooks.moments.recorder = self._events.append

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        elapsed_ms = (time.perf_counter() - self._t0) * 1000.0
        values = {"chunk/step_time_ms": elapsed_ms}
        strategy = trainer.strategy
        engine = getattr(strategy, "engine", None)
        if engine is not None and self._times0:
            self._batches += 1
            counted = self._batches > self.breakdown_skip
            self._totals["step"] += elapsed_ms / 1000.0 if counted else 0.0
            spent = 0.0
            for cause, now in engine.manager.clock.seconds.items():
                delta = now - self._times0.get(cause, 0.0)
                self._totals[cause] += delta if counted else 0.0
                values[f"chunk/time_{cause}_ms"] = delta * 1000.0
                spent += delta
            values["chunk/time_rest_ms"] = max(elapsed_ms - spent * 1000.0, 0.0)
        if hasattr(strategy, "memory_stats") and not getattr(strategy, "log_memory_stats", True):
            values.update({f"chunk/{k}": float(v) for k, v in strategy.memory_stats().items()})
        if trainer.loggers:
            pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)
        if self._events is not None and engine is not None:
            engine.hooks.moments.recorder = None
            events, self._events = self._events, None
            self._done = True
            self.picture_path = self._draw(trainer, engine, events)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank's totals, gathered (every rank calls this together) and printed by rank 0."""
        mine = dict(self._totals)
        if trainer.world_size > 1:
            import torch.distributed as dist

            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, mine)
            self.breakdown = [dict(g) for g in gathered]
        else:
            self.breakdown = [mine]
        if self.breakdown and self.breakdown[0]["step"] > 0:
            rank_zero_info(breakdown_table(self.breakdown))

    # --------------------------------------------------------------- picture
    def _draw(self, trainer: pl.Trainer, engine: Any, events: list[MomentEvent]) -> Path | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            rank_zero_warn(
                "ChunkTelemetry: matplotlib is not installed, so there is no placement picture; "
                "`pip install 'lightning_chunk[plot]'` (or matplotlib) to get it. Training goes on."
            )
            return None
        folder = self._folder or Path(trainer.default_root_dir)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / self.filename
        draw_step(events, engine.manager.limit, len(engine.manager.chunks), path, plt)
        rank_zero_info(f"ChunkTelemetry: one step's chunk placement drawn in {path}")
        return path


def breakdown_table(per_rank: list[dict[str, float]]) -> str:
    """Seconds and share of the training steps' wall time, by cause, one row per rank."""
    heads = ["rank", "steps s"] + [c.replace("_", " ") for c in CAUSES] + ["rest (compute)"]
    rows = []
    for r, t in enumerate(per_rank):
        step = t["step"] or 1.0
        rest = max(t["step"] - sum(t[c] for c in CAUSES), 0.0)
        rows.append(
            [str(r), f"{t['step']:.2f}"]
            + [f"{t[c]:.2f} ({100 * t[c] / step:.0f}%)" for c in CAUSES]
            + [f"{rest:.2f} ({100 * rest / step:.0f}%)"]
        )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(heads)]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [
            "ChunkTelemetry: where the training steps' time went after the warm-up (seconds, share of step time)",
            line(heads),
            line(["-" * w for w in widths]),
        ]
        + [line(row) for row in rows]
    )


def draw_step(events: list[MomentEvent], limit: int | None, n_chunks: int, path: Path, plt: Any) -> None:
    """Two panels over the moments of one step: chunk residency (device, host or disk shard; payload resident or
    not), and device bytes against the limit."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = list(range(len(events)))
    for x, e in enumerate(events):
        for c in e.device_shards:
            top.add_patch(plt.Rectangle((x - 0.5, c - 0.5), 1, 1, color="#2c7a2c", alpha=0.35, lw=0))
        for c in e.disk_shards:  # the third tier: shard in files, hatched where its payload is not resident
            top.add_patch(
                plt.Rectangle((x - 0.5, c - 0.5), 1, 1, fill=False, hatch="///", color="#7f6a4d", alpha=0.5, lw=0)
            )
        for c in e.resident:
            if c not in e.device_shards:
                top.add_patch(plt.Rectangle((x - 0.5, c - 0.5), 1, 1, color="#4a90d9", alpha=0.45, lw=0))
    marks: dict[str, tuple[list[int], list[int], str, str]] = {
        "evicted": ([], [], "x", "#c0392b"),
        "fetched for use": ([], [], "o", "black"),
        "prefetched": ([], [], "^", "#8e44ad"),
    }
    for x, e in enumerate(events):
        for c in e.evicted:
            marks["evicted"][0].append(x)
            marks["evicted"][1].append(c)
        for c in e.fetched:
            key = "fetched for use" if c in e.needed else "prefetched"
            marks[key][0].append(x)
            marks[key][1].append(c)
    for label, (mx, my, m, color) in marks.items():
        if mx:
            top.scatter(mx, my, marker=m, color=color, s=18, label=label, zorder=3)
    top.add_patch(plt.Rectangle((0, 0), 0, 0, color="#2c7a2c", alpha=0.35, label="shard on device"))
    top.add_patch(plt.Rectangle((0, 0), 0, 0, color="#4a90d9", alpha=0.45, label="payload resident"))
    if any(e.disk_shards for e in events):
        top.add_patch(
            plt.Rectangle((0, 0), 0, 0, fill=False, hatch="///", color="#7f6a4d", alpha=0.5, label="shard on disk")
        )
    top.set_ylim(-0.5, n_chunks - 0.5)
    top.set_xlim(-0.5, len(events) - 0.5)
    top.set_ylabel("chunk")
    top.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, ncol=6, frameon=False)
    top.set_title("chunk placement over one training step (forward, then backward)", pad=22)
    for x, e in enumerate(events):
        if e.kind == BACKWARD and (x == 0 or events[x - 1].kind != BACKWARD):
            top.axvline(x - 0.5, color="grey", ls="--", lw=0.8)
            break
    mib = 2**20
    chunk_b = [e.device_bytes / mib for e in events]
    nonmodel = [e.nonmodel_bytes / mib for e in events]
    bottom.fill_between(xs, 0, chunk_b, step="mid", color="#4a90d9", alpha=0.6, label="chunk bytes on device")
    bottom.fill_between(
        xs,
        chunk_b,
        [a + b for a, b in zip(chunk_b, nonmodel, strict=True)],
        step="mid",
        color="#f39c12",
        alpha=0.5,
        label="traced non-model bytes",
    )
    if limit is not None:
        bottom.axhline(limit / mib, color="#c0392b", lw=1.2, label="device_memory_limit")
    bottom.set_ylabel("MiB")
    bottom.set_xlabel(
        "moment (module hook: " + ", ".join(sorted({e.kind for e in events} & {FORWARD, BACKWARD})) + ", post_fwd)"
    )
    bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
