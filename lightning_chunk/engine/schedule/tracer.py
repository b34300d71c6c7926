"""The memory tracer: what one warm-up step uses, moment by moment.

A *moment* is one tick of the engine's clock at a module hook (pre-forward,
post-forward, pre-backward). During the warm-up micro-batch the tracer records,
per moment, which chunks the module uses and how many bytes of non-model memory
are live: tensors autograd saved for backward (activations), counted once per
storage and excluding chunk payloads, plus on CUDA whatever the allocator holds
beyond chunk memory. Placement reads the finished ``Trace``; it never sees the
tracer.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import enum
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch


class MomentKind(str, enum.Enum):
    """Which hook a moment is: a module's pre-forward, its post-forward, or its pre-backward."""

    FORWARD = "fwd"
    POST_FORWARD = "post_fwd"
    BACKWARD = "bwd"

    def __str__(self) -> str:
        return self.value


FORWARD, POST_FORWARD, BACKWARD = MomentKind.FORWARD, MomentKind.POST_FORWARD, MomentKind.BACKWARD
ROOT = "<root>"  # the module key of the root module, whose moments are its step's start and its backward's start


@dataclass(frozen=True)
class Moment:
    kind: MomentKind
    module: str
    chunk_ids: tuple[int, ...]
    param_indices: tuple[int, ...]
    nonmodel_bytes: int
    # at an activation recomputation's moment: the parameters (and their chunks) that the backward it runs inside
    # keeps in use ([Note: recomputation] in hooks.py); empty elsewhere
    pinned_params: tuple[int, ...] = ()
    pinned_chunks: tuple[int, ...] = ()


class MomentKey(NamedTuple):
    kind: MomentKind
    module: str
    occurrence: int  # moments of this kind and module before it in the step


