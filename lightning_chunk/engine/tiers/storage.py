"""Tier storage: where a chunk's shard buffers live, one object per tier.

The protocol is narrow: a tier allocates a chunk's shard buffers (``alloc``), frees them (``free``) and ends with
the run (``close``). Device and host memory need nothing more. The disk tier (``DiskStorage`` in
``disk_storage.py``) also pages files around each use, writes gradients back and keeps the optimizer state in a
file; ``TierSet`` (``tier_set.py``) is the one place that asks it to, for the chunks that live there.

The manager decides which tier a chunk lives on and keeps the ledger; these objects only hold bytes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..chunks.chunk import Chunk, Role, Tier
from ..config import PinMemory
from ..system.exact_pinned import ExactPinned

_HOST = torch.device("cpu")
ROLES = (Role.MASTER, Role.GRAD, Role.OPTIM)  # the buffers of a disk shard that live in files


class TierStorage(Protocol):
    tier: Tier

    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def free(self, chunk: Chunk) -> None:
        """The chunk's buffers are no longer used (the manager frees what it allocated)."""

    def close(self) -> None:
        """End of the run."""


class DeviceStorage:
    tier = Tier.DEVICE

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def free(self, chunk: Chunk) -> None:
        pass

    def close(self) -> None:
        pass


class HostStorage:
    tier = Tier.HOST

    def __init__(
        self, *, pinned: PinMemory, exact: ExactPinned | None = None, device: torch.device | None = None
    ) -> None:
        """``pinned``: page-lock the buffers (a CUDA device), ``"exact"`` to the byte ([Note: exact pinned memory]
        in ``system/exact_pinned.py``; ``exact``: its allocator, a test's with registration faked; ``device``: the
        GPU whose copies use them)."""
        self.pinned = bool(pinned)
        self.exact = (exact or ExactPinned(device=device)) if pinned == "exact" else None

    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.exact is not None:
            return self.exact.empty(numel, dtype)
        return torch.empty(numel, dtype=dtype, device=_HOST, pin_memory=self.pinned)

    def free(self, chunk: Chunk) -> None:
        pass

    def close(self) -> None:
        pass
