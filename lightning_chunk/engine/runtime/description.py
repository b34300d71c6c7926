"""What a fit's engine is, from the parameters' shapes alone: ``EngineDescription`` builds the manager's parameter
descriptions, the placement policy, the hooks (not installed), the optimizer bindings (not bound) and the layout
chooser, and allocates nothing and changes nothing in the process. ``ChunkEngine`` starts from one, and
``plan_from_shapes`` plans a model too large to build from one (``lightning-chunk plan``).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..chunks.chunk import Tier
from ..chunks.packing import Layout
from ..comm.collectives import Collectives
from ..config import ChunkConfig, DtypePolicy, default_device_limit, format_bytes, resolve_reshard_after_forward
from ..memory.manager import ChunkManager
from ..optim.binding import OptimizerBinding
from ..schedule.costs import planned_views
from ..schedule.placement import ChunkView, PlacementPolicy, device_shards, make_policy
from ..schedule.spill import spill_to_disk
from ..schedule.tracer import Trace
from .hooks import ChunkHooks
from .layout_choice import LayoutChooser
from .same_model import check_same_model, rows_of

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShapePlan:
    """What ``plan_from_shapes`` found: the first layout and the bytes of each chunk on one rank."""

    layout: Layout
    views: list[ChunkView]
    tiers: dict[int, Tier]
    limit: int | None
    need_before_activations: int  # device bytes the busiest module needs before activations
    param_numel: int
    optim_bytes_per_element: int = 0  # the optimizer state of the param group that keeps the most
    # the largest trainable chunk whole in its master dtype, whatever dtype gradients are summed in (0: none)
    master_chunk_bytes: int = 0
    # one rank's share of an average of the weights (ChunkEMA): each trainable chunk's shard in its master dtype
    average_bytes: int = 0

    def shard_bytes(self, tier: Tier | None = None) -> int:
        """One rank's shard bytes (masters, compute copies, gradients, optimizer state), in memory on ``tier``
        (a disk shard's compute copy counts on the host) or in all."""
        if tier is None:
            return sum(v.device_shard_bytes for v in self.views)
        held = {
            v.chunk_id: (v.host_bytes_on_disk if self.tiers[v.chunk_id] is Tier.DISK else v.device_shard_bytes)
            for v in self.views
        }
        home = {cid: (Tier.HOST if t is Tier.DISK else t) for cid, t in self.tiers.items()}
        return sum(b for cid, b in held.items() if home[cid] is tier)

    def disk_bytes(self) -> int:
        """One rank's bytes in the disk tier's files."""
        return sum(v.disk_bytes for v in self.views if self.tiers[v.chunk_id] is Tier.DISK)


def agree_on_limits(config: ChunkConfig, comm: Collectives) -> ChunkConfig:
    """Every rank plans under the smallest device and host limit any rank has.

    [Note: one limit for every rank]
    The device limit drives the chunk size, the shard tiers, every eviction and prefetch, and the limit checks, all
    decided by each rank on its own. On CUDA its default is the device's free memory at set-up less a margin, which
    differs from GPU to GPU (contexts, other tenants, another node): ranks whose limits differed by 300 KB (two
    gloo ranks, the agreement check off as on NCCL) evicted different chunks, paired same-size all-gathers of
    different chunks (payloads built from mixed shards, silently) and then hung. Before anything is planned the
    ranks agree on the minimum of each limit (``None``, no limit, counts as the largest); the host limit too, since
    it decides which shards go to disk and whether chunks step in backward. A limit error on a rank whose own limit
    was larger names both (``Ledger.named_limit``): the limit it names is not the one that rank was given. The
    strategy's checks before the engine (ChunkEMA and stepping in backward under a host limit) read the agreed host
    limit too: a limit given to some ranks alone was refused on those ranks, and the others waited in the engine's
    first collective."""
    none = 2**62
    t = torch.tensor(
        [config.device_memory_limit or none, config.host_memory_limit or none],
        dtype=torch.int64,
        device=comm.tensor_device(),
    )
    device, host = (
        None if v >= none else int(v)
        for v in comm.all_reduce(t, "min", what="the agreement on the memory limits").tolist()
    )
    if (device, host) == (config.device_memory_limit, config.host_memory_limit):
        return config
    _log.info(
        "[rank %d] device_memory_limit %s and host_memory_limit %s: the smallest of every rank's",
        comm.all_rank,
        device,
        host,
    )
    return config.replace(device_memory_limit=device, host_memory_limit=host)


@dataclass
class EngineDescription:
    """Everything about a fit that needs only the parameters' shapes ([Note: a fit described from shapes])."""

    config: ChunkConfig
    module: torch.nn.Module
    manager: ChunkManager
    policy: PlacementPolicy
    hooks: ChunkHooks
    bindings: list[OptimizerBinding]
    optim_bytes: dict[int, int]  # param group -> optimizer state bytes an element
    layouts: LayoutChooser

    @classmethod
    def of(
        cls,
        module: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer] = (),
        *,
        config: ChunkConfig | None = None,
        dtypes: DtypePolicy | None = None,
        device: torch.device | None = None,
        collectives: Collectives | None = None,
    ) -> EngineDescription:
        """[Note: a fit described from shapes]
        ``plan_from_shapes`` used to build a half-initialised engine through ``cls.__new__`` and the engine's own
        set-up method, which also set the process's heap thresholds (``mallopt``): planning a model changed how the
        planning process allocated. The description is the part of the set-up that reads shapes only; the engine
        adds the heap settings, the packing and the hooks' installation."""
        config = config or ChunkConfig()
        device = device or torch.device("cpu")
        origin = ""  # where the device limit came from, for the errors that name it (Ledger.named_limit)
        if config.device_memory_limit is None and device.type == "cuda":  # the caller's config is left alone
            config = config.replace(device_memory_limit=default_device_limit(device))
            origin = "the default: free memory at set-up less a margin"
        config = resolve_reshard_after_forward(config, device)
        if collectives is not None and collectives.world_size > 1 and not collectives.planning_only:
            own = config.device_memory_limit
            config = agree_on_limits(config, collectives)
            if config.device_memory_limit != own:
                origin = "the smallest of the ranks' limits; this rank's " + (
                    f"{'default ' if origin else ''}was {format_bytes(own)}" if own is not None else "set none"
                )
        named = list(module.named_parameters())
        lazy = [n for n, p in named if isinstance(p, torch.nn.parameter.UninitializedParameter)]
        if lazy:  # torch's own error names neither the parameter nor the way out
            raise ValueError(
                f"{len(lazy)} parameter{'s are' if len(lazy) > 1 else ' is'} not initialised yet "
                f"({', '.join(lazy[:4])}"
                f"{', ...' if len(lazy) > 4 else ''}): lazy modules (nn.LazyLinear, ...) learn their "
                "shapes at their first forward, and chunk_offload packs parameters by shape before any. "
                "Run the model once on a sample batch before fit (in __init__ or setup), or give the "
                "layers their sizes."
            )
        if collectives is None or collectives.all_rank == 0:
            _say_channels_last(named)
        group_of, offsets = _param_groups(named, optimizers)
        if collectives is not None and collectives.world_size > 1 and not collectives.planning_only:
            check_same_model(rows_of(named, group_of, module), collectives)  # [Note: the same model on every rank]
        dtypes = dataclasses.replace(dtypes or DtypePolicy(), frozen_in_compute_dtype=config.frozen_in_compute_dtype)
        keep = dtypes.own_dtype_params(module)
        manager = ChunkManager(
            named,
            group_of,
            config=config,
            dtypes=dtypes,
            device=device,
            collectives=collectives,
            own_dtype={i for i, (_, p) in enumerate(named) if id(p) in keep},
            limit_origin=origin,
        )
        policy = make_policy(config, beside_backward=config.steps_beside_backward(manager.device.type))
        hooks = ChunkHooks(module, manager, policy)
        bindings = [OptimizerBinding(o, manager, off, config) for o, off in zip(optimizers, offsets, strict=True)]
        optim_bytes: dict[int, int] = {}
        for b in bindings:
            optim_bytes.update(b.state_bytes())
        layouts = LayoutChooser(manager, config, hooks.owners.owned, optim_bytes, policy)
        return cls(config, module, manager, policy, hooks, bindings, optim_bytes, layouts)

    def plan_tiers(self, layout: Layout, trace: Trace | None) -> tuple[list[ChunkView], dict[int, Tier]]:
        """What ``layout``'s chunks would cost, and the tiers the policy gives their shards."""
        views = planned_views(layout, self.manager.dtypes, self.optim_bytes)
        tiers = self.policy.shard_tiers(views, trace, self.manager.limit)
        return views, spill_to_disk(
            views,
            tiers,
            self.config.host_memory_limit,
            device_is_host=self.manager.device.type == "cpu",
            chunk_numel_chosen=self.config.chunk_numel is not None,
        )


