"""``lightning-chunk plan``: before training, what a model needs under a device limit.

It builds the model and its data, runs one throwaway forward and backward on one batch through
``ChunkOffloadStrategy`` (the warm-up: activations traced, chunk size chosen, shards placed), and
reports the chunks, the bytes per tier, and the device peak estimated by replaying the trace
through the placement policy (``engine/schedule/simulate.py``). Nothing is saved. When the limit is too
small, a dry run without it traces what the smallest limit must hold, and the message names that limit, checked by a
dry run under it ([Note: the smallest limit plan names]); the command exits non-zero.

``--shapes-only`` (``make_shape_plan``) builds nothing: the model (and its ``configure_model``) runs on
the meta device, the optimizers hold placeholders, and the per-rank bytes of ``--ranks`` ranks come
from the shapes alone, so a model far larger than this machine can be planned (a 7B GPT on 8 GPUs
from a laptop). Activations need a real step and are not estimated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import yaml

from .dry_run import DryRun, one_step_trainer
from .engine.chunks.chunk import Tier
from .engine.chunks.materialize import DeferredInit
from .engine.comm.group import shard_ranks
from .engine.config import ChunkConfig, device_margin_bytes, human_bytes
from .engine.errors import PLUS_ACTIVATIONS, DeviceMemoryLimitError
from .engine.optim.ema import average_bytes
from .engine.runtime.description import ShapePlan, plan_from_shapes
from .engine.schedule.simulate import simulate_step
from .engine.system import torch_features
from .options import grouped
from .phases import ClusterReport, phases
from .plan_inputs import (
    chunk_precision,
    chunk_precision_args,
    has_async_save,
    has_chunk_ema,
    has_train_dataloader,
    load_class,
)
from .strategy import ChunkOffloadStrategy


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
    disk_shards: int
    disk_bytes: int
    host_limit: int | None
    payload_bytes_max: int
    nonmodel_peak_bytes: int
    estimated_device_peak_bytes: int
    estimated_total_peak_bytes: int  # chunks plus the activations of the same moment
    limit: int | None
    average_bytes: int = 0  # a ChunkEMA's share on this rank, where one is planned for (0: none)

    @property
    def fits(self) -> bool:
        return self.limit is None or self.estimated_total_peak_bytes <= self.limit

    def render(self) -> str:
        m = human_bytes
        limit = "none" if self.limit is None else m(self.limit)
        verdict = "fits" if self.fits else "does NOT fit"
        return "\n".join(
            [
                f"model               {self.model}: {self.param_numel:,} parameters, precision {self.precision}",
                "chunks              "
                f"{_chunk_line(self.chunks, self.chunk_numel, self.param_numel, self.padding_numel)} "
                f"(largest payload {m(self.payload_bytes_max)})",
                f"placement           {self.placement}: {self.device_shards} of {self.chunks} shards on the device",
                f"device tier         {m(self.device_shard_bytes)} of shards (masters, gradients, optimizer state)",
                f"host tier           {m(self.host_bytes)}"
                + (
                    ""
                    if self.host_limit is None
                    else f" (host_memory_limit {m(self.host_limit)}, with two disk shards paged in at once)"
                ),
                f"disk tier           {m(self.disk_bytes)} in {self.disk_shards} shards (masters, gradients, optimizer "
                "state)"
                if self.disk_shards
                else "disk tier           none",
                *_average_line(self.average_bytes, self.host_limit is not None),
                f"activations         {m(self.nonmodel_peak_bytes)} at the traced peak",
                f"estimated peak      {m(self.estimated_device_peak_bytes)} of chunks on the device; "
                f"{m(self.estimated_total_peak_bytes)} with the activations of the same moment",
                f"device_memory_limit {limit}: {verdict}",
            ]
        )


def _average_line(nbytes: int, in_files: bool) -> list[str]:
    """A ChunkEMA's average, where one is planned for ([Note: host memory by phase])."""
    if not nbytes:
        return []
    where = "in files under disk_dir (host_memory_limit)" if in_files else "in host memory, beside the host tier"
    return [f"ChunkEMA average    {human_bytes(nbytes)} {where}"]