@dataclass(frozen=True)
class Trace:
    moments: tuple[Moment, ...]
    # parameter index -> the position of the moment after which its (last) gradient arrived; -1: none arrived.
    # Several ranks agree on it (the latest any rank saw): [Note: when a chunk reduces] in reduce.py
    grad_positions: tuple[int, ...] = ()
    # and the moment after which its first gradient arrived (the earliest any rank saw): when every rank makes the
    # gradient payload ([Note: gradients some ranks lack] in reduce.py)
    first_grad_positions: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.moments)

    @property
    def nonmodel_peak_bytes(self) -> int:
        return max((m.nonmodel_bytes for m in self.moments), default=0)

    def nonmodel_at(self, position: int) -> int:
        if not self.moments:
            return 0
        return self.moments[min(max(position, 0), len(self.moments) - 1)].nonmodel_bytes

    @functools.cached_property
    def use_positions(self) -> dict[int, list[int]]:
        """chunk id -> sorted moment positions that use it (post-forward moments use nothing)."""
        uses: dict[int, list[int]] = {}
        for i, m in enumerate(self.moments):
            if m.kind == POST_FORWARD:
                continue
            for c in m.chunk_ids:
                uses.setdefault(c, []).append(i)
        return uses

    def next_use(self, chunk_id: int, position: int) -> float:
        """Moments until ``chunk_id`` is used after ``position``, wrapping into the next step."""
        pos = self.use_positions.get(chunk_id)
        if not pos:
            return float("inf")
        k = bisect.bisect_right(pos, position)
        if k < len(pos):
            return pos[k] - position
        return len(self.moments) - position + pos[0]

    def used_later(self, chunk_id: int, position: int) -> bool:
        """Whether ``chunk_id`` is used again in this step after ``position``."""
        pos = self.use_positions.get(chunk_id)
        return bool(pos and pos[-1] > position)

    def next_chunks(self, position: int) -> tuple[int, ...]:
        """Chunks of the first moment after ``position`` that uses any."""
        for m in self.moments[position + 1 :]:
            if m.chunk_ids and m.kind != POST_FORWARD:
                return m.chunk_ids
        return ()

    def prefetch_window(self, position: int) -> tuple[int, ...]:
        """The chunks of the first moment after ``position`` that uses any, then the first chunk used after those
        (this step's rest only); [Note: how far ahead to gather] in placement.py."""
        window = self._windows.get(position)
        if window is None:
            window = self._windows[position] = tuple(self.chunks_ahead(position, len(self.next_chunks(position)) + 1))
        return window

    @functools.cached_property
    def _windows(self) -> dict[int, tuple[int, ...]]:
        return {}

    def chunks_ahead(self, position: int, limit: int) -> list[int]:
        """Distinct chunks used after ``position`` in the order of their first use, at most ``limit`` of them
        (this step's rest only: the next step starts with the optimizer's own reads)."""
        seen: dict[int, None] = {}
        for m in self.moments[position + 1 :]:
            if m.kind == POST_FORWARD:
                continue
            for c in m.chunk_ids:
                seen.setdefault(c, None)
                if len(seen) >= limit:
                    return list(seen)
        return list(seen)

    def reused_before_gather(self, position: int, resident: frozenset[int]) -> frozenset[int]:
        """Resident chunks used after ``position`` up to the first moment that needs one not in ``resident``.

        See [Note: releasing after use]. The hooks ask this at every moment, so it works on the moments' chunk
        sets (``_use_sets``) and stops once every resident chunk is found used: scanning the rest of the step
        with a generator per moment was a third of the hooks' time on a 20-block GPT in three chunks."""
        start = bisect.bisect_right(self._use_starts, position)
        used: set[int] = set()
        for ids in self._use_sets[start:]:
            if ids <= resident:
                used |= ids
                if len(used) == len(resident):
                    break
            else:
                used |= ids & resident
                break
        return frozenset(used)

    @functools.cached_property
    def _use_starts(self) -> tuple[int, ...]:
        """The positions of the moments that use chunks (post-forward moments use none), in order."""
        return tuple(i for i, m in enumerate(self.moments) if m.kind != POST_FORWARD and m.chunk_ids)

    @functools.cached_property
    def _use_sets(self) -> tuple[frozenset[int], ...]:
        """The chunks of each moment in ``_use_starts``, as sets."""
        return tuple(frozenset(self.moments[i].chunk_ids) for i in self._use_starts)

    @functools.cached_property
    def root_chunks(self) -> frozenset[int]:
        """Chunks of the root module's parameters (its own, or those it reads): in use for the whole forward, and
        from the start of backward until their gradients land."""
        return frozenset(c for m in self.moments if m.module == ROOT for c in m.chunk_ids)

    def backward_completion_order(self) -> list[int]:
        """Chunk ids by the position of their last backward moment: the order backward finishes them."""
        last: dict[int, int] = {}
        for i, m in enumerate(self.moments):
            if m.kind == BACKWARD:
                for c in m.chunk_ids:
                    last[c] = i
        return sorted(last, key=last.__getitem__)

    def remap(self, chunk_of: dict[int, int]) -> Trace:
        """The same moments with chunk ids of another layout (``param index -> chunk id``)."""
        return Trace(
            tuple(
                Moment(
                    m.kind,
                    m.module,
                    tuple(sorted({chunk_of[i] for i in m.param_indices})),
                    m.param_indices,
                    m.nonmodel_bytes,
                    m.pinned_params,
                    tuple(sorted({chunk_of[i] for i in m.pinned_params})),
                )
                for m in self.moments
            ),
            self.grad_positions,
            self.first_grad_positions,
        )

    def reduce_moments(self, chunks: dict[int, Sequence[int]]) -> dict[int, MomentKey | None]:
        """Chunk id -> the moment at whose start it reduces: the first after the one its trainable parameters
        (``chunks``: chunk id -> their indices) had all their gradients by in this trace, named by ``MomentKey``;
        None for the end of backward (a parameter got none, or the last gradient came after the last moment).
        Empty when the trace recorded no gradients. [Note: when a chunk reduces] in reduce.py."""
        if not self.grad_positions:
            return {}
        at, keys = self.grad_positions, self.moment_keys
        out: dict[int, MomentKey | None] = {}
        for c, params in chunks.items():
            if params:
                last = -1 if any(at[i] < 0 for i in params) else max(at[i] for i in params)
                out[c] = keys[last + 1] if 0 <= last < len(keys) - 1 else None
        return out

    def payload_moments(self, chunks: dict[int, Sequence[int]]) -> dict[MomentKey, list[int]]:
        """The moment at whose start each chunk's gradient payload is made (``chunks``: chunk id -> its trainable
        parameters' indices): the one after which the first of their gradients arrived in this trace."""
        out: dict[MomentKey, list[int]] = {}
        if not self.first_grad_positions:
            return out
        for c, params in chunks.items():
            first = [self.first_grad_positions[i] for i in params if self.first_grad_positions[i] >= 0]
            if first:
                out.setdefault(self.moment_keys[min(first)], []).append(c)
        return out

    @functools.cached_property
    def moment_keys(self) -> list[MomentKey]:
        """Each moment named by its kind, its module and how many moments of that kind and module came before it
        in the step: the same moment still has the same name in a step that skips other modules."""
        seen: dict[tuple[str, str], int] = {}
        keys = []
        for m in self.moments:
            n = seen.get((m.kind, m.module), 0)
            seen[(m.kind, m.module)] = n + 1
            keys.append(MomentKey(m.kind, m.module, n))
        return keys

    def first_use_order(self, num_params: int) -> list[int]:
        """Parameter indices in the order the warm-up first used them; unused ones last, in registration order."""
        seen: dict[int, None] = {}
        for m in self.moments:
            if m.kind == FORWARD:
                for i in m.param_indices:
                    seen.setdefault(i, None)
        for m in self.moments:
            for i in m.param_indices:
                seen.setdefault(i, None)
        rest = [i for i in range(num_params) if i not in seen]
        return list(seen) + rest


