"""Each phase's peak device and host bytes a rank, predicted from the layout alone: ``lightning-chunk plan``'s
cluster view (``--nodes 2 --devices 8 --device-memory 80GiB --host-memory 1TiB``).

[Note: host memory by phase]
What a rank holds, phase by phase, written from the code that runs in it and checked against a run at 2 and 4 ranks
(``tests/scale/test_phases.py``). All per rank: S is the rank's training state (its shards' masters, compute
copies, gradients and optimizer state), S_host and S_dev the parts on the host and on the device before the warm-up
("first") and after it; O the optimizer state in S; C the largest chunk's whole values in the master dtype; G the
busiest module's chunks, a prefetched chunk and three gradient payloads (one filling, two reducing), as the
placement reserves them ([Note: the pool under a limit] in placement.py).
- set-up: S less O (Adam makes its state at its first step) + 3C, + C with several ranks; stepping in backward, less
  the host gradient shards too, whose memory is never touched ([Note: gradient shards made for their views] in
  ``engine/tiers/tier_set.py``). Deferred init and weights
  read from a file build one chunk at a time, whole (its values, the chunk, and rank 0's values broadcast to the
  others), then keep this rank's shard ([Note: deferred initialisation]).
- warm-up step: S_host(first) less O on the host (under ``auto`` with a limit every shard starts there); G and the
  activations on the device.
- warm-up repack: S_host(first) + S_dev(first) less O (no optimizer state yet, a resumed one included: [Note:
  optimizer state read after the warm-up]) + 6C and a payload: the old device shards staged, the chunks streamed
  one at a time ([Note: a repack under a device limit]), up to two old chunks' values and gradients whole (4C: all-
  gathered with several ranks, read in place with one) while a new one is built beside them (its shard, written in
  place, and its payload; [Note: reading an old chunk in place]).
- training step: S_host(after) + the gradient staging in flight (pinned, at most 256 MiB, on CUDA only), or, at a
  resumed fit's first step, 3C: its optimizer state read one saved chunk's span at a time. On the
  device S_dev(after), the activations, and every payload the limit has room for beside them: a gathered payload
  stays until the budget needs its room (``auto``, ``static`` and ``device`` evict only then; ``host`` keeps it
  for backward, [Note: keeping payloads for backward]), so a step under a limit fills it. Only ``host`` with
  ``reshard_after_forward=True`` holds no more than G.
- save: S_host(after) + one file's shards, two chunks' masters and optimizer state: each is made when the writer
  reaches it ([Note: a save streams the shards]).
- resume: S_host(first) less O + 3C: the values one saved chunk's span at a time ([Note: a resume reads what the
  rank holds]); the optimizer state waits for the first step. After the set-up's peak.
- end of fit: where the model fits ([Note: the model after fit]), the device part of O copied to the host for a
  later ``save_checkpoint`` ([Note: optimizer state after fit]; the host part is kept as it is), then the whole
  model, built chunk by chunk as the shards go; where it does not, the shards as they go.
With ``step_in_backward=True`` the gradient shards are given back before the first backward and after each step:
the training step, the save, the resume and the end of fit hold S less them, plus four chunks' gradient shards in
a step.
``None`` is counted as stepping after backward: a fit that clips by norm does.
With a ChunkEMA (``plan --ema``, or one among a config's callbacks) its average E, each trainable chunk's shard in
its master dtype (4 bytes a trainable parameter over the ranks in fp32), is held from the first update on: the
training step (with the update's 4 MiB block), the save, the resume and the end of fit hold E more; a resumed fit's
repack carries it (E, an old chunk's average whole and cut, 2C, and a byte an element marking what was filled,
E/4). Under a host limit E is in files ([Note: the average under a host limit]) and those phases hold one chunk's
average paged in instead; the masks stay in memory.
A save written in the background (Lightning's ``AsyncCheckpointIO``; ``plan --async-save``, or one among a config's
``trainer.plugins``) returns once staged, and the next step copies aside every item the writer has not read before
it changes it ([Note: training beside a save]): the save row is a training step beside up to the whole saved state
(each shard's master and optimizer state, and E) copied, as DCP's own asynchronous save stages a whole copy (on a GPU
the device shards' copies pinned, as the host shards are). Under a host limit training waits for the writer instead,
and the row is the synchronous save's.
On a GPU the host shards' master, compute copy and gradient are pinned, in torch's power-of-two blocks (P more,
which every phase holding them counts: 2.5 GiB a rank for Llama 2 7B on 8 ranks, 63 GiB for 70B; none with
``pin_memory="exact"``; [Note: pinned blocks a repack leaves behind]). Stepping in backward, a pinned gradient
shard is given back as a pageable one is, into a host pool that keeps at most four of a size between steps (the four
chunks' gradient shards above, held through the save too: [Note: gradient shards pinned to the byte]).
The bound: S + P + 4C(1 + k), + 1.25E with a ChunkEMA (in files: E/4 and a chunk's average). Every phase stays under
it but the end of fit where the model fits, which holds the whole model beside O by design (the weights a user
reads after ``fit``, as with DDP), and a background save's copies aside. Device bytes are before activations
unless the caller gives them (a shapes-only plan traces none; ``plan --activations``).
``together``: the peak of the two at once, what one memory holds where the device is the host (a CPU run).
"""

