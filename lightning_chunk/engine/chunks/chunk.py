"""One chunk: a flat payload that parameters are views into, and this rank's shard.

[Note: chunk tensors]
``payload``  capacity_numel elements, compute dtype, on the compute device. Every packed parameter is a view
             ``payload[offset:offset+numel].view(shape)`` (set through ``param.data``, so the ``Parameter`` object
             never changes). Released by resizing its storage to 0; re-filled in place, so views and tensors that
             autograd saved see the data again. While it is released the parameters show a placeholder instead
             ([Note: a released parameter] in ``parked.py``).
``master``   this rank's shard (``capacity_numel / world_size`` elements) in the master dtype, on the shard's
             tier. The source of truth the optimizer steps.
``low``      the compute-dtype copy of the shard that gathers read. It is ``master`` itself when the dtypes agree,
             and the payload itself when the chunk is *aliased* (one rank, shard on the device: the payload *is*
             the shard, so an all-resident fp32 run copies nothing at all).
``grad_payload``  several ranks only: the whole chunk's gradients in the master dtype (or ``reduce_dtype``), on
             the device, filled by this rank's backward and reduce-scattered into every rank's ``grad`` (then freed).
``grad``     gradient accumulator for the shard, master dtype, on the shard's tier; allocated with the chunk and
             kept (no allocation churn per step). The first gradient a parameter gets in a step overwrites its
             range, later ones add; ``TensorInfo.has_grad`` says which ranges are live.
Optimizer state (Adam's moments) is created by the optimizer next to ``master``; the chunk reserves its bytes
(``optim_state_bytes``) on the shard's tier so the accounting sees it before it exists.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ChunkError
from ..system import torch_features
from .packing import ChunkSpec, Slot
from .parked import engine_reads, released_placeholder, show
from .states import PINNED_STATES, RESIDENT_STATES, TensorState, check_transition

if TYPE_CHECKING:  # only a type here: the manager owns the pool
    from ..tiers.pool import BlockPool

_PINNED = tuple(PINNED_STATES)  # membership by identity: a frozenset hashes each enum member in Python
_NOT_RESIDENT = tuple(s for s in TensorState if s not in RESIDENT_STATES)  # the table's, as a tuple (identity)
_WAITING = (TensorState.READY_FOR_REDUCE, TensorState.READY_FOR_REDUCE_FREE)
# a stamp a state change, increasing process-wide: what changed since a plan is what was stamped after it
# ([Note: backward moments with nothing to release] in runtime/moments.py)
STAMPS = itertools.count(1)


class Tier(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"  # master, gradient shard and optimizer state in files; the compute-dtype copy on the host

    __hash__ = object.__hash__  # the ledger's keys: as ``TensorState``'s (states.py)


class Role(str, enum.Enum):
    """Which of a shard's buffers a tier holds: the fp32 master, the compute-dtype copy, the gradient accumulator,
    the optimizer's state, the average of the weights (``ChunkEMA``'s, in a file under a host limit). A ``str`` so
    that a role names its disk file (``chunk3-0-grad.bin``) as it is."""

    MASTER = "master"
    LOW = "low"
    GRAD = "grad"
    OPTIM = "optim"
    EMA = "ema"

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class InFlight:
    """A prefetch into a chunk's payload that has not landed: an asynchronous all-gather (with the source it
    reads, which must live until it lands) or, on CUDA, a copy on the side stream marked by an event."""

    work: Any | None = None  # collectives.Pending
    source: torch.Tensor | None = None
    event: Any | None = None  # torch.cuda.Event

    def wait(self, device: torch.device) -> None:
        if self.work is not None:
            self.work.wait()
        if self.event is not None:
            torch.cuda.current_stream(device).wait_event(self.event)


def lost_write(info: TensorInfo, chunk_id: int, when: str, *, through_data: bool = False) -> ChunkError:
    """A parameter written in place into a payload that is a copy of its shard ([Note: parameters outside a step]
    in ``full_params.py``): the write would be lost when the payload is gathered, written back or released.
    ``through_data``: seen by its values, not its version counter ([Note: writes through .data] there)."""
    how, seen = (
        ("through .data", "p.data.clamp_(), p.data.mul_(): its values changed where the engine wrote nothing")
        if through_data
        else ("in place", f"its version counter went from {info.version} to {info.param._version}")
    )
    return ChunkError(
        f"parameter {info.name!r} was written {how} {when} ({seen}), into chunk {chunk_id}'s payload, a copy of the "
        "sharded weights that the next gather, release or optimizer write-back overwrites: the write would be lost. "
        "In a forward, nn.Embedding(max_norm=...) renormalises the rows it looks up in place: leave max_norm=None and "
        "renormalise in on_train_batch_start. Write parameters inside `with trainer.strategy.full_parameters():` "
        "(ChunkOffloadStrategy.full_parameters; docs/faq.md, 'Reading or writing parameters between steps')."
    )


def replaced_data(info: TensorInfo, chunk_id: int, when: str) -> ChunkError:
    """``p.data = x`` where the payload is a copy of the shard ([Note: a replaced .data])."""
    new = info.param.data
    shape = "" if new.shape == info.shape else f" with shape {tuple(new.shape)} (its own is {tuple(info.shape)})"
    return ChunkError(
        f"parameter {info.name!r} had its .data replaced {when}{shape}: between its uses a parameter's .data "
        f"is a view of chunk {chunk_id}'s payload, a copy of the sharded weights (or a placeholder of NaN once "
        "released), and the next gather points it back there, so the value assigned would be lost. Assign inside "
        "`with trainer.strategy.full_parameters():` on every rank, where `p.data = ...` and in-place writes under "
        "torch.no_grad() go into the shards (docs/faq.md, 'Reading or writing parameters between steps')."
    )


def storage_of(t: torch.Tensor) -> int:
    """The storage ``t`` views: the same across a resize or a pool swap, another after ``p.data = x``."""
    return int(t.untyped_storage()._cdata)


@dataclass(eq=False)
class TensorInfo:
    """One parameter packed in a chunk."""

    param: torch.nn.Parameter = field(repr=False)  # never print: its storage may be released
    name: str
    slot: Slot
    shape: torch.Size
    orig_dtype: torch.dtype
    state: TensorState = TensorState.FREE
    has_grad: bool = False  # a gradient arrived since the last step
    grads_due: int = 1  # the pieces this backward brings its gradient in, and those that came ([Note: gradients in
    grads_got: int = 0  # pieces] in runtime/pieces.py)
    view: torch.Tensor | None = field(default=None, repr=False)  # the parameter's view of the payload
    version: int = 0  # the parameter's _version when last pointed at its view ([Note: parameters outside a step])
    storage: int = 0  # the storage its .data viewed then ([Note: a replaced .data])
    looked: torch.Tensor | None = field(default=None, repr=False)  # its view's bits when read between steps
    released_value: torch.Tensor | None = field(default=None, repr=False)  # [Note: a released parameter]

    def pointed(self) -> None:
        """The parameter's ``.data`` was just set by the engine: take its version counter and storage, and drop
        the note of what a read between steps saw ([Note: writes through .data] in full_params.py)."""
        self.version = self.param._version
        self.storage = storage_of(self.param)
        self.looked = None

    def replaced(self) -> bool:
        """Whether ``.data`` was assigned since the engine last set it ([Note: a replaced .data])."""
        return storage_of(self.param) != self.storage

    @property
    def offset(self) -> int:
        return self.slot.offset

    @property
    def numel(self) -> int:
        return self.slot.numel

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def held(t: torch.Tensor | None) -> int:
    """``nbytes``, or 0 where the buffer's memory was given back (its storage holds none)."""
    return 0 if t is None or t.untyped_storage().nbytes() == 0 else nbytes(t)


