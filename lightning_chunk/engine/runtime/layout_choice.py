"""The automatic chunk size, and what a layout needs on the device before the warm-up has traced anything.

[Note: an automatic chunk size that fits]
With ``chunk_numel=None`` the size is chosen here: least padding among sizes that give the model at least 16 chunks
(``choose_chunk_numel``, [Note: chunk granularity] in ``packing.py``), capped under a device limit at two payloads
plus the activations, then halved until the layout's busiest moment fits, down to the largest parameter (there the
limit is what is too small, and the caller says so with the numbers). Before the trace exists "the busiest moment"
is estimated from which parameters each module owns: the two busiest modules' chunks (activation checkpointing needs
a recomputed module's chunks beside the one whose backward asked for it), and with several ranks two gradient
payloads. With a ``host_memory_limit`` the size also keeps two paged-in disk shards within half of it. A user who left
the chunk size to us is never told to lower it.
"""

from __future__ import annotations

import torch

from ..chunks.chunk import Tier
from ..chunks.packing import Layout, build_layout, choose_chunk_numel, describe
from ..config import ChunkConfig, format_bytes
from ..errors import PLUS_ACTIVATIONS, DeviceMemoryLimitError
from ..memory.manager import ChunkManager
from ..schedule.costs import planned_views
from ..schedule.placement import ChunkView, PlacementPolicy, device_shards, shards_note, smallest_working_limit
from ..schedule.tracer import Trace
from .hooks import ROOT


