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
  straight into the pinned host shard; otherwise it lands in a pinned staging buffer (a slice of
  one buffer pinned once, to the byte with ``pin_memory="exact"``: [Note: staging in a ring] in
  ``staging_ring.py``) and is added, or converted, on the host when it is drained;
- the source stays valid until its copy is done: ``record_stream`` tells the caching allocator
  not to hand its block out before the side stream has read it, so a parameter's gradient can
  still be dropped at once (``param.grad = None``), and a gradient payload of several ranks is
  kept, and accounted, until ``drain`` runs its ``on_done`` (which frees it under the ledger);
- ``drain`` waits for the copies, in order, and finishes the host-side adds. The manager drains
  at the end of backward, so the optimizer, clipping and the next step read finished gradients,
  and when it needs the device bytes of payloads still being copied.

On CPU, and with ``pin_memory=False`` where an asynchronous copy into pageable memory would not be
asynchronous anyway, copies are plain and synchronous.

[Note: gradients landed beside backward]
Stepping in backward, a chunk's host step runs on a worker thread ([Note: the host Adam beside backward] in
``step_thread.py``). Had the autograd thread drained the copies before handing the chunk over, it would wait,
once a chunk, for the GPU to finish everything queued so far and then the chunk's last copy, with no kernel
queued behind: the GPU idles until backward launches again. ``hand_over(key)`` gives the worker the chunk's
copies still in flight instead: it waits for their events and makes their host-side adds, then steps. They
stay in the queue, marked: a later drain on the autograd thread still waits for their events (its bound on the
payloads being copied, and their ``on_done``, hold as before) but leaves the adds to the worker. A full drain
(``keep=0``, after which gradients are read as final) lands them itself where the worker has not come to them
yet: landing is done once, by whichever thread comes first, so neither thread ever waits for the other's other
work. So does any drain of a staged copy, which lets its staging buffer go (a ring slice back, in order, on this
thread): a buffer goes only once its add has read it, and ``max_staged_bytes`` bounds the staging alive.

[Note: a copy outlives no drain]
A copy handed over refers to its landing function, which refers to the chunk's copies: a reference cycle. Each
staging buffer then lived past its drain until Python's cycle collector ran, so torch's caching host allocator had
none free for the next copies and page-locked new blocks (``cudaHostAlloc``, milliseconds for tens of MB, on the
autograd thread: counted as ``grad_copy``), and pinned memory grew past ``max_staged_bytes`` meanwhile. Landing
clears the function's list, and a drain clears the copy's reference, so refcounting frees each buffer at its drain.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..system.exact_pinned import ExactPinned
from .staging_ring import StagingRing


@dataclass
class _Copy:
    done: Any  # a torch.cuda.Event
    dst: torch.Tensor
    staged: torch.Tensor | None  # pinned host copy to add (or convert) into ``dst`` at drain
    add: bool
    on_done: Callable[[], None] | None
    in_ring: bool = False  # ``staged`` is a slice of the ring
    key: Hashable | None = None  # whose gradient it is (a chunk id): what ``hand_over`` takes
    land: Callable[[bool], None] | None = None  # handed over: waits for it and makes its add (the first call only)