from __future__ import annotations

from dataclasses import dataclass

from .engine.chunks.chunk import Tier
from .engine.config import human_bytes
from .engine.memory.grads import IN_FLIGHT
from .engine.optim.ema import BLOCK as EMA_BLOCK
from .engine.runtime.description import ShapePlan
from .engine.schedule.placement import device_first

GRAD_STAGING = 256 << 20  # GradOffload's pinned staging in flight at most


def pinned_rounding(plan: ShapePlan, low_bytes: int) -> dict[int, tuple[int, int]]:
    """Bytes torch's caching host allocator adds to each chunk's shard on a GPU, ``(in host memory, on disk)``: a
    host shard's master, compute copy and gradient are pinned (a disk shard's compute copy alone), and it rounds
    every pinned block up to a power of two ([Note: pinned blocks a repack leaves behind] in
    ``engine/system/host_heap.py``); the optimizer state is pageable. ``low_bytes``: the compute copy's bytes an
    element (0: none)."""
    out = {}
    for spec in plan.layout.chunks:
        n = spec.capacity_numel // plan.layout.world_size
        master = n * spec.key.dtype.itemsize
        low = 0 if spec.key.own_dtype else n * low_bytes
        out[spec.chunk_id] = (_rounding([master, low, master if spec.key.requires_grad else 0]), _rounding([low]))
    return out


def save_copy_rounding(plan: ShapePlan, tiers: dict[int, Tier], states: int) -> int:
    """Bytes torch's caching host allocator adds to a background save's pinned copies of the device shards
    ([Note: training beside a save]): a chunk's master and each of its ``states`` optimizer states, master-sized."""
    total = 0
    for spec in plan.layout.chunks:
        if tiers[spec.chunk_id] is Tier.DEVICE:
            master = spec.capacity_numel // plan.layout.world_size * spec.key.dtype.itemsize
            total += _rounding([master] * (1 + (states if spec.key.requires_grad else 0)))
    return total


def _rounding(blocks: list[int]) -> int:
    """What rounding each block up to a power of two adds."""
    return sum((1 << (b - 1).bit_length()) - b for b in blocks if b)


@dataclass(frozen=True)
class Phase:
    name: str
    device: int  # bytes a rank, before activations
    host: int  # bytes a rank
    together: int  # device and host bytes at once (a CPU run, where they are one memory)


