"""What the disk tier keeps for one chunk (``DiskChunk``): its files by role, and the layout of the optimizer state
in its state file."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..chunks.chunk import Chunk, Role
from ..errors import DiskTierError
from .disk import MappedFile


@dataclass
class DiskChunk:
    """A chunk's files by role, where each optimizer-state key starts in the state file and its dtype, the bytes of
    that file given out, and this backward's gradients until they are written."""

    files: dict[Role, MappedFile] = field(default_factory=dict)
    state_at: dict[str, int] = field(default_factory=dict)  # optimizer state key -> byte offset in the state file
    state_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    used: int = 0  # bytes of the state file given to keys
    grads: torch.Tensor | None = None  # the host buffer this backward's gradients gathered in, until written

    def of(self, roles: tuple[Role, ...]) -> dict[Role, MappedFile]:
        """The files of ``roles`` the chunk has, in the order of ``roles``."""
        return {r: self.files[r] for r in roles if r in self.files}

    def drop_state_file(self) -> None:
        """The state file goes (its size changes): every key is laid out anew."""
        if Role.OPTIM in self.files:
            self.files.pop(Role.OPTIM).close()
        self.state_at.clear()
        self.used = 0

    def keep_state(self, chunk: Chunk, view: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """``keep_piece`` for the state ``value`` of the master view ``view`` (all of it, or ``value`` itself)."""
        if Role.OPTIM not in self.files or not torch.is_tensor(value) or value.dim() == 0:
            return value
        if value.numel() != view.numel():
            return value
        assert chunk.master is not None
        offset = (view.data_ptr() - chunk.master.data_ptr()) // chunk.master.element_size()
        return self.keep_piece(chunk, offset, key, value)

    def keep_piece(self, chunk: Chunk, offset: int, key: str, value: torch.Tensor) -> torch.Tensor:
        """Where the per-element state ``value`` starting at element ``offset`` of the shard is kept: a view of the
        state file (``value`` copied in), or ``value`` itself where it is not laid out like the shard."""
        f = self.files.get(Role.OPTIM)
        if f is None or not torch.is_tensor(value) or value.dim() == 0:
            return value
        esz = value.element_size()
        if key not in self.state_at:
            base = -(-self.used // 16) * 16
            if base + chunk.shard_numel * esz > f.nbytes:
                raise DiskTierError(
                    f"chunk {chunk.chunk_id}'s optimizer state {key!r} ({value.dtype}) does not fit the "
                    f"{f.nbytes} bytes reserved for it on the disk tier: the optimizer keeps more state than its "
                    "probe step showed."
                )
            self.state_at[key] = base
            self.state_dtype[key] = value.dtype
            self.used = base + chunk.shard_numel * esz
        if value.dtype != self.state_dtype[key] or offset + value.numel() > chunk.shard_numel:
            return value  # not laid out like the shard: stays where it is
        slot = f.tensor(value.numel(), value.dtype, offset=self.state_at[key] + offset * esz).view(value.shape)
        if slot.data_ptr() != value.data_ptr():
            slot.copy_(value)
        return slot

    def state_region(self, chunk: Chunk, key: str) -> torch.Tensor | None:
        """State ``key`` of the whole shard as laid out in the state file, or None."""
        f = self.files.get(Role.OPTIM)
        if f is None or key not in self.state_at:
            return None
        return f.tensor(chunk.shard_numel, self.state_dtype[key], offset=self.state_at[key])

    def keeps(self, t: torch.Tensor) -> bool:
        """``t`` is a view of the state file."""
        f = self.files.get(Role.OPTIM)
        return f is not None and f.base <= t.data_ptr() < f.base + f.nbytes
