"""Gradient copies to the host that land late, on a CPU: what a CUDA device-to-host copy on a side stream looks like
to the host ([Note: gradient offload] and [Note: gradients landed beside backward] in ``tiers/offload.py``). A copy's
destination reads NaN until its event is waited for, as memory a copy has not reached yet holds anything, and the
copy is made then, by the thread that waited first."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch

from lightning_chunk.engine.tiers.offload import GradOffload
from lightning_chunk.engine.tiers.staging_ring import StagingRing

WORKER = "lightning_chunk host step_0"  # the worker thread's name (HostStepThread)


class Late:
    """An event whose copy is made when it is first waited for, and who waited first: the worker, or the autograd
    thread before or after the copy's chunk was handed over."""

    def __init__(self, offload: LateCopies, key: Hashable | None, make: Callable[[], object]) -> None:
        self.offload, self.key, self.make, self.lock = offload, key, make, threading.Lock()
        self.by: str | None = None

    def synchronize(self) -> None:
        with self.lock:
            if self.by is None:
                me = threading.current_thread().name
                if me == threading.main_thread().name:
                    me = "main, handed over" if self.key in self.offload.handed else "main, before hand-over"
                self.by = me
                self.make()


class LateCopies(GradOffload):
    """Every copy to the host is asynchronous and lands only when its event is waited for."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, pinned=False)
        self.events: list[Late] = []
        self.handed: set[Hashable] = set()  # the keys handed over (the test clears it after each step)
        self.key: Hashable | None = None

    def _crosses(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        return True

    def copy(self, *args: Any, **kwargs: Any) -> None:
        self.key = kwargs.get("key")  # the next ``_launch``'s
        super().copy(*args, **kwargs)

    def _launch(self, to: torch.Tensor, src: torch.Tensor) -> Late:
        to.fill_(float("nan"))  # not landed yet
        self.events.append(Late(self, self.key, lambda: to.copy_(src)))
        return self.events[-1]

    def hand_over(self, key: Hashable) -> Callable[[], None]:
        self.handed.add(key)
        return super().hand_over(key)

    def _stage(self, src: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return super()._stage(src) if self.ring is not None else (torch.empty_like(src), False)


def late_copies(manager: object, ring_bytes: int | None = None) -> LateCopies:
    """``manager``'s gradient copies land late from now on; ``ring_bytes``: staged in a ring of that many bytes, as
    with ``pin_memory="exact"`` ([Note: staging in a ring] in ``tiers/staging_ring.py``)."""
    old = manager.reducer.offload  # type: ignore[attr-defined]
    assert not len(old), "copies in flight"
    late = LateCopies(old.device)
    if ring_bytes is not None:
        late.ring = StagingRing(ring_bytes, lambda n: torch.empty(n, dtype=torch.uint8))
    late.clock = old.clock
    manager.reducer.offload = late  # type: ignore[attr-defined]
    return late