@dataclass
class ClusterReport:
    model: str
    precision: str
    nodes: int
    devices: int
    device_limit: int | None  # a rank
    host_memory: int | None  # a node
    phases: list[Phase]
    bound: int  # host bytes a rank no phase may pass
    state: int  # S
    device_shards_after: int
    chunks: int
    shard_size: int | None = None  # ranks a chunk is sharded over, where fewer than every rank
    average: int = 0  # a ChunkEMA's bytes a rank (E)
    average_in_files: bool = False
    background_save: bool = False  # the save row is a step beside a background save's copies aside
    pinned_rounding: int = 0  # host bytes a rank torch's pinned allocator adds to the host shards, at most

    @property
    def host_per_rank(self) -> int | None:
        return None if self.host_memory is None else self.host_memory // self.devices

    @property
    def binds(self) -> list[str]:
        out = []
        if self.device_limit is not None and max(p.device for p in self.phases) > self.device_limit:
            out.append("device")
        if self.host_per_rank is not None and max(p.host for p in self.phases) > self.host_per_rank:
            out.append("host")
        return out

    @property
    def fits(self) -> bool:
        return not self.binds

    def render(self) -> str:
        g = human_bytes
        ranks = self.nodes * self.devices
        lines = [
            f"model        {self.model}, precision {self.precision}: {self.nodes} node(s) x {self.devices} "
            f"device(s) = {ranks} ranks"
            + (f" in shard groups of {self.shard_size}" if self.shard_size else "")
            + f"; {self.chunks} chunks, {self.device_shards_after} shards on the device after the warm-up",
            f"a rank       training state {g(self.state)}; device limit "
            f"{'none' if self.device_limit is None else g(self.device_limit)}; host "
            f"{'unknown' if self.host_per_rank is None else g(self.host_per_rank)} (a node's share)"
            + (
                f"; ChunkEMA's average {g(self.average)} "
                + ("in files under disk_dir" if self.average_in_files else "in host memory")
                if self.average
                else ""
            )
            + ("; saves in the background, their shards copied aside by the next step" if self.background_save else ""),
            "",
            f"{'phase':<16}{'device a rank':>16}{'host a rank':>16}{'host a node':>16}",
        ]
        for p in self.phases:
            lines.append(f"{p.name:<16}{g(p.device):>16}{g(p.host):>16}{g(p.host * self.devices):>16}")
        lines += [
            "",
            f"host bound   {g(self.bound)} a rank (training state"
            + (" + its pinned blocks' rounding" if self.pinned_rounding else "")
            + " + 4 whole chunks with their optimizer state); device bytes are before activations",
        ]
        if self.pinned_rounding:
            lines.append(
                f"pinned       host shards in torch's power-of-two pinned blocks: up to {g(self.pinned_rounding)} a "
                "rank more, counted above (offload=OffloadOptions(pin_memory='exact'): to the byte)"
            )
        worst_d = max(self.phases, key=lambda p: p.device)
        worst_h = max(self.phases, key=lambda p: p.host)
        if self.binds:
            lines.append(
                "binds        "
                + " and ".join(
                    f"{b}: {worst_d.name if b == 'device' else worst_h.name} needs "
                    f"{g(worst_d.device if b == 'device' else worst_h.host)} of "
                    f"{g(self.device_limit if b == 'device' else self.host_per_rank)}"  # type: ignore[arg-type]
                    for b in self.binds
                )
            )
        else:
            left = [
                f"device {g(self.device_limit - worst_d.device)} left at {worst_d.name}"
                if self.device_limit is not None
                else "",
                f"host {g(self.host_per_rank - worst_h.host)} left at {worst_h.name}"
                if self.host_per_rank is not None
                else "",
            ]
            said = "; ".join(x for x in left if x) or "no limit to check: give --device-memory and --host-memory"
            lines.append(f"fits         {said} (before activations)")
        return "\n".join(lines)


def final_tiers(
    plan: ShapePlan, placement: str, activations: int = 0, *, beside_backward: bool = False
) -> dict[int, Tier]:
    """The tiers after the warm-up, without its trace: ``auto`` under a limit puts shards on the device in
    ``device_first``'s order ([Note: which chunks the host gets]) while they leave the busiest module, a prefetch,
    three gradient payloads and ``activations`` room; other placements keep their first tiers."""
    if placement != "auto" or plan.limit is None:
        return dict(plan.tiers)
    views = plan.views
    reserve = (
        plan.need_before_activations
        + max((v.payload_bytes for v in views), default=0)
        + 3 * max((v.grad_payload_bytes for v in views), default=0)
    )
    room = plan.limit - reserve - activations
    tiers = {v.chunk_id: (Tier.DISK if plan.tiers[v.chunk_id] is Tier.DISK else Tier.HOST) for v in views}
    for v in device_first(views, beside_backward=beside_backward):
        if tiers[v.chunk_id] is Tier.HOST and v.device_shard_bytes <= room:
            tiers[v.chunk_id] = Tier.DEVICE
            room -= v.device_shard_bytes
    return tiers


