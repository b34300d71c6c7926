"""Tier storage: where a chunk's shard buffers live, one object per tier.

Each object allocates a chunk's shard buffers (``alloc``), keeps the optimizer state the
optimizer creates next to them (``keep_state``), says when a chunk is about to be used
(``prefetch``) and brackets each use (``reading`` / ``writing``), and frees a chunk's
buffers (``free``). Device and host memory need nothing around a use; the disk tier
(``DiskStorage`` in ``disk_storage.py``) pages the chunk's files in and out there
([Note: the disk tier] in ``disk.py``).

The manager decides which tier a chunk lives on and keeps the ledger; these objects only
hold bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..chunks.chunk import Chunk, Role, Tier

_HOST = torch.device("cpu")
ROLES = (Role.MASTER, Role.GRAD, Role.OPTIM)  # the buffers of a disk shard that live in files


class TierStorage:
    tier: Tier

    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def reserve_state(self, chunk: Chunk, nbytes: int) -> None:
        """Optimizer state of ``nbytes`` will be kept next to the chunk's master (the optimizer creates it)."""

    def keep_state(self, chunk: Chunk, view: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """Where the optimizer's per-element state ``value`` of the master view ``view`` is kept: itself, here."""
        return value

    def keep_piece(self, chunk: Chunk, offset: int, key: str, value: torch.Tensor) -> torch.Tensor:
        """``keep_state`` for a piece that starts at element ``offset`` of the chunk's shard."""
        return value

    def state_region(self, chunk: Chunk, key: str) -> torch.Tensor | None:
        """Per-element state ``key`` of the whole shard where this tier keeps it laid out like the master shard
        (zeros where a parameter has none), so a checkpoint can write it without a copy; else ``None``."""
        return None

    def page_out(self, chunk: Chunk | None = None) -> None:
        """Drop the pages of ``chunk`` (every chunk when ``None``) from the process (after a pass over it)."""

    def prefetch(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES, *, write: bool = False) -> None:
        """The chunk's ``roles`` buffers will be used soon (and written, when ``write``)."""

    @contextlib.contextmanager
    def reading(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def writing(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> Iterator[None]:
        yield

    def grad_target(self, chunk: Chunk) -> torch.Tensor:
        """Where this backward's gradients of the chunk's shard go (its gradient shard), until ``grads_done``."""
        assert chunk.grad is not None
        return chunk.grad

    def grads_done(self, chunk: Chunk) -> None:
        """The chunk's gradients of this backward are all in ``grad_target``."""

    def free(self, chunk: Chunk) -> None:
        """The chunk's buffers are no longer used (the manager frees what it allocated)."""

    def close(self) -> None:
        """End of the run."""


class DeviceStorage(TierStorage):
    tier = Tier.DEVICE

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)


class HostStorage(TierStorage):
    tier = Tier.HOST

    def __init__(self, *, pinned: bool) -> None:
        self.pinned = pinned

    def alloc(self, chunk: Chunk, role: Role, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=_HOST, pin_memory=self.pinned)
