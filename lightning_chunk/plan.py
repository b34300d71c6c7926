"""``lightning-chunk plan``: before training, what a model needs under a device limit.

It builds the model and its data, runs one throwaway forward and backward on one batch through
``ChunkOffloadStrategy`` (the warm-up: activations traced, chunk size chosen, shards placed), and
reports the chunks, the bytes per tier, and the device peak estimated by replaying the trace
through the placement policy (``engine/simulate.py``). Nothing is saved. When the limit is too
small, the message names the smallest limit that works and the command exits non-zero.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import lightning as L
import yaml

from .engine.chunk import Tier
from .engine.simulate import simulate_step
from .strategy import ChunkOffloadStrategy

MiB = 2**20


def load_class(spec: str) -> type:
    """``package.module.Class`` or ``path/to/file.py:Class``."""
    if ":" in spec:
        file, name = spec.rsplit(":", 1)
        path = Path(file)
        if not path.is_file():
            raise ValueError(f"{spec!r}: {file!r} is not a file.")
        mod_name = f"_lightning_chunk_plan_{path.stem}"
        module = sys.modules.get(mod_name)
        if module is None:
            s = importlib.util.spec_from_file_location(mod_name, path)
            assert s is not None and s.loader is not None
            module = importlib.util.module_from_spec(s)
            sys.modules[mod_name] = module
            s.loader.exec_module(module)
    else:
        mod_path, _, name = spec.rpartition(".")
        if not mod_path:
            raise ValueError(f"{spec!r} is not a class path: use package.module.Class or file.py:Class.")
        module = importlib.import_module(mod_path)
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{spec!r}: no {name!r} there.") from None


@dataclass
class PlanReport:
    model: str
    param_numel: int
    precision: str
    placement: str
    chunks: int
    chunk_numel: int
    padding_numel: int
    device_shards: int
    device_shard_bytes: int
    host_bytes: int
    payload_bytes_max: int
    nonmodel_peak_bytes: int
    estimated_device_peak_bytes: int
    estimated_total_peak_bytes: int  # chunks plus the activations of the same moment
    limit: Optional[int]

    @property
    def fits(self) -> bool:
        return self.limit is None or self.estimated_total_peak_bytes <= self.limit

    def render(self) -> str:
        m = lambda b: f"{b / MiB:,.1f} MiB"  # noqa: E731
        limit = "none" if self.limit is None else m(self.limit)
        verdict = "fits" if self.fits else "does NOT fit"
        return "\n".join([
            f"model               {self.model}: {self.param_numel:,} parameters, precision {self.precision}",
            f"chunks              {self.chunks} of {self.chunk_numel:,} elements (largest payload "
            f"{m(self.payload_bytes_max)}; {self.padding_numel:,} elements of padding)",
            f"placement           {self.placement}: {self.device_shards} of {self.chunks} shards on the device",
            f"device tier         {m(self.device_shard_bytes)} of shards (masters, gradients, optimizer state)",
            f"host tier           {m(self.host_bytes)}",
            f"activations         {m(self.nonmodel_peak_bytes)} at the traced peak",
            f"estimated peak      {m(self.estimated_device_peak_bytes)} of chunks on the device; "
            f"{m(self.estimated_total_peak_bytes)} with the activations of the same moment",
            f"device_memory_limit {limit}: {verdict}",
        ])


class _Probe(L.Callback):
    """Reads the engine right before the dry run's optimizer step (after the warm-up was finalized)."""

    report: Optional[PlanReport] = None

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        engine = trainer.strategy.engine
        mgr, trace = engine.manager, engine.hooks.trace
        views = mgr.views()
        stats = mgr.stats()
        peaks = simulate_step(engine.policy, views, trace, mgr.limit, mgr.comm.world_size)
        self.report = PlanReport(
            model=type(pl_module).__name__, param_numel=int(stats["param_numel"]),
            precision=str(trainer.precision), placement=engine.config.placement, chunks=len(mgr.chunks),
            chunk_numel=mgr.layout.capacity_numel, padding_numel=mgr.layout.padding_numel,
            device_shards=sum(v.shard_tier is Tier.DEVICE for v in views),
            device_shard_bytes=sum(v.device_shard_bytes for v in views if v.shard_tier is Tier.DEVICE),
            host_bytes=mgr.ledger[Tier.HOST], payload_bytes_max=max(v.payload_bytes for v in views),
            nonmodel_peak_bytes=trace.nonmodel_peak_bytes,
            estimated_device_peak_bytes=peaks[0], estimated_total_peak_bytes=peaks[1], limit=mgr.limit,
        )


def make_plan(model_cls: type, model_args: dict[str, Any], data_cls: Optional[type], data_args: dict[str, Any],
              strategy_args: dict[str, Any], precision: str = "32-true") -> PlanReport:
    """Run the dry warm-up step and report. Raises ``DeviceMemoryLimitError`` when the limit is too small."""
    model = model_cls(**model_args)
    datamodule = data_cls(**data_args) if data_cls is not None else None
    probe = _Probe()
    strategy = ChunkOffloadStrategy(**{**strategy_args, "log_memory_stats": False})
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[probe])
    trainer.fit(model, datamodule=datamodule)
    assert probe.report is not None, "the dry run never reached an optimizer step"
    return probe.report


def plan_from_args(model: str, data: Optional[str], config: Optional[str], init_args: Optional[str],
                   data_args: Optional[str], overrides: dict[str, Any], precision: Optional[str]) -> PlanReport:
    cfg: dict[str, Any] = {}
    if config:
        with open(config) as f:
            cfg = yaml.safe_load(f) or {}
    margs = dict(cfg.get("model") or {})
    margs.update(json.loads(init_args) if init_args else {})
    dargs = dict(cfg.get("data") or {})
    dargs.update(json.loads(data_args) if data_args else {})
    strategy_cfg = (cfg.get("trainer") or {}).get("strategy") or {}
    sargs = dict(strategy_cfg.get("init_args") or {}) if isinstance(strategy_cfg, dict) else {}
    sargs.update({k: v for k, v in overrides.items() if v is not None})
    prec = precision or str((cfg.get("trainer") or {}).get("precision") or "32-true")
    return make_plan(load_class(model), margs, load_class(data) if data else None, dargs, sargs, prec)
