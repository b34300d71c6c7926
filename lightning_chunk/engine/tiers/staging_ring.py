"""One pinned buffer that gradient staging takes its slices from, first in, first out.

[Note: staging in a ring]
``GradOffload`` stages a gradient that must be added, or converted, on the host in a pinned buffer until the copy
has landed ([Note: gradient offload] in ``offload.py``). Taken from torch's caching host allocator at each gradient,
each staging buffer was rounded up to a power of two, and every gradient of a step asked the allocator for a block
(a new pinned allocation wherever its cache had none of that size free yet, on the autograd thread). Instead the
staging comes from one buffer of exactly ``GradOffload.max_staged_bytes``, pinned once, the first time a gradient is
staged: pinned to the byte with ``pin_memory="exact"`` ([Note: exact pinned memory] in ``system/exact_pinned.py``),
else one block of torch's (256 MiB, a power of two: nothing rounded). Copies are drained in the order they were
made, so their slices go back in that order too: a ring. A slice is taken at the end of the slices in use, or at
the buffer's start when the end has no room and the start does; when neither has room, the caller drains its
oldest copy and asks again. Slices start at multiples of ``ALIGN`` bytes, for any dtype's view and for the copy
engine. A request larger than the buffer gets ``None``: the caller stages it in a block of torch's of its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

ALIGN = 256


class StagingRing:
    """Slices of one buffer of ``capacity`` bytes (``alloc(capacity)``, a uint8 tensor, made at first use), given
    back in the order they were taken."""

    def __init__(self, capacity: int, alloc: Callable[[int], torch.Tensor]) -> None:
        self.capacity = capacity - capacity % ALIGN
        self._alloc = alloc
        self._buffer: torch.Tensor | None = None
        self._live: deque[tuple[int, int]] = deque()  # (offset, bytes taken) of the slices in use, oldest first

    def __len__(self) -> int:
        return len(self._live)

    def fits(self, nbytes: int) -> bool:
        """Whether a slice of ``nbytes`` fits once every slice is given back."""
        return 0 < nbytes <= self.capacity

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """A slice for ``numel`` elements of ``dtype``, or ``None`` while the slices in use leave no room for it."""
        nbytes = numel * dtype.itemsize
        if not self.fits(nbytes):
            return None
        size = -(-nbytes // ALIGN) * ALIGN
        offset = self._place(size)
        if offset is None:
            return None
        if self._buffer is None:
            self._buffer = self._alloc(self.capacity)
        self._live.append((offset, size))
        return self._buffer[offset : offset + nbytes].view(dtype)

    def give_back(self) -> None:
        """The oldest slice is no longer used."""
        self._live.popleft()

    def _place(self, size: int) -> int | None:
        if not self._live:
            return 0
        first = self._live[0][0]
        last, last_size = self._live[-1]
        end = last + last_size
        if last >= first:  # in use: [first, end); free: [end, capacity) and [0, first)
            if self.capacity - end >= size:
                return end
            return 0 if first >= size else None
        return end if first - end >= size else None  # in use: [first, capacity) and [0, end)
