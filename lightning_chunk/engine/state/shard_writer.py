"""How a rank's shards reach ``torch.distributed.checkpoint``: made one at a time, written a chunk or two a file.

[Note: a save streams the shards]
DCP plans a save from the tensors of the state dict it is given, then its writer asks the planner for each
item's data (``resolve_data``) as it writes, and keeps every tensor of a file alive until that file is closed.
Handing it every shard up front held, before the first byte was written, a host copy of every chunk's
optimizer state (per-parameter state is copied into one flat shard a key) and of every device master: up to
the rank's whole optimizer state beyond its training state. So a save hands DCP a placeholder for each shard
(a one-element tensor expanded to the shard's size: its shape and dtype, no bytes), the planner makes the
shard when the writer asks for it, and the writer starts a new file once a file holds the largest chunk's shards
(``group_bytes``), so that at most one file's shards, two chunks' at most, are held at once. A file holds whole
chunks in id order (one where the chunks are alike); its name is
``__<rank>_<group>_0.distcp``. Disk-tier chunks are paged out once the writer moves past them, so only the
chunk being written has pages in the process. Loading reads the files through DCP's metadata, whatever
their number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.futures import Future

Make = Callable[[], torch.Tensor]


def placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``numel`` elements of ``dtype`` that holds one: what DCP plans with before the shard exists."""
    return torch.zeros(1, dtype=dtype).expand(numel)


def chunk_of(fqn: str) -> int | None:
    """The chunk id of an item named ``chunk.<c>.…``, else ``None``."""
    name = fqn.split(".")
    return int(name[1]) if len(name) > 2 and name[0] == "chunk" and name[1].isdigit() else None


class StreamingPlanner(DefaultSavePlanner):
    """DCP's default planner, making each lazy item (``make``: name -> function) when the writer asks for it and
    paging out the disk-tier chunk of the item written before ([Note: a save streams the shards])."""

    def __init__(self, mgr: Any, make: dict[str, Make]) -> None:
        super().__init__()
        self.mgr = mgr
        self.make = make
        self._last: int | None = None

    def resolve_data(self, write_item: Any) -> Any:
        fqn = write_item.index.fqn
        if self._last is not None and self._last < len(self.mgr.chunks) and self.mgr.tiers.disk.holds_files:
            chunk = self.mgr.chunks[self._last]
            self.mgr.tiers.page_out(chunk)
        self._last = chunk_of(fqn)
        if fqn in self.make:
            return self.make[fqn]()
        return super().resolve_data(write_item)


@dataclasses.dataclass
class _Prefix:  # what FileSystemWriter.write_data reads of a plan's storage data
    prefix: str


class GroupedWriter(FileSystemWriter):
    """DCP's file system writer, writing a rank's items in files of whole chunks, each at most ``group_bytes``
    (or one chunk, where a chunk's items are larger), one file after another."""

    def __init__(self, path: str, group_bytes: int) -> None:
        super().__init__(path)
        self.group_bytes = group_bytes

    def write_data(self, plan: Any, planner: Any) -> Future[list[Any]]:
        groups: list[list[Any]] = []
        size, last = 0, None
        for item in sorted(plan.items, key=lambda i: (chunk_of(i.index.fqn) is None, chunk_of(i.index.fqn) or 0)):
            c, n = chunk_of(item.index.fqn), _item_bytes(item)
            if not groups or (c != last and size + n > self.group_bytes):
                groups.append([])
                size = 0
            groups[-1].append(item)
            size, last = size + n, c
        results: list[Any] = []
        for g, items in enumerate(groups):
            sub = dataclasses.replace(plan, items=items, storage_data=_Prefix(f"{plan.storage_data.prefix}{g}_"))
            results.extend(super().write_data(sub, planner).wait())
        done: Future[list[Any]] = Future()
        done.set_result(results)
        return done


def _item_bytes(item: Any) -> int:
    data = item.tensor_data
    if data is None:
        return 0
    numel = 1
    for n in data.chunk.sizes:
        numel *= n
    return numel * data.properties.dtype.itemsize