class _Probe(L.Callback):
    """Reads the engine right before the dry run's optimizer step (after the warm-up was finalized)."""

    report: PlanReport | None = None

    def __init__(self, ema: bool = False) -> None:
        self.ema = ema

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        engine = trainer.strategy.engine  # type: ignore[attr-defined]
        mgr, trace = engine.manager, engine.hooks.moments.trace
        views = mgr.views()
        stats = mgr.stats()
        peaks = simulate_step(engine.policy, views, trace, mgr.limit, mgr.comm.world_size)
        self.report = PlanReport(
            model=type(pl_module).__name__,
            param_numel=int(stats["param_numel"]),
            precision=str(trainer.precision),
            placement=engine.config.placement,
            chunks=len(mgr.chunks),
            chunk_numel=mgr.layout.capacity_numel,
            padding_numel=mgr.layout.padding_numel,
            device_shards=sum(v.shard_tier is Tier.DEVICE for v in views),
            device_shard_bytes=sum(v.device_shard_bytes for v in views if v.shard_tier is Tier.DEVICE),
            host_bytes=mgr.ledger[Tier.HOST],
            disk_shards=sum(v.shard_tier is Tier.DISK for v in views),
            disk_bytes=mgr.ledger[Tier.DISK],
            host_limit=engine.config.host_memory_limit,
            payload_bytes_max=max(v.payload_bytes for v in views),
            nonmodel_peak_bytes=trace.nonmodel_peak_bytes,
            estimated_device_peak_bytes=peaks[0],
            estimated_total_peak_bytes=peaks[1],
            limit=mgr.limit,
            average_bytes=average_bytes(mgr) if self.ema else 0,
        )


def make_plan(
    model_cls: type,
    model_args: dict[str, Any],
    data_cls: type | None,
    data_args: dict[str, Any],
    strategy_args: dict[str, Any],
    precision: str = "32-true",
    ema: bool = False,
    plugin_args: dict[str, Any] | None = None,
) -> PlanReport:
    """Run the dry warm-up step and report. Raises ``DeviceMemoryLimitError`` when the limit is too small.
    ``ema``: count a ChunkEMA's average; ``plugin_args``: a config's ``ChunkPrecision`` arguments."""
    probe = _Probe(ema)
    dry = DryRun(model_cls, model_args, data_cls, data_args, strategy_args, precision, plugin_args)
    try:
        dry.run(probe)
    except DeviceMemoryLimitError as refused:
        if strategy_args.get("device_memory_limit") is None:
            raise
        said = str(refused).replace(PLUS_ACTIVATIONS, " plus the activations")  # its pointer to plan is this
        raise DeviceMemoryLimitError(f"{said} {dry.smallest_limit()}") from None
    assert probe.report is not None, "the dry run never reached an optimizer step"
    return probe.report


@dataclass
class ShapePlanReport:
    model: str
    precision: str
    ranks: int
    placement: str
    plan: ShapePlan
    ema: bool = False
    in_files: bool = False  # the average, under a host limit

    @property
    def fits(self) -> bool:
        """The busiest module's chunks (and, with shards on the device, those shards) fit under the limit.
        Necessary, not sufficient: activations come on top."""
        p = self.plan
        return p.limit is None or p.need_before_activations + p.shard_bytes(Tier.DEVICE) <= p.limit

    def render(self) -> str:
        g = human_bytes
        p = self.plan
        ideal = p.param_numel * 16 / self.ranks
        host_total = _host_memory()
        limit = "none" if p.limit is None else g(p.limit)
        return "\n".join(
            [
                f"model               {self.model}: {p.param_numel:,} parameters, precision {self.precision}; "
                "planned for "
                f"{self.ranks} rank(s) from shapes alone (nothing built)",
                "chunks              "
                + _chunk_line(len(p.layout.chunks), p.layout.capacity_numel, p.param_numel, p.layout.padding_numel),
                f"shards a rank       {g(p.shard_bytes())} (masters, compute copies, gradients, optimizer state; "
                f"16 bytes a parameter over {self.ranks} rank(s) would be {g(ideal)})",
                f"placement           {self.placement}, before the warm-up: {g(p.shard_bytes(Tier.DEVICE))} on the "
                "device, "
                f"{g(p.shard_bytes(Tier.HOST))} on the host"
                + (f" (this machine has {g(host_total)} in all)" if host_total else "")
                + (
                    f", {g(p.disk_bytes())} on disk ({sum(t is Tier.DISK for t in p.tiers.values())} shards' masters, "
                    "gradients and optimizer state)"
                    if p.disk_bytes()
                    else ""
                ),
                *_average_line(p.average_bytes if self.ema else 0, self.in_files),
                f"device at least     {g(p.need_before_activations)} for the busiest module's chunks"
                + (" and a gradient payload" if self.ranks > 1 else "")
                + ", plus activations (not estimated)",
                f"device_memory_limit {limit}: " + ("fits before activations" if self.fits else "does NOT fit"),
            ]
        )