def phases(
    plan: ShapePlan,
    *,
    placement: str,
    model_bytes: int,
    optim_ratio: float,
    host_per_rank: int | None,
    optim_share: float,
    ranks: int,
    staging: bool = True,
    releases: bool = False,
    activations: int = 0,
    grad_share: float = 0.0,
    average: int = 0,
    average_in_files: bool = False,
    save_share: float = 0.0,
    background_save: bool = False,
    pinned_low_bytes: int | None = None,
    exact_pinning: bool = False,
    beside_backward: bool = False,
) -> tuple[list[Phase], int, int, dict[int, Tier], int]:
    """The rows of [Note: host memory by phase], the host bound and the training state, the tiers after the
    warm-up, and the pinned allocator's rounding at most. ``optim_ratio``: optimizer state bytes per master byte
    (Adam in fp32: 2); ``optim_share``: the part of a shard that is its optimizer state; ``staging``: gradients
    leave the device through pinned staging (CUDA); ``releases``: payloads go after each use (``host`` placement
    with ``reshard_after_forward=True``); ``activations``: a step's activation peak, a rank, when known (the
    warm-up's trace), added to the steps' device bytes; ``grad_share``: the part of a shard that is its gradient,
    given back after each step where each chunk steps in backward (0: kept, stepping after backward); ``average``: a
    ChunkEMA's bytes a rank (``ShapePlan.average_bytes``), in files under a host limit with ``average_in_files``;
    ``save_share``: the part of a shard a save writes (its master and optimizer state); ``background_save``: saves
    are written beside training, which copies aside what the writer has not read (never under a host limit);
    ``pinned_low_bytes``: host shards are pinned (a GPU), their compute copy this many bytes an element, in torch's
    power-of-two blocks, or to the byte with ``exact_pinning`` (``pin_memory="exact"``); ``beside_backward``: host
    chunks step beside backward (``final_tiers``)."""
    views = plan.views
    after = final_tiers(plan, placement, activations, beside_backward=beside_backward)

    def on(tiers: dict[int, Tier], tier: Tier) -> int:
        return sum(
            (v.host_bytes_on_disk if tiers[v.chunk_id] is Tier.DISK else v.device_shard_bytes)
            for v in views
            if (Tier.HOST if tiers[v.chunk_id] is Tier.DISK else tiers[v.chunk_id]) is tier
        )

    rounding = {} if pinned_low_bytes is None or exact_pinning else pinned_rounding(plan, pinned_low_bytes)

    def pinned_extra(tiers: dict[int, Tier]) -> int:  # the pinned allocator's rounding of the shards in memory
        return sum(
            rounding.get(cid, (0, 0))[(Tier.HOST, Tier.DISK).index(t)]
            for cid, t in tiers.items()
            if t is not Tier.DEVICE
        )

    # C: several ranks build a trainable chunk whole in its master dtype (a gradient summed in bf16 is half that)
    whole = (plan.master_chunk_bytes if ranks > 1 else 0) or max((v.payload_bytes for v in views), default=0)
    # stepping in backward, the gradient shards are given back after each step: a few chunks' are held in a step
    # (those landing and those waiting for the step thread), none between steps nor before the first backward (the
    # warm-up steps after backward)
    in_flight = IN_FLIGHT * whole // ranks if grad_share else 0

    def steady(nbytes: int) -> int:
        return nbytes - int(nbytes * grad_share)

    host_first, dev_first = on(plan.tiers, Tier.HOST), on(plan.tiers, Tier.DEVICE)
    host_after = steady(on(after, Tier.HOST))
    dev_after = steady(on(after, Tier.DEVICE))
    payload = max((v.payload_bytes for v in views), default=0)
    state = sum(v.device_shard_bytes for v in views)
    steady_state = steady(state)
    optim = int(state * optim_share)
    grads = 3 * max((v.grad_payload_bytes for v in views), default=0)
    busy = plan.need_before_activations + payload + grads
    step = dev_after + busy + in_flight
    if not releases:  # payloads stay while the limit has room beside the activations (see the note)
        # every payload not already a device shard (one rank: a device shard is its own payload), the busiest
        # module's among them, and the gradients in flight
        kept = (
            dev_after
            + in_flight
            + grads
            + sum(v.payload_bytes for v in views if not (ranks == 1 and after[v.chunk_id] is Tier.DEVICE))
        )
        step = max(step, kept if plan.limit is None else min(plan.limit - activations, kept))
    built = (3 + (ranks > 1)) * whole
    fits = host_per_rank is None or model_bytes + optim <= 0.8 * host_per_rank
    staged = min(GRAD_STAGING, dev_after + host_after) if staging else 0
    # a save's file: two chunks' shards, each its master and optimizer state ([Note: a save streams the shards])
    written = 2 * int(whole / ranks * (1 + optim_ratio))
    optim_dev, optim_host = int(dev_after * optim_share), int(host_after * optim_share)
    no_optim = 1 - optim_share
    no_kept = no_optim - grad_share  # a resume: no optimizer state yet, the gradient shards given back at set-up
    repacking = 6 * whole + payload  # two old chunks whole (4C) while a new one is built (its shard, its payload)
    # a ChunkEMA's average (see the note): held in memory, or one chunk's paged in from its file at a time
    ema = (plan.master_chunk_bytes // ranks if average_in_files else average) if average else 0
    scratch = min(average, EMA_BLOCK * 4)  # an update's block
    if average:
        # a resumed fit's repack carries it, an old chunk's whole and cut, and a byte an element of which were filled
        repacking += ema + average // 4 + 2 * whole
    if fits:  # the device state copied beside the shards; then the kept state beside the model as it grows
        end_host = max(host_after + optim_dev, optim + max(host_after - optim_host, model_bytes) + 2 * whole)
        end_together = max(steady_state + optim_dev, optim + max(steady_state - optim, model_bytes) + 2 * whole)
    else:
        end_host, end_together = host_after + whole, steady_state + whole
    end_host, end_together = end_host + ema, end_together + ema  # the average stays until the engine goes
    # on a GPU the pinned allocator's rounding of the host shards, in the first tiers and after the warm-up
    pin_first, pin_after = pinned_extra(plan.tiers), pinned_extra(after)
    pin_most = max(pin_first, pin_after)
    step_host = host_after + pin_after + max(in_flight + staged, 3 * whole) + ema + scratch
    step_together = host_after + step + activations + ema + scratch
    save = Phase(
        "save",
        dev_after + plan.need_before_activations,
        host_after + pin_after + in_flight + written + ema,
        steady_state + in_flight + written + ema,
    )
    if background_save:  # the next step beside every saved item copied aside (see the note)
        aside = int(save_share * state) + average
        if rounding:  # the device shards' copies are pinned blocks too
            aside += save_copy_rounding(plan, after, round(optim_ratio))
        save = Phase("save", step + activations, step_host + aside, step_together + aside)
    rows = [
        Phase(
            "set-up",
            int(dev_first * no_optim) + payload,
            int(host_first * no_kept) + pin_first + built,
            int(state * no_optim) + built,
        ),
        Phase(
            "warm-up step",
            dev_first + busy + activations,
            int(host_first * no_optim) + pin_first,
            int(state * no_optim) + busy + activations,
        ),
        Phase(
            "warm-up repack",
            int(dev_after * no_optim) + payload,
            int((host_first + dev_first) * no_optim) + pin_most + repacking,
            int(state * no_optim) + repacking,
        ),
        Phase("training step", step + activations, step_host, step_together),
        save,
        Phase(
            "resume",
            int(dev_first * no_kept) + payload,
            int(host_first * no_kept) + pin_first + 3 * whole + ema,
            int(state * no_kept) + 3 * whole + ema,
        ),
        Phase("end of fit", 0, end_host + pin_after, end_together),
    ]
    bound = state + pin_most + int(4 * whole * (1 + optim_ratio)) + ema + average // 4
    return rows, bound, state, after, pin_most