def torch_pinned(nbytes: int) -> torch.Tensor:
    """A block of torch's pinned host memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class GradOffload:
    def __init__(
        self,
        device: torch.device,
        *,
        pinned: bool,
        max_staged_bytes: int = 256 << 20,
        exact: ExactPinned | None = None,
    ) -> None:
        """Staged copies take slices of one pinned ring ([Note: staging in a ring] in ``staging_ring.py``): pinned to
        the byte with ``exact``, else one block of torch's."""
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and pinned else None
        self.ring = None
        if self.stream is not None:
            self.ring = StagingRing(
                max_staged_bytes,
                (lambda n: exact.empty(n, torch.uint8)) if exact is not None else torch_pinned,
            )
        self._queue: deque[_Copy] = deque()
        self._staged_bytes = 0
        self.max_staged_bytes = max_staged_bytes  # pinned staging alive at once (accumulating micro-batches)
        self.async_bytes = 0  # bytes copied off the compute stream's critical path (telemetry)
        self.handed_over = 0  # copies handed to the worker to land ([Note: gradients landed beside backward])
        self.landed_by_drain = 0  # of those, copies a drain landed because the worker had not come to them yet
        self.clock: Any | None = None  # a StepClock: the host's waits for copies to land are ``tier_copy``

    @property
    def asynchronous(self) -> bool:
        return self.stream is not None

    def __len__(self) -> int:
        return len(self._queue)

    def copy(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        add: bool,
        on_done: Callable[[], None] | None = None,
        key: Hashable | None = None,
    ) -> None:
        """``dst (host) = src`` (``+= src`` when ``add``), flat; asynchronous on CUDA until ``drain``, or until the
        thread given ``key``'s copies (``hand_over``) has landed them."""
        src = src.reshape(-1)
        if not self._crosses(dst, src):
            if add:
                dst.add_(src.to(dst.device))
            else:
                dst.copy_(src)
            if on_done is not None:
                on_done()
            return
        staged, in_ring = self._stage(src) if add or dst.dtype != src.dtype else (None, False)
        done = self._launch(dst if staged is None else staged, src)
        self.async_bytes += src.numel() * src.element_size()
        self._queue.append(_Copy(done, dst, staged, add, on_done, in_ring, key))
        if staged is not None:
            self._staged_bytes += staged.numel() * staged.element_size()
            while self._staged_bytes > self.max_staged_bytes and len(self._queue) > 1:
                self._drain(len(self._queue) - 1, settle=False)

    def stats(self) -> dict[str, int]:
        return {
            "d2h_async_bytes": self.async_bytes,
            "grad_copies_handed_over": self.handed_over,
            "grad_copies_landed_by_drain": self.landed_by_drain,
        }

    def _crosses(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether the copy goes device to host on the side stream (else it is plain and synchronous)."""
        return self.stream is not None and src.device.type == "cuda" and dst.device.type != "cuda"

    def _launch(self, to: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy ``src`` into pinned ``to`` on the side stream once the compute stream has produced it; the event
        that marks the copy done."""
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            to.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        src.record_stream(self.stream)
        return done

    def hand_over(self, key: Hashable) -> Callable[[], None]:
        """[Note: gradients landed beside backward]: ``key``'s copies in flight, landed by whoever calls what this
        returns first (the worker, before it steps the chunk; a drain that must have them landed)."""
        mine = [c for c in self._queue if c.key == key and c.land is None]
        lock, landed = threading.Lock(), list[bool]()

        def land(drained: bool = False) -> None:
            with lock:
                if not landed:
                    landed.append(True)
                    self.landed_by_drain += len(mine) if drained else 0
                    for c in mine:
                        c.done.synchronize()
                        self._finish(c)
                    mine.clear()  # each copy refers to this function: see [Note: a copy outlives no drain]

        for c in mine:
            c.land = land
        self.handed_over += len(mine)
        return land

    def _stage(self, src: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Pinned host memory for a copy of ``src``: a slice of the ring where there is one and it fits (the oldest
        copies land first until it has room), else torch's; and whether it is the ring's."""
        ring = self.ring
        if ring is not None and ring.fits(src.numel() * src.element_size()):
            while (staged := ring.take(src.numel(), src.dtype)) is None:
                assert self._queue, "a ring slice outlived its copy"
                self._drain(len(self._queue) - 1, settle=False)  # the oldest lands: its slice goes back
            return staged, True
        return torch.empty(src.numel(), dtype=src.dtype, pin_memory=True), False

    def drain(self, keep: int = 0) -> None:
        """Wait for the oldest copies until ``keep`` remain; finish their host-side adds and callbacks. With
        ``keep=0`` every gradient is final after it: copies handed over are landed here if the worker has not."""
        self._drain(keep, settle=keep == 0)

    def _drain(self, keep: int, *, settle: bool) -> None:
        while len(self._queue) > keep:
            c = self._queue.popleft()
            with self.clock.measure("tier_copy") if self.clock is not None else contextlib.nullcontext():
                c.done.synchronize()
                if c.land is not None and (settle or c.staged is not None):
                    c.land(True)  # made here if the worker has not come to it yet: its staging goes below
            if c.land is None:
                self._finish(c)
            if c.staged is not None:
                self._staged_bytes -= c.staged.numel() * c.staged.element_size()
                if c.in_ring:
                    assert self.ring is not None
                    self.ring.give_back()
            if c.on_done is not None:
                c.on_done()
            c.land = None  # [Note: a copy outlives no drain]

    @staticmethod
    def _finish(c: _Copy) -> None:
        """A landed copy's host-side add (or conversion) from its staging buffer."""
        if c.staged is not None:
            if c.add:
                c.dst.add_(c.staged)
            else:
                c.dst.copy_(c.staged)
