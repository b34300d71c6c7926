"""Gradients leaving the device for host shards, copied on a side stream while backward goes on.

[Note: gradient offload]
A chunk whose shard lives on the host takes its gradients there: each parameter's gradient with
one rank, the reduce-scatter's output with several. A plain ``dst.copy_(src)`` across devices
blocks the host until the copy is done, and with it the whole backward (the next module's kernels
are not even launched): nothing overlapped with gradient offload. Here, on CUDA, ``GradOffload``
launches each copy on its own stream (device-to-host, so it does not queue behind the prefetch
stream's host-to-device copies), after that stream waited for the compute stream that produced
the gradient:

- a gradient that overwrites (the first of a step) and already has the destination's dtype goes
  straight into the pinned host shard; otherwise it lands in a pinned staging buffer (from
  torch's caching host allocator, or with ``pin_memory="exact"`` a slice of one buffer pinned
  to the byte: [Note: staging in a ring] in ``staging_ring.py``) and is added, or converted, on
  the host when it is drained;
- the source stays valid until its copy is done: ``record_stream`` tells the caching allocator
  not to hand its block out before the side stream has read it, so a parameter's gradient can
  still be dropped at once (``param.grad = None``), and a gradient payload of several ranks is
  kept, and accounted, until ``drain`` runs its ``on_done`` (which frees it under the ledger);
- ``drain`` waits for the copies, in order, and finishes the host-side adds. The manager drains
  at the end of backward, so the optimizer, clipping and the next step read finished gradients,
  and when it needs the device bytes of payloads still being copied.

On CPU, and with ``pin_memory=False`` where an asynchronous copy into pageable memory would not be
asynchronous anyway, copies are plain and synchronous.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..system.exact_pinned import ExactPinned
from .staging_ring import StagingRing


@dataclass
class _Copy:
    done: torch.cuda.Event | None
    dst: torch.Tensor
    staged: torch.Tensor | None  # pinned host copy to add (or convert) into ``dst`` at drain
    add: bool
    on_done: Callable[[], None] | None
    in_ring: bool = False  # ``staged`` is a slice of the ring


class GradOffload:
    def __init__(
        self,
        device: torch.device,
        *,
        pinned: bool,
        max_staged_bytes: int = 256 << 20,
        exact: ExactPinned | None = None,
    ) -> None:
        """``exact``: stage in a ring pinned to the byte ([Note: staging in a ring] in ``staging_ring.py``)."""
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and pinned else None
        self.ring = None
        if exact is not None and self.stream is not None:
            self.ring = StagingRing(max_staged_bytes, lambda n: exact.empty(n, torch.uint8))
        self._queue: deque[_Copy] = deque()
        self._staged_bytes = 0
        self.max_staged_bytes = max_staged_bytes  # pinned staging alive at once (accumulating micro-batches)
        self.async_bytes = 0  # bytes copied off the compute stream's critical path (telemetry)
        self.clock: Any | None = None  # a StepClock: the host's waits for copies to land are ``tier_copy``

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def __len__(self) -> int:
        return len(self._queue)

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, add: bool, on_done: Callable[[], None] | None = None
    ) -> None:
        """``dst (host) = src`` (``+= src`` when ``add``), flat; asynchronous on CUDA until ``drain``."""
        src = src.reshape(-1)
        if self.stream is None or src.device.type != "cuda" or dst.device.type == "cuda":
            if add:
                dst.add_(src.to(dst.device))
            else:
                dst.copy_(src)
            if on_done is not None:
                on_done()
            return
        staged, in_ring = self._stage(src) if add or dst.dtype != src.dtype else (None, False)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the gradient was produced on the compute stream
        with torch.cuda.stream(self.stream):
            if staged is not None:
                staged.copy_(src, non_blocking=True)
            else:
                dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        src.record_stream(self.stream)
        self.async_bytes += src.numel() * src.element_size()
        self._queue.append(_Copy(done, dst, staged, add, on_done, in_ring))
        if staged is not None:
            self._staged_bytes += staged.numel() * staged.element_size()
            while self._staged_bytes > self.max_staged_bytes and len(self._queue) > 1:
                self.drain(keep=len(self._queue) - 1)

    def _stage(self, src: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Pinned host memory for a copy of ``src``: a slice of the ring where there is one and it fits (the oldest
        copies land first until it has room), else torch's; and whether it is the ring's."""
        ring = self.ring
        if ring is not None and ring.fits(src.numel() * src.element_size()):
            while (staged := ring.take(src.numel(), src.dtype)) is None:
                assert self._queue, "a ring slice outlived its copy"
                self.drain(keep=len(self._queue) - 1)  # the oldest copy lands: its slice, if any, goes back
            return staged, True
        return torch.empty(src.numel(), dtype=src.dtype, pin_memory=True), False

    def drain(self, keep: int = 0) -> None:
        """Wait for the oldest copies until ``keep`` remain; finish their host-side adds and callbacks."""
        while len(self._queue) > keep:
            c = self._queue.popleft()
            if c.done is not None:
                with self.clock.measure("tier_copy") if self.clock is not None else contextlib.nullcontext():
                    c.done.synchronize()
            if c.staged is not None:
                if c.add:
                    c.dst.add_(c.staged)
                else:
                    c.dst.copy_(c.staged)
                self._staged_bytes -= c.staged.numel() * c.staged.element_size()
                if c.in_ring:
                    assert self.ring is not None
                    self.ring.give_back()
            if c.on_done is not None:
                c.on_done()
