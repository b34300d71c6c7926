"""A ``torch.distributed.checkpoint`` (DCP) directory read by one process, an entry at a time: what Lightning's FSDP
and ModelParallel strategies save ([Note: resuming a peer's sharded checkpoint] in ``state/peer_checkpoint.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

INDEX = ".metadata"
MODEL_ROOTS = ("state_dict", "model")  # ModelParallelStrategy's, FSDPStrategy's


class DCPTree:
    """A DCP directory's index: each stored entry's key and its path in the nested state the saver handed DCP."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader = _Reader(path)
        self.md = self.reader.metadata.state_dict_metadata
        planned = self.reader.metadata.planner_data or {}
        self.paths: dict[str, tuple[Any, ...]] = {k: tuple(planned.get(k, (k,))) for k in self.md}

    @property
    def roots(self) -> set[Any]:
        return {p[0] for p in self.paths.values()}

    def model_root(self) -> str | None:
        """Where the saver put the model's ``state_dict``, if it was Lightning's FSDP or ModelParallel strategy."""
        return next((k for k in MODEL_ROOTS if k in self.roots), None)

    def under(self, *prefix: Any) -> dict[tuple[Any, ...], str]:
        """The entries below ``prefix``: their path after it -> their key."""
        n = len(prefix)
        return {p[n:]: k for k, p in self.paths.items() if p[:n] == prefix and len(p) > n}

    def shape(self, key: str) -> torch.Size:
        md = self.md[key]
        return md.size if isinstance(md, TensorStorageMetadata) else torch.Size()

    def dtype(self, key: str) -> torch.dtype | None:
        md = self.md[key]
        return md.properties.dtype if isinstance(md, TensorStorageMetadata) else None

    def read(self, keys: list[str]) -> dict[str, Any]:
        """The entries ``keys``, whole (tensors on the host), read from the files by this process alone."""
        out: dict[str, Any] = {}
        for k in keys:
            dtype = self.dtype(k)
            out[k] = None if dtype is None else torch.empty(self.shape(k), dtype=dtype)
        dcp.load(out, storage_reader=self.reader, no_dist=True)
        return out


def is_dcp_directory(path: Path) -> bool:
    return (path / INDEX).is_file()


class _Reader(dcp.FileSystemReader):
    """DCP's reader of ``path``, parsing its index once: each read of a parameter would parse it again (megabytes for
    a large model saved by many ranks)."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.metadata: Metadata = super().read_metadata()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata
