"""The byte ledger: per tier, the chunk bytes that exist, moved by what each operation changed in a chunk's
buffers (``tracked``), with device bytes reserved against ``device_memory_limit`` before they are allocated."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from ..chunks.chunk import Chunk, Tier
from ..config import format_bytes
from ..errors import DeviceMemoryLimitError


class Ledger:
    """Chunk bytes per tier (``ledger[tier]``), the device peak, and the device limit they must stay under."""

    def __init__(self, limit: int | None, rank: int, device: torch.device, origin: str = "") -> None:
        self.limit = limit
        self.origin = origin  # where the limit came from when not from this rank's device_memory_limit
        self.rank = rank
        self.device = device  # a CUDA one makes the error read as an out-of-memory (DeviceMemoryLimitError)
        self._bytes = {t: 0 for t in Tier}
        self.peak = 0  # the device tier's most

    def named_limit(self) -> str:
        """The limit as errors name it, with where its value came from when this rank did not set it: the default
        from free memory, or another rank's smaller limit ([Note: one limit for every rank])."""
        named = f"device_memory_limit={format_bytes(self.limit or 0)}"
        return f"{named} ({self.origin})" if self.origin else named

    def __getitem__(self, tier: Tier) -> int:
        return self._bytes[tier]

    @contextlib.contextmanager
    def tracked(self, chunk: Chunk) -> Iterator[None]:
        """Move the ledger by what the block changed in ``chunk``'s buffers (also when it raises)."""
        before = {t: chunk.bytes_on(t) for t in Tier}
        try:
            yield
        finally:
            for t in Tier:
                self._bytes[t] += chunk.bytes_on(t) - before[t]
            self.peak = max(self.peak, self._bytes[Tier.DEVICE])

    def fits(self, nbytes: int) -> bool:
        return self.limit is None or self._bytes[Tier.DEVICE] + nbytes <= self.limit

    def reserve(self, nbytes: int, what: str) -> None:
        """``nbytes`` more on the device tier, for ``what``: raise when the limit would be exceeded."""
        if not self.fits(nbytes):
            raise DeviceMemoryLimitError(
                f"[rank {self.rank}] {what} needs {nbytes} more bytes on the device tier, which already holds "
                f"{format_bytes(self._bytes[Tier.DEVICE])} of chunk memory; "
                f"{self.named_limit()} would be exceeded.",
                self.device,
            )

    def check(self, chunks: Iterable[Chunk]) -> None:
        """The ledger equals the bytes the chunks hold, and the device's are within the limit."""
        chunks = list(chunks)
        for t in Tier:
            derived = sum(c.bytes_on(t) for c in chunks)
            if derived != self._bytes[t]:
                raise AssertionError(f"{t.value} ledger says {self._bytes[t]} bytes, chunks hold {derived}")
        if self.limit is not None and self._bytes[Tier.DEVICE] > self.limit:
            raise AssertionError(f"device chunk bytes {self._bytes[Tier.DEVICE]} exceed the limit {self.limit}")