def _chunk_line(chunks: int, capacity: int, params: int, padding: int) -> str:
    """The layout in numbers that add up: the last chunk of each kind is trimmed to what it holds."""
    return (
        f"{chunks} of at most {capacity:,} elements: {params + padding:,} elements = {params:,} parameters + "
        f"{padding:,} padding"
    )


def _host_memory() -> int:
    try:
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def gives_back_grads(config: ChunkConfig, staging: bool) -> bool:
    """Whether the gradient shards are given back after each step: stepping in backward for sure (``True``), and
    where they are pinned to the byte (``staging``: a GPU), on a torch that swaps storages ([Note: torch versions])."""
    exact = staging and config.pin_memory == "exact"
    return config.step_in_backward is True and (torch_features.SWAP_STORAGES or not exact)


def make_shape_plan(
    model_cls: type,
    model_args: dict[str, Any],
    strategy_args: dict[str, Any],
    precision: str = "32-true",
    ranks: int = 1,
    cluster: tuple[int, int, int | None] | None = None,
    staging: bool = True,
    activations: int = 0,
    reduce_dtype: str | torch.dtype | None = None,
    ema: bool = False,
    background_save: bool = False,
    plugin_args: dict[str, Any] | None = None,
) -> Any:
    """Plan ``ranks`` ranks from shapes: the model is built on the meta device and never materialised. ``cluster``:
    ``(nodes, devices a node, host bytes a node)``, for each phase's peaks ([Note: host memory by phase]);
    ``staging``: the devices are GPUs, whose gradients leave through pinned staging; ``activations``: a step's
    activation peak a rank, where known; ``reduce_dtype``: ``ChunkPrecision``'s, the dtype of gradient payloads;
    ``ema``: count a ChunkEMA's average; ``background_save``: saves are written in the background, beside training
    (``AsyncCheckpointIO``) ([Note: host memory by phase]); ``plugin_args``: a config's ``ChunkPrecision`` arguments
    (``fp32_embeddings_and_norms``, ``full_precision_modules``: the payloads' dtypes), ``reduce_dtype`` among them."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if ranks < 1:
        raise ValueError(f"ranks={ranks} is not allowed; it must be at least 1.")
    with torch.device("meta"):
        model = model_cls(**model_args)
        if is_overridden("configure_model", model, L.LightningModule):
            model.configure_model()
    DeferredInit.capture(model)  # placeholders: optimizers (fused ones too) can be built over them
    strategy = ChunkOffloadStrategy(**grouped({**strategy_args, "log_memory_stats": False}))
    plugin = chunk_precision(precision, {"reduce_dtype": reduce_dtype, **(plugin_args or {})})
    precision = str(plugin.precision)  # "16", 16, "bf16": their normal names
    model.trainer = one_step_trainer(strategy, plugin)  # configure_optimizers may read the trainer
    optimizers, _ = _init_optimizers_and_lr_schedulers(model)
    plan = plan_from_shapes(
        model,
        optimizers,
        config=strategy.config,
        dtypes=plugin.dtype_policy(),
        world_size=ranks,
    )
    in_files = strategy.config.host_memory_limit is not None  # [Note: the average under a host limit]
    report = ShapePlanReport(
        model=type(model).__name__,
        precision=precision,
        ranks=ranks,
        placement=strategy.config.placement,
        plan=plan,
        ema=ema,
        in_files=in_files,
    )
    if cluster is None:
        return report
    nodes, devices, host_memory = cluster
    low = 2 if precision.startswith(("bf16-mixed", "16-mixed")) else 0  # the compute copy beside an fp32 master
    optim = plan.optim_bytes_per_element
    element = 4 + low + 4 + optim  # a shard's bytes an element: master, compute copy, gradient, optimizer state
    in_background = background_save and not in_files  # under a host limit training waits for the writer
    rows, bound, state, after, pinned = phases(
        plan,
        placement=strategy.config.placement,
        optim_ratio=optim / 4,
        model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        host_per_rank=None if host_memory is None else host_memory // devices,
        optim_share=optim / element,
        ranks=ranks,
        staging=staging,
        activations=activations,
        releases=strategy.config.placement == "host" and strategy.config.reshard_after_forward is True,
        # only ``True`` is sure to step in backward (``None`` steps after it in a fit that clips by norm), and a shard
        # pinned to the byte is given back only by a torch that swaps storages ([Note: gradient shards pinned to the
        # byte]): this torch, the one that plans
        grad_share=4 / element if gives_back_grads(strategy.config, staging) else 0.0,
        average=plan.average_bytes if ema else 0,
        average_in_files=in_files,
        save_share=(4 + optim) / element,
        background_save=in_background,
        pinned_low_bytes=low if staging and strategy.config.pin_memory else None,
        exact_pinning=strategy.config.pin_memory == "exact",
        beside_backward=strategy.config.steps_beside_backward("cuda" if staging else "cpu"),
    )
    return ClusterReport(
        model=type(model).__name__,
        precision=precision,
        nodes=nodes,
        devices=devices,
        device_limit=plan.limit,
        host_memory=host_memory,
        phases=rows,
        bound=bound,
        state=state,
        device_shards_after=sum(t is Tier.DEVICE for t in after.values()),
        chunks=len(plan.views),
        shard_size=ranks if ranks < nodes * devices else None,
        average=plan.average_bytes if ema else 0,
        average_in_files=in_files,
        background_save=in_background,
        pinned_rounding=pinned,
    )


def plan_from_args(
    model: str,
    data: str | None,
    config: str | None,
    init_args: str | None,
    data_args: str | None,
    overrides: dict[str, Any],
    precision: str | None,
    shapes_only: bool = False,
    ranks: int = 1,
    cluster: tuple[int, int, int | None, int | None] | None = None,
    activations: int | None = None,
    ema: bool = False,
    background_save: bool = False,
) -> Any:
    """``cluster``: ``(nodes, devices a node, device bytes, host bytes a node)``: plan from shapes for that many
    ranks, under the limit a device of that size gives (its memory less the margin ``device_memory_limit=None``
    keeps), unless a limit is given; ``activations``: a step's activation peak a rank, for the cluster view; ``ema``:
    count a ChunkEMA's average, as a config whose ``trainer.callbacks`` hold one does; ``background_save``: with
    ``cluster``, saves written beside training, as a config whose ``trainer.plugins`` hold ``AsyncCheckpointIO``
    makes them."""
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
    trainer_cfg = cfg.get("trainer") or {}
    plugin = chunk_precision_args(trainer_cfg)
    prec = precision or str(trainer_cfg.get("precision") or plugin.get("precision", "32-true"))
    ema = ema or has_chunk_ema(trainer_cfg)
    background_save = background_save or has_async_save(trainer_cfg)
    memory = sargs.get("memory")
    shard_size = sargs.get("shard_size", memory.get("shard_size") if isinstance(memory, dict) else None)
    if cluster is not None:
        nodes, devices, device_memory, host_memory = cluster
        if nodes < 1 or devices < 1:
            raise ValueError(f"--nodes {nodes} --devices {devices}: both must be at least 1.")
        if device_memory is not None and sargs.get("device_memory_limit") is None:
            sargs["device_memory_limit"] = device_memory - device_margin_bytes(device_memory)
        return make_shape_plan(
            load_class(model),
            margs,
            sargs,
            prec,
            shard_ranks(shard_size, nodes * devices, devices),
            (nodes, devices, host_memory),
            activations=activations or 0,
            ema=ema,
            background_save=background_save,
            plugin_args=plugin,
        )
    if shapes_only:
        ranks = shard_ranks(shard_size, ranks, ranks)
        return make_shape_plan(load_class(model), margs, sargs, prec, ranks, ema=ema, plugin_args=plugin)
    model_cls = load_class(model)
    if data is None and not has_train_dataloader(model_cls):
        raise ValueError(
            f"{model_cls.__name__} defines no train_dataloader, and the dry run needs one batch: give "
            "--data with its LightningDataModule (package.module:Class or path/to/file.py:Class), or "
            "--shapes-only to plan from the shapes alone."
        )
    return make_plan(model_cls, margs, load_class(data) if data else None, dargs, sargs, prec, ema, plugin or None)