class LayoutChooser:
    """Chooses layouts for one engine: its manager's parameters, its config, the parameters each module owns (from
    the hooks), each optimizer group's state bytes a parameter (filled once the optimizers are bound) and the
    placement policy, whose shards on the device a layout's chunks must fit beside."""

    def __init__(
        self,
        manager: ChunkManager,
        config: ChunkConfig,
        owned: dict[str, tuple[int, ...]],
        optim_bytes: dict[int, int],
        policy: PlacementPolicy,
    ) -> None:
        self.manager = manager
        self.config = config
        self.owned = owned
        self._optim_bytes = optim_bytes
        self.policy = policy

    @property
    def comm(self):  # noqa: ANN201 - the manager's Collectives
        return self.manager.comm

    def choose(self, order: list[int], trace: Trace | None, *, keep: int | None = None) -> Layout:
        """The layout of the parameters in ``order``; ``keep``: the capacity the chunks have now, which a repack keeps
        where it fits as well ([Note: the chunk size a repack keeps] in ``packing.py``)."""
        specs = self.manager.specs
        if self.config.chunk_numel is not None:
            return build_layout(specs, order, self.config.chunk_numel, self.comm.world_size)
        max_payload = None
        limit = self.manager.limit
        if limit is not None and specs:
            esz = max(torch.empty((), dtype=self.manager.dtypes.compute_for(s.key.dtype)).element_size() for s in specs)
            room = limit - (trace.nonmodel_peak_bytes if trace else 0)
            max_payload = max(room // (2 * esz), max(s.numel for s in specs))
        host_cap = self._host_limit_numel()
        if host_cap is not None:
            max_payload = host_cap if max_payload is None else min(max_payload, host_cap)
        # one rank with every shard on the device: payloads never move, so granularity buys nothing and each
        # chunk only adds per-step work (see [Note: chunk granularity])
        stays = self.comm.world_size == 1 and self.config.placement == "device"
        largest = max((s.numel for s in specs), default=1)
        while True:
            cap = choose_chunk_numel(
                specs,
                order,
                world_size=self.comm.world_size,
                numel_min=self.config.chunk_numel_min,
                numel_max=self.config.chunk_numel_max,
                max_payload_numel=max_payload,
                keep=keep,
                **({"target_chunks": 0} if stays else {}),
            )
            layout = build_layout(specs, order, cap, self.comm.world_size)
            # [Note: an automatic chunk size that fits] "two payloads plus the activations" is a first guess:
            # a module whose parameters span three chunks (its weights, and the chunk of small tensors that
            # every block shares) plus a gradient payload needs more. A user who left chunk_numel to us must
            # never be told to lower it, so halve the cap until the working set fits, down to the largest
            # parameter, where the limit is what is too small and the caller says so with the numbers.
            if limit is None or cap <= largest or self.working_bytes(layout, trace) <= limit:
                return layout
            if cap == keep:  # the search's own size at this bound first, then smaller ones
                keep = None
                continue
            max_payload = max(cap // 2, largest)

    def working_bytes(self, layout: Layout, trace: Trace | None) -> int:
        """Device bytes ``layout`` needs at its busiest moment: the shards the policy keeps on the device, the
        moment's chunks (and activations, with a trace) ([Note: the shards a placement keeps on the device])."""
        views = planned_views(layout, self.manager.dtypes, self._optim_bytes)
        if trace is not None:
            trace = trace.remap({i: s.chunk_id for i, s in layout.slot_of().items()})
        shards, held = device_shards(
            views, self.policy.shard_tiers(views, trace, self.manager.limit), self.comm.world_size
        )
        if trace is None:
            # the warm-up's layout is in registration order: in its backward a chunk whose gradients wait for the
            # rest of its tensors keeps its gradient payload while the next chunk fills one (its parameters' payload
            # may go: [Note: a gradient waits without its payload]), so choose a size with room for a second one
            second = max((v.grad_payload_bytes for v in views), default=0) if self.comm.world_size > 1 else 0
            # and for two modules' chunks at once: with activation checkpointing, the module whose backward asked
            # for a recomputation keeps its chunks while each module of the recomputed block gathers its own
            # ([Note: recomputation] in hooks.py)
            return shards + self.need_before_trace(layout, views, modules=2, held=held) + second
        chunks_b, nonmodel_b = smallest_working_limit(views, trace, held)
        return shards + chunks_b + nonmodel_b

    def smallest_limit(self, trace: Trace) -> tuple[int, int, int]:
        """The smallest device limit a fit works under, from a warm-up traced without one: ``(shards, chunks,
        activations)``, their sum the limit.

        [Note: the smallest limit plan names]
        A limit refused before the warm-up has traced anything names a lower bound, "plus the activations", and sends
        the user to ``lightning-chunk plan`` for the smallest limit that fits. But plan's dry run ran under the same
        limit, was refused at the same place and printed the same bound: the example GPT (tied head, 4 blocks of
        width 128) named 289,792 bytes, then 551,936 at the first gather in backward (the tied chunk is in use from the
        head's backward to the embedding's), then 4,629,792 once a warm-up traced its activations: three tries.
        So a refused dry run is followed by one without the limit, and this is computed from its trace: the layout
        the automatic size falls to under a tight limit (chunks as small as the largest parameter; the user's
        ``chunk_numel`` where one is set) packed in the traced order of use, the shards the placement keeps on the
        device whatever the limit (``static``, ``device``; none for ``auto`` and ``host`` at their smallest), the
        chunks the busiest moment needs at once with a gradient payload, and the traced activations: what the
        check after a warm-up under that limit asks, so a fit under it passes that check with this layout or a
        coarser one that also fits. ``plan`` then checks the number with a dry run at it."""
        specs = self.manager.specs
        cap = self.config.chunk_numel or max((s.numel for s in specs), default=1)
        layout = build_layout(specs, trace.first_use_order(len(self.manager.params)), cap, self.comm.world_size)
        views = planned_views(layout, self.manager.dtypes, self._optim_bytes)
        trace = trace.remap({i: s.chunk_id for i, s in layout.slot_of().items()})
        shards, held = device_shards(views, self.policy.shard_tiers(views, trace, 0), self.comm.world_size)
        chunks, activations = smallest_working_limit(views, trace, held)
        return shards, chunks, activations

    def _host_limit_numel(self) -> int | None:
        """With ``host_memory_limit``: the largest chunk whose disk shards, two paged in at once, take at most half
        the limit (the rest holds host shards), so the automatic chunk size never makes the limit too small."""
        limit = self.config.host_memory_limit
        specs = self.manager.specs
        if limit is None or not specs:
            return None
        dtypes = self.manager.dtypes
        per_elem = max(
            2
            * torch.empty(
                (), dtype=dtypes.master_for(s.key.dtype, trainable=s.key.requires_grad, own_dtype=s.key.own_dtype)
            ).element_size()
            + self._optim_bytes.get(s.key.group, 0)
            for s in specs
        )  # master, gradient, optimizer state
        return max(limit * self.comm.world_size // (4 * per_elem), max(s.numel for s in specs))

    def need_before_trace(
        self, layout: Layout, views: list[ChunkView], modules: int = 1, held: frozenset[int] = frozenset()
    ) -> int:
        """Device bytes the busiest module needs before any activation: its chunks (and the root's), plus a
        whole chunk's gradient payload with several ranks; with ``modules=2``, the two busiest modules' chunks.
        ``held``: chunks whose payload a device shard holds ([Note: the shards a placement keeps on the device])."""
        slot_of = layout.slot_of()
        payload = {v.chunk_id: 0 if v.chunk_id in held else v.payload_bytes for v in views}

        def chunk_bytes(params: tuple[int, ...]) -> int:
            return sum(payload[c] for c in {slot_of[i].chunk_id for i in params})

        root_bytes = chunk_bytes(self.owned.get(ROOT, ()))
        need = sum(sorted((chunk_bytes(own) for own in self.owned.values()), reverse=True)[:modules]) + root_bytes
        return need + max((v.grad_payload_bytes for v in views), default=0)

    def check_limit_before_trace(self, layout: Layout, views: list[ChunkView], tiers: dict[int, Tier]) -> None:
        """Before anything is allocated: a limit that cannot hold one module's chunks beside the shards the placement
        keeps on the device is refused."""
        limit = self.manager.limit
        if limit is None:
            return
        shards, held = device_shards(views, tiers, self.comm.world_size)
        need = self.need_before_trace(layout, views, held=held)
        if shards + need > limit:
            # the automatic size was already lowered as far as it goes (to the largest parameter) before this
            chosen = self.config.chunk_numel is not None
            on_device, remedy = shards_note(self.config.placement, shards, tiers.values())
            raise DeviceMemoryLimitError(
                f"{self.manager.ledger.named_limit()} is too small: one module needs {format_bytes(need)} of "
                f"chunks at once ({describe(layout)} in all"
                + (", with a gradient payload for backward" if self.comm.world_size > 1 else "")
                + ")"
                + (f" beside {on_device}" if on_device else "")
                + ", before any activations. The smallest limit that could work is "
                + f"{format_bytes(shards + need)}{PLUS_ACTIVATIONS}"
                + (
                    "; or lower chunk_numel"
                    if chosen
                    else " (chunk_numel=None already chose chunks as small as the largest parameter)"
                )
                + (f"; or {remedy}" if remedy else "")
                + ".",
                self.manager.device,
            )

    def check_placement(self, views: list[ChunkView], tiers: dict[int, Tier]) -> None:
        """Before a (re)pack: the shards the placement puts on the device, beside the largest host payload fetched,
        must fit the limit."""
        limit = self.manager.limit
        if limit is None:
            return
        on_device = sum(v.device_shard_bytes for v in views if tiers[v.chunk_id] is Tier.DEVICE)
        host_payload = max((v.payload_bytes for v in views if tiers[v.chunk_id] is not Tier.DEVICE), default=0)
        if on_device and on_device + host_payload > limit:
            raise DeviceMemoryLimitError(
                f"placement={self.config.placement!r} puts {on_device} bytes of shards on the device "
                f"({sum(t is Tier.DEVICE for t in tiers.values())} of {len(views)} chunks)"
                + (f" and must fetch host payloads of up to {host_payload} bytes" if host_payload else "")
                + f", more than {self.manager.ledger.named_limit()}; raise the limit, raise offload_fraction "
                "(static) or use placement='auto' or 'host'.",
                self.manager.device,
            )