@dataclass(eq=False)
class Chunk:
    spec: ChunkSpec
    capacity_numel: int
    rank: int
    world_size: int
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    # tensors stay out of repr: printing a released payload would read freed memory
    tensors: list[TensorInfo] = field(default_factory=list, repr=False)
    payload: torch.Tensor | None = field(default=None, repr=False)
    shard_tier: Tier = Tier.HOST
    aliased: bool = False
    master: torch.Tensor | None = field(default=None, repr=False)
    low: torch.Tensor | None = field(default=None, repr=False)  # only when it is a buffer of its own
    grad: torch.Tensor | None = field(default=None, repr=False)
    # one rank, stepped in backward: this step's gradients in the compute dtype ([Note: gradients in bf16 until the
    # step] in memory/low_grads.py), while ``grads_in_low``; given back to the host pool with the step
    grad_low: torch.Tensor | None = field(default=None, repr=False)
    grads_in_low: bool = False
    optim_state_bytes: int = 0
    last_used: int = -1  # manager clock, for LRU when there is no trace
    pending: InFlight | None = field(default=None, repr=False)  # a prefetch in flight
    grad_payload: torch.Tensor | None = field(default=None, repr=False)  # several ranks: gradients to reduce
    grad_written: bool = False  # several ranks: the gradient shard holds this step's reduced gradients
    # the gradient shard's values are gone, its memory given back where it can be (a disk file keeps its bytes, and so
    # does a pinned one after a speculated step), until the next gradient ([Note: stepping in backward])
    grad_released: bool = False
    # a released gradient buffer that kept its bytes with its pages advised free: held by no one, counted nowhere
    # ([Note: gradient buffers the kernel may take] in system/host_heap.py)
    grad_lazy: bool = False
    grad_low_lazy: bool = False
    params_parked: bool = False  # the parameters show placeholders ([Note: a released parameter])
    master_seen: tuple[int, int] | None = None  # [Note: the optimizer's views written outside its step]
    reduce_dtype: torch.dtype | None = None  # several ranks: the gradient payload's dtype; None: the master's
    changed_at: int = field(default_factory=lambda: next(STAMPS), repr=False)  # the stamp of its last state change

    @property
    def grad_payload_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.master_dtype

    # ----------------------------------------------------------------- identity
    @property
    def chunk_id(self) -> int:
        return self.spec.chunk_id

    @property
    def shard_numel(self) -> int:
        return self.capacity_numel // self.world_size

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    @property
    def payload_bytes(self) -> int:
        return self.capacity_numel * self.compute_dtype.itemsize

    @property
    def grad_payload_bytes(self) -> int:
        return self.capacity_numel * self.grad_payload_dtype.itemsize

    @property
    def trainable(self) -> bool:
        return self.spec.key.requires_grad

    # ------------------------------------------------------------ derived state
    @property
    def is_resident(self) -> bool:
        return self.tensors[0].state not in _NOT_RESIDENT if self.tensors else False

    @property
    def payload_allocated(self) -> bool:
        return self.payload is not None and self.payload.untyped_storage().nbytes() > 0

    @property
    def is_evictable(self) -> bool:
        """Resident, not in use, not waiting to reduce, and not the shard itself."""
        return not self.aliased and self.is_resident and not any(t.state in _PINNED for t in self.tensors)

    @property
    def waits_only_to_reduce(self) -> bool:
        """Resident, pinned by gradients that wait to reduce and by nothing else: its payload may go under memory
        pressure ([Note: a gradient waits without its payload] in ``states.py``)."""
        return (
            not self.aliased
            and self.is_resident
            and any(t.state is TensorState.READY_FOR_REDUCE for t in self.tensors)
            and not any(t.state is TensorState.COMPUTE for t in self.tensors)
        )

    def states(self) -> dict[str, TensorState]:
        return {t.name: t.state for t in self.tensors}

    # ------------------------------------------------------------- transitions
    def set_state(self, info: TensorInfo, new: TensorState) -> None:
        check_transition(info.state, new, param_name=info.name, chunk_id=self.chunk_id, rank=self.rank)
        info.state = new
        self.changed_at = next(STAMPS)

    def transition_all(self, new: TensorState, *, only_from: frozenset[TensorState] | None = None) -> None:
        for info in self.tensors:
            if only_from is None or info.state in only_from:
                if info.state is not new or new is TensorState.COMPUTE:
                    self.set_state(info, new)

    def grads_complete(self) -> bool:
        """Every tensor that expects a gradient has delivered it this backward, in all its pieces."""
        return all(
            t.state in _WAITING and (t.grads_due == 1 or t.grads_got >= t.grads_due)
            for t in self.tensors
            if t.requires_grad
        )

    def has_waiting_grads(self) -> bool:
        return any(t.state in _WAITING for t in self.tensors)

    def gathered(self) -> None:
        """The payload holds the parameters again: FREE -> HOLD, a waiting gradient's tensor -> READY_FOR_REDUCE;
        the parameters are views of the payload again."""
        for info in self.tensors:
            new = TensorState.READY_FOR_REDUCE if info.state is TensorState.READY_FOR_REDUCE_FREE else TensorState.HOLD
            if info.state is not new:
                self.set_state(info, new)
        if self.params_parked:
            self.params_parked = False
            self.point_params()

    def released(self) -> None:
        """The payload is gone: -> FREE, a waiting gradient's tensor -> READY_FOR_REDUCE_FREE; the parameters show
        placeholders ([Note: a released parameter])."""
        for info in self.tensors:
            new = TensorState.READY_FOR_REDUCE_FREE if info.state in _WAITING else TensorState.FREE
            if info.state is not new:
                self.set_state(info, new)
        self.park_params()

    def park_params(self) -> None:
        if not self.params_parked:
            self.params_parked = True
            self.point_params()

    @engine_reads
    def point_params(self) -> None:
        """Each parameter's ``.data``: its payload view, or its placeholder while the payload is released; the
        version counter is taken again ([Note: parameters outside a step] in ``full_params.py``). A parameter written
        in place since it was last pointed raises, unless the payload keeps what is written (``master_is_payload``)."""
        check = not self.master_is_payload()
        for info in self.tensors:
            lost = self.keep_replaced(info, "during a step") if info.replaced() else None
            if lost is not None:
                raise lost
            if check and info.param._version != info.version:
                raise lost_write(info, self.chunk_id, "during a step")
            assert info.view is not None
            if self.params_parked and info.released_value is None:
                info.released_value = released_placeholder(info.shape, info.view.dtype, info.view.device)
            value = info.released_value if self.params_parked else info.view
            assert value is not None
            show(info.param, value, parked=self.params_parked)  # [Note: a parked parameter's class]
            info.pointed()

    def keep_replaced(self, info: TensorInfo, when: str) -> ChunkError | None:
        """[Note: a replaced .data]
        ``p.data = x`` (MoCo's momentum encoder, ``p.data = p.data.clamp(...)``) gives the parameter another storage
        and leaves its version counter as it was, so the check of in-place writes ([Note: parameters outside a
        step] in ``full_params.py``) never saw it: the next gather pointed ``.data`` back at the payload and the
        value was lost, or, on a resident payload, the forward read the assigned tensor while the optimizer stepped
        the shard. Each ``TensorInfo`` keeps the storage its parameter was last pointed at (``pointed``), compared
        where the version counters are. Where the payload *is* the master (one rank, fp32, on the device) the value
        is copied into it and trains, as in plain PyTorch; elsewhere the ``ChunkError`` returned names the parameter
        and ``full_parameters()``, which takes an assigned ``.data`` as the block's new value."""
        new = info.param.data
        if not (self.master_is_payload() and info.view is not None and new.shape == info.shape):
            return replaced_data(info, self.chunk_id, when)
        with torch.no_grad():
            info.view.copy_(new)
        show(info.param, info.view)
        info.pointed()
        return None

    def reduced(self, *, agreed: bool = False) -> None:
        """The chunk's gradients were reduced (or stay local inside ``no_sync``): nothing waits any more.
        ``agreed``: several ranks reduced it at a point they agree on; a trainable tensor still in use for a
        gradient this rank did not get is let go as on the ranks that got one ([Note: gradients some ranks lack]
        in ``reduce.py``)."""
        for info in self.tensors:
            if info.state is TensorState.READY_FOR_REDUCE:
                self.set_state(info, TensorState.HOLD_AFTER_BWD)
            elif info.state is TensorState.READY_FOR_REDUCE_FREE:
                self.set_state(info, TensorState.FREE)
            elif agreed and info.state is TensorState.COMPUTE and info.requires_grad:
                self.set_state(info, TensorState.HOLD_AFTER_BWD)

    # -------------------------------------------------------------------- bytes
    def release_grad(self, pool: BlockPool | None) -> None:
        """Give the gradient shard's memory to ``pool`` (kept for the next ``restore_grad`` of its size; to the
        allocator when ``None``); its views stay valid (and empty) until ``restore_grad`` ([Note: stepping in
        backward] in ``early_step.py``). Callers account it (``ChunkManager.ledger.tracked``)."""
        if self.grad is None or self.grad_released:
            return
        self.grad_released = True  # used up, whether or not its memory can go
        if self.shard_tier is Tier.DISK:  # a view of its file ([Note: stepping disk chunks in backward]): kept
            return
        storage = self.grad.untyped_storage()
        try:
            if pool is None:
                give_back(storage)
            else:
                self.grad_lazy = pool.empty(storage)
        except RuntimeError:  # an allocator that cannot resize it, and no swapping: it keeps its bytes
            pass

    def restore_grad(self, pool: BlockPool, make: Callable[[], torch.UntypedStorage] | None = None) -> None:
        """Memory for the gradient shard again, before a gradient is written into it (its values are undefined:
        the first gradient overwrites): a block ``pool`` kept, else new memory: ``make``'s where given (a host
        shard's, of its tier's kind: [Note: gradient shards pinned to the byte] in ``memory/grads.py``), else from
        the storage's own allocator."""
        if self.grad_released:
            assert self.grad is not None
            if self.grad.untyped_storage().nbytes() == 0:  # given back (not a file's, nor one that kept its bytes)
                pool.fill(self.grad.untyped_storage(), nbytes(self.grad), make)
            self.grad_released = self.grad_lazy = False

    def low_tensor(self) -> torch.Tensor:
        """The compute-dtype shard that gathers read."""
        if self.aliased:
            assert self.payload is not None
            lo, hi = self.shard_range
            return self.payload[lo:hi]
        if self.low is not None:
            return self.low
        assert self.master is not None
        return self.master

    def master_tensor_for_read(self) -> torch.Tensor:
        """The master shard (a view of the payload when the chunk is aliased and dtypes agree)."""
        if self.master_is_payload():
            assert self.payload is not None
            lo, hi = self.shard_range
            return self.payload[lo:hi]
        assert self.master is not None
        return self.master

    def master_is_payload(self) -> bool:
        return self.aliased and self.master_dtype == self.compute_dtype

    def bytes_on(self, tier: Tier) -> int:
        """Bytes this chunk holds on ``tier``, read off its buffers (the accounting's ground truth)."""
        total = 0
        if tier is Tier.DEVICE and self.payload is not None:
            total += self.payload.untyped_storage().nbytes() + nbytes(self.grad_payload)
        if tier is self.shard_tier:
            if not self.master_is_payload():
                total += nbytes(self.master)
            total += (0 if self.grad_lazy else held(self.grad)) + (0 if self.grad_low_lazy else held(self.grad_low))
            total += self.optim_state_bytes
        if tier is (Tier.HOST if self.shard_tier is Tier.DISK else self.shard_tier):
            total += nbytes(self.low)
        return total

    def iter_tensors(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)


def give_back(storage: torch.UntypedStorage) -> None:
    """Return ``storage``'s memory to its allocator now; it then holds no bytes and its views stay valid (empty). One
    that cannot be resized (page-locked to the byte) gives its memory to a holder dropped at once, which
    unregisters and unmaps it ([Note: exact pinned memory]). Raises ``RuntimeError`` where neither works."""
    if storage.resizable() or not torch_features.SWAP_STORAGES:
        storage.resize_(0)
    else:
        torch_features.swap_memory(storage, torch.UntypedStorage(0))


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory even while views of it exist (they must not be read again)."""
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError:  # a storage its allocator cannot resize: freed when its last view goes
        pass