def _say_channels_last(named: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
    """A chunk holds each parameter contiguous: one made channels_last (``model.to(memory_format=...)``) trains as the
    same model without that call does, bit for bit, and its convolutions ran contiguous without a word."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    names = [
        n
        for n, p in named
        if p.dim() in formats and not p.is_contiguous() and p.is_contiguous(memory_format=formats[p.dim()])
    ]
    if names:
        warnings.warn(
            f"chunk_offload: {len(names)} parameter{'s are' if len(names) > 1 else ' is'} channels_last "
            f"({', '.join(names[:4])}{', ...' if len(names) > 4 else ''}); a chunk holds each parameter contiguous, "
            "so they train contiguous, as without .to(memory_format=torch.channels_last). Convolutions still run "
            "channels_last when their inputs are: convert each batch (in on_after_batch_transfer).",
            UserWarning,
            stacklevel=4,
        )


def _param_groups(
    named: list[tuple[str, torch.nn.Parameter]], optimizers: Sequence[torch.optim.Optimizer]
) -> tuple[dict[int, int], list[int]]:
    """Parameter index -> its param group's number over every optimizer, and each optimizer's first number."""
    index_of = {id(p): i for i, (_, p) in enumerate(named)}
    group_of: dict[int, int] = {}
    offsets, offset = [], 0
    for opt in optimizers:
        offsets.append(offset)
        for g in opt.param_groups:
            for p in g["params"]:
                i = index_of.get(id(p))
                if i is None:
                    raise ValueError(
                        f"{type(opt).__name__} holds a tensor of shape {tuple(p.shape)} that is not a "
                        "parameter of the module; chunk_offload can only step module parameters: register it "
                        "(`self.name = torch.nn.Parameter(tensor)` in the LightningModule)."
                    )
                if i in group_of:
                    raise ValueError(f"parameter {named[i][0]!r} appears in two optimizer param groups.")
                group_of[i] = offset
            offset += 1
    return group_of, offsets


def plan_from_shapes(
    module: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    *,
    config: ChunkConfig | None = None,
    dtypes: DtypePolicy | None = None,
    world_size: int = 1,
) -> ShapePlan:
    """The layout, each chunk's per-rank bytes and the shard tiers ``world_size`` ranks would start from, from
    the parameters' shapes alone: for a model too large to build (a meta-device one). Nothing is allocated, no
    process group is needed, and a too-small limit is reported, not raised."""
    desc = EngineDescription.of(
        module,
        optimizers,
        config=config,
        dtypes=dtypes,
        device=torch.device("cpu"),
        collectives=Collectives.planning(world_size),
    )
    layout = desc.layouts.choose(list(range(len(desc.manager.params))), trace=None)
    views, tiers = desc.plan_tiers(layout, trace=None)
    dtypes_used = desc.manager.dtypes
    trainable = [c for c in layout.chunks if c.key.requires_grad]
    master = {
        c.chunk_id: dtypes_used.master_for(c.key.dtype, trainable=True, own_dtype=c.key.own_dtype).itemsize
        for c in trainable
    }
    return ShapePlan(
        layout=layout,
        views=views,
        tiers=tiers,
        limit=desc.manager.limit,
        need_before_activations=desc.layouts.need_before_trace(
            layout, views, held=device_shards(views, tiers, world_size)[1]
        ),
        param_numel=sum(s.numel for s in desc.manager.specs),
        optim_bytes_per_element=max(desc.optim_bytes.values(), default=0),
        master_chunk_bytes=max((c.capacity_numel * master[c.chunk_id] for c in trainable), default=0),
        average_bytes=sum(c.capacity_numel // world_size * master[c.chunk_id] for c in trainable),
    )
