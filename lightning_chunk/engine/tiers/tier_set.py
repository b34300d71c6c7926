"""The three tiers of one rank (``TierSet``): each chunk's buffers allocated on the tier its shard lives on, and what
a use of them needs there. Memory tiers need nothing around a use; the disk tier pages, writes back and stages
([Note: the disk tier] in ``disk.py``). Everything outside ``tiers/`` goes through this object: it asks the disk
tier only for chunks that live there, so no caller tests a tier to know whether to call it.
"""

from __future__ import annotations

import contextlib

import torch

from ..chunks.chunk import Chunk, Role, Tier
from ..config import PinMemory
from ..system import torch_features
from .disk_chunk import DiskChunk
from .disk_storage import DiskStorage
from .storage import ROLES, DeviceStorage, HostStorage, TierStorage


class TierSet:
    """Device, host and disk storage of one rank, and the per-chunk operations that depend on the chunk's tier."""

    def __init__(
        self,
        device: torch.device,
        *,
        pinned: PinMemory,
        disk_dir: str | None,
        rank: int,
        disk_io: str,
        ranks_here: int,
        host_limit: int | None,
    ) -> None:
        self.device = device
        self.host = host = HostStorage(pinned=pinned, device=device if device.type == "cuda" else None)
        self.disk = DiskStorage(disk_dir, rank, host, io=disk_io, ranks_here=ranks_here, host_limit=host_limit)
        self._by_tier: dict[Tier, TierStorage] = {Tier.DEVICE: DeviceStorage(device), Tier.HOST: host}
        self._by_tier[Tier.DISK] = self.disk

    def _files(self, chunk: Chunk) -> DiskChunk | None:
        return self.disk.record(chunk) if chunk.shard_tier is Tier.DISK else None

    # ------------------------------------------------------------ buffers
    def alloc(self, chunk: Chunk, role: Role, dtype: torch.dtype) -> torch.Tensor:
        """One of the chunk's shard buffers on its tier (device bytes reserved by the caller)."""
        return self._by_tier[chunk.shard_tier].alloc(chunk, role, chunk.shard_numel, dtype)

    def for_views(self, chunk: Chunk, role: Role, dtype: torch.dtype) -> torch.Tensor:
        """[Note: gradient shards made for their views]
        Stepping in backward, a chunk's gradient shard is given back as soon as its chunk is built (and after every
        step): it holds memory only while the optimizer's views of it are made, as a view of a storage without
        memory cannot be. Allocated as the tier allocates, on a GPU that was a page-locked allocation of 4 bytes a
        trainable parameter at set-up (some 36 GB at 9B, faulted in and registered, then unregistered), given back
        to the system at once and page-locked again as the warm-up's gradients arrive. Here the set-up's is memory
        never touched nor page-locked, which the first gradient replaces with the tier's own: ``restore_grad`` swaps
        in a pooled block or the tier's allocation, and a swap carries the memory's allocator and whether it can be
        resized (by which the release tells a block pinned to the byte apart). A torch that cannot swap ([Note: torch
        versions] in ``system/torch_features.py``) refills a storage from its own allocator: there the set-up's is the
        tier's, as before, and one pinned to the byte, which cannot be resized, keeps its memory."""
        if chunk.shard_tier is Tier.HOST and torch_features.SWAP_STORAGES:  # pageable, never touched
            return torch.empty(chunk.shard_numel, dtype=dtype)
        return self.alloc(chunk, role, dtype)

    def free(self, chunk: Chunk) -> None:
        self._by_tier[chunk.shard_tier].free(chunk)

    def close(self) -> None:
        """The end of the run: the disk tier's scratch files go."""
        for storage in self._by_tier.values():
            storage.close()

    # ------------------------------------------------------------ uses
    def reading(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> contextlib.AbstractContextManager[None]:
        """Bracket a read of the chunk's ``roles`` buffers (a disk shard's files are paged in, then out)."""
        return self.disk.reading(chunk, roles) if chunk.shard_tier is Tier.DISK else contextlib.nullcontext()

    def writing(self, chunk: Chunk, roles: tuple[Role, ...] = ROLES) -> contextlib.AbstractContextManager[None]:
        """``reading`` for a write."""
        return self.disk.writing(chunk, roles) if chunk.shard_tier is Tier.DISK else contextlib.nullcontext()

    def page_out(self, chunk: Chunk | None = None) -> None:
        """After a pass over ``chunk`` (every chunk when ``None``): its disk pages leave the process (a chunk of
        another tier has a file when the average of the weights is kept in one)."""
        if chunk is None or self.disk.record(chunk) is not None:
            self.disk.page_out(chunk)

    def read_ahead_master(self, chunk: Chunk) -> None:
        """A gather will read the chunk's fp32 disk master soon: start reading it ([Note: the gathers' reads ahead of
        use] in ``disk_storage.py``); a gather to a CUDA device reads it through the mapping, faulted in ahead."""
        if chunk.shard_tier is not Tier.DISK:
            return
        if self.device.type == "cpu":
            self.disk.read_ahead_master(chunk)
        else:
            self.disk.prefetch(chunk, (Role.MASTER,))

    def read_master_into(self, chunk: Chunk, dst: torch.Tensor) -> bool:
        """Read a disk shard's master straight into ``dst`` (a gather on a CPU device); False where it has none."""
        return chunk.shard_tier is Tier.DISK and self.disk.read_master_into(chunk, dst)

    # ------------------------------------------------------------ gradients
    def grad_target(self, chunk: Chunk) -> torch.Tensor:
        """Where this backward's gradients of the chunk's shard go, until ``grads_done``: its gradient shard, or for
        a disk shard a host buffer written to its file then."""
        rec = self._files(chunk)
        if rec is not None and Role.GRAD in rec.files:
            return self.disk.grads.target(chunk)
        assert chunk.grad is not None
        return chunk.grad

    def grads_done(self, chunk: Chunk) -> None:
        """The chunk's gradients of this backward are all in ``grad_target``."""
        if chunk.shard_tier is Tier.DISK:
            self.disk.grads.done(chunk)

    def settle_grads(self) -> None:
        """The end of backward: the disk tier's gradient write-backs have landed."""
        self.disk.settle_grads()

    # ------------------------------------------------------------ optimizer state
    def reserve_state(self, chunk: Chunk, nbytes: int) -> None:
        """Optimizer state of ``nbytes`` will be kept next to the chunk's master (the optimizer creates it)."""
        if chunk.shard_tier is Tier.DISK:
            self.disk.reserve_state(chunk, nbytes)

    def keep_state(self, chunk: Chunk, view: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """Where the optimizer's per-element state ``value`` of the master view ``view`` is kept: in a disk shard's
        state file, else ``value`` itself."""
        rec = self._files(chunk)
        return value if rec is None else rec.keep_state(chunk, view, key, value)

    def keep_piece(self, chunk: Chunk, offset: int, key: str, value: torch.Tensor) -> torch.Tensor:
        """``keep_state`` for a piece that starts at element ``offset`` of the chunk's shard."""
        rec = self._files(chunk)
        return value if rec is None else rec.keep_piece(chunk, offset, key, value)

    def state_region(self, chunk: Chunk, key: str) -> torch.Tensor | None:
        """Per-element state ``key`` of the whole shard where the tier keeps it laid out like the master shard
        (zeros where a parameter has none), so a checkpoint can write it without a copy; else ``None``."""
        rec = self._files(chunk)
        return None if rec is None else rec.state_region(chunk, key)

    def keeps(self, chunk: Chunk, t: torch.Tensor) -> bool:
        """``t`` is a view of the chunk's optimizer-state file."""
        rec = self._files(chunk)
        return rec is not None and rec.keeps(t)