@dataclass(frozen=True)
class MomentEvent:
    """What one moment did, for telemetry (see ``ChunkHooks.recorder``)."""

    position: int
    kind: MomentKind
    module: str
    needed: tuple[int, ...]
    evicted: tuple[int, ...]
    fetched: tuple[int, ...]  # gathered at this moment: needed ones and prefetches
    resident: tuple[int, ...]  # payloads resident after the moment
    device_shards: tuple[int, ...]  # chunks whose shard lives on the device tier
    device_bytes: int  # chunk bytes on the device tier after the moment
    nonmodel_bytes: int  # traced non-model bytes at this moment (0 without a trace)
    disk_shards: tuple[int, ...] = ()  # chunks whose master, gradient and optimizer state live on the disk tier


class _Saved:
    """What the pack hook hands autograd: the tensor, detached, and a receipt that un-counts it when autograd drops
    it.

    [Note: a saved tensor held without its graph]
    Autograd keeps what a pack hook returns in the node that saved the tensor. An op that saves its own output
    (LayerNorm's statistics, softmax, an exp) then held, through this receipt, a tensor whose ``grad_fn`` is that
    node: a cycle through C++ that Python's collector cannot see. A backward frees the saved tensors and breaks
    it, so no test saw it; a forward with grad and no backward in the warm-up step (a ``training_step`` returning
    ``None`` to skip a batch, an auxiliary forward outside the loss) kept that forward's activations for the rest
    of the process, even across ``gc.collect()``, and the warm-up counted them beside the next step's (2.1x the
    step's activations: a limit that held the step was refused). The receipt keeps ``t.detach()``, as PyTorch
    does inside for a saved output: the same storage, and autograd attaches the graph again on unpack."""

    __slots__ = ("tensor", "key", "counter")

    def __init__(self, tensor: torch.Tensor, key: tuple[str, int] | None, counter: SavedBytesCounter) -> None:
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self) -> None:
        # torch.compile allocates one instance with object.__new__ to probe whether the class can be built (so
        # __init__ never ran); such an instance counted nothing
        key = getattr(self, "key", None)
        if key is not None:
            self.counter._release(key)


class SavedBytesCounter:
    """Live bytes of tensors saved for backward, one count per storage."""

    def __init__(self, is_model_storage: Callable[[torch.Tensor], bool]) -> None:
        self._is_model = is_model_storage
        self._refs: dict[tuple[str, int], list[int]] = {}  # key -> [refcount, bytes]
        self.live_bytes = 0

    @torch.compiler.disable  # counts real storages, in eager: see [Note: hooks under torch.compile] in hooks.py
    def _pack(self, t: torch.Tensor) -> _Saved:
        if isinstance(t, torch.nn.Parameter) or self._is_model(t):
            return _Saved(t if t.is_leaf else t.detach(), None, self)
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, storage.nbytes()]
            self.live_bytes += storage.nbytes()
        else:
            ref[0] += 1
        return _Saved(t.detach(), key, self)

    @staticmethod
    @torch.compiler.disable
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _release(self, key: tuple[str, int]) -> None:
        ref = self._refs.get(key)
        if ref is None:
            return
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live_bytes -= ref[1]

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield


class MemoryTracer:
    """Records moments while ``recording``; ``finish()`` returns the ``Trace``.

    [Note: peaks between moments] Memory read at the hooks alone misses what a module holds
    only while it runs: attention scores, the loss's logits in fp32, a fused kernel's
    workspace. On CUDA the tracer also reads the caching allocator's peak since the previous
    moment (and resets it, during the warm-up step only) and charges that peak, less the chunk
    bytes, to the previous moment: the module that ran between the two moments is the one
    that held it, and the placement budget at that moment is what must leave room for it. The
    chunk bytes subtracted are the ledger's at the later moment, so gradient payloads freed
    in between are counted as non-model memory: the error is on the safe side. Anyone reading
    ``torch.cuda.max_memory_allocated`` across the warm-up step sees its peak since the last
    moment of that step.
    """

    def __init__(
        self,
        is_model_storage: Callable[[torch.Tensor], bool],
        device: torch.device,
        chunk_device_bytes: Callable[[], int],
    ) -> None:
        self.counter = SavedBytesCounter(is_model_storage)
        self._device = device
        self._chunk_device_bytes = chunk_device_bytes
        self._moments: list[Moment] = []
        self._grads: dict[int, int] = {}  # parameter index -> position of the moment its gradient arrived after
        self._first: dict[int, int] = {}  # and its first gradient
        self.recording = False

    def nonmodel_bytes(self) -> int:
        """Live non-model bytes now: saved activations, and on CUDA whatever else is allocated beyond chunks."""
        live = self.counter.live_bytes
        if self._device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self._device) - self._chunk_device_bytes()
            live = max(live, allocated)
        return max(live, 0)

    def _peak_since_last_moment(self) -> int:
        if self._device.type != "cuda":
            return 0
        peak = torch.cuda.max_memory_allocated(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        return max(peak - self._chunk_device_bytes(), 0)

    def _charge_previous(self, peak: int) -> None:
        if self._moments and peak > self._moments[-1].nonmodel_bytes:
            self._moments[-1] = dataclasses.replace(self._moments[-1], nonmodel_bytes=peak)

    def record(
        self,
        kind: MomentKind,
        module: str,
        chunk_ids: Sequence[int],
        param_indices: Sequence[int],
        pinned: Callable[[], tuple[tuple[int, ...], tuple[int, ...]]] = lambda: ((), ()),
    ) -> None:
        """One moment; ``pinned()`` gives the (parameters, chunks) other modules keep in use (asked only here)."""
        if self.recording:
            self._charge_previous(self._peak_since_last_moment())
            held = pinned() if kind != POST_FORWARD else ((), ())
            self._moments.append(
                Moment(kind, module, tuple(chunk_ids), tuple(param_indices), self.nonmodel_bytes(), *held)
            )

    def forward_first_use(self) -> list[int]:
        """Chunk ids in the order the recording's forward moments first used them (so far)."""
        seen: dict[int, None] = {}
        for m in self._moments:
            if m.kind == FORWARD:
                for c in m.chunk_ids:
                    seen.setdefault(c, None)
        return list(seen)

    def grad_arrived(self, param_index: int) -> None:
        """A parameter's gradient arrived (after the latest moment)."""
        if self.recording:
            self._grads[param_index] = len(self._moments) - 1
            self._first.setdefault(param_index, len(self._moments) - 1)

    def start(self) -> None:
        self._moments.clear()
        self._grads.clear()
        self._first.clear()
        self.recording = True
        self._peak_since_last_moment()  # the peak window opens here

    def finish(self, num_params: int = 0) -> Trace:
        """The trace of the recording; ``num_params``: how many parameters ``grad_positions`` covers."""
        self._charge_previous(self._peak_since_last_moment())  # the last module's backward
        self.recording = False
        return Trace(
            tuple(self._moments),
            tuple(self._grads.get(i, -1) for i in range(num_params)),
            tuple(self._first.get(i, -1) for i in range(num_params)),
        )
