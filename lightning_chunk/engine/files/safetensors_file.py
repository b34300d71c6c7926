"""Write ``safetensors`` files (and the index ``save_pretrained`` writes beside sharded ones), one tensor at a time.

[Note: streaming safetensors] A ``.safetensors`` file is an 8-byte little-endian header length, a JSON
header naming each tensor's dtype, shape and ``[begin, end)`` byte range in the data that follows, and
the data. ``safetensors.torch.save_file`` needs every tensor of a file in memory at once. Here the
caller declares every tensor first (name, shape, dtype, in the order it will produce them), the files
are laid out from the declarations (a new file when the next tensor would take one past
``max_shard_bytes``), each header is written up front, and each tensor's bytes are appended when it
arrives. Peak memory is the tensor in hand. The ranges lie end to end with no holes, which is what
``safetensors`` checks when it opens a file; the order of the tensors in a file is free.

File names follow ``transformers``: one file is ``model.safetensors``; several are
``model-00001-of-0000N.safetensors`` with ``model.safetensors.index.json`` mapping each name to its file.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch

DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


@dataclass
class _File:
    name: str
    entries: dict[str, dict] = field(default_factory=dict)  # tensor name -> its header entry
    nbytes: int = 0


class StreamingSafetensors:
    """Declare every tensor with ``add``, then ``open`` writes the headers, ``write`` each tensor in declared order,
    and ``close`` checks that all arrived and writes the index. ``out_dir`` must exist."""

    def __init__(self, out_dir: Path, *, max_shard_bytes: int, metadata: dict[str, str] | None = None) -> None:
        if sys.byteorder != "little":
            raise RuntimeError(
                "safetensors files are little-endian; writing them on a big-endian host is not supported."
            )
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self._order: list[tuple[str, int, torch.dtype]] = []  # (name, file index, dtype), declaration order
        self._names: set[str] = set()
        self._files: list[_File] = []
        self._next = 0
        self._handle: BinaryIO | None = None
        self._handle_file = -1

    @property
    def count(self) -> int:
        """Tensors declared."""
        return len(self._order)

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if self._handle is not None or self._next:
            raise RuntimeError("every tensor must be declared before the first is written")
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which safetensors does not hold.")
        nbytes = math.prod(shape) * dtype.itemsize
        if not self._files or (self._files[-1].nbytes and self._files[-1].nbytes + nbytes > self.max_shard_bytes):
            self._files.append(_File(""))
        if name in self._names:
            raise ValueError(f"tensor {name!r} is declared twice.")
        self._names.add(name)
        f = self._files[-1]
        f.entries[name] = {
            "dtype": DTYPE_NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [f.nbytes, f.nbytes + nbytes],
        }
        f.nbytes += nbytes
        self._order.append((name, len(self._files) - 1, dtype))

    def open(self) -> None:
        """Name the files and write every header (each file's data then follows in declared order)."""
        n = len(self._files)
        for i, f in enumerate(self._files):
            f.name = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            header = json.dumps({"__metadata__": self.metadata, **f.entries}, separators=(",", ":")).encode()
            header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
            with open(self.out_dir / f.name, "wb") as out:
                out.write(struct.pack("<Q", len(header)))
                out.write(header)

    def write(self, name: str, value: torch.Tensor) -> None:
        """The bytes of the next declared tensor (converted to its declared dtype)."""
        if self._next >= len(self._order) or self._order[self._next][0] != name:
            expected = self._order[self._next][0] if self._next < len(self._order) else "nothing more"
            raise RuntimeError(f"tensor {name!r} written out of order (expected {expected!r})")
        name, i, dtype = self._order[self._next]
        f = self._files[i]
        declared = f.entries[name]["shape"]
        if list(value.shape) != declared:
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, declared {tuple(declared)}")
        v = value.detach().to("cpu", dtype).contiguous().reshape(-1)
        if i != self._handle_file:
            self._close_handle()
            self._handle = open(self.out_dir / f.name, "ab")
            self._handle_file = i
        assert self._handle is not None
        if v.numel():
            self._handle.write(v.view(torch.uint8).numpy().data)
        self._next += 1

    def _close_handle(self) -> None:
        if self._handle is not None:
            self._handle.flush()
            self._handle.close()
            self._handle = None

    def close(self) -> list[Path]:
        """Check every declared tensor arrived, write the index (several files), return the files written."""
        self._close_handle()
        if self._next != len(self._order):
            raise RuntimeError(f"{len(self._order) - self._next} declared tensors were never written")
        paths = [self.out_dir / f.name for f in self._files]
        for f, p in zip(self._files, paths, strict=True):
            have = p.stat().st_size
            header = 8 + struct.unpack("<Q", p.open("rb").read(8))[0]
            if have != header + f.nbytes:
                raise RuntimeError(f"{p} has {have} bytes, its header says {header + f.nbytes}")
        if len(self._files) > 1:
            index = {
                "metadata": {"total_size": sum(f.nbytes for f in self._files)},
                "weight_map": {n: self._files[i].name for n, i, _ in sorted(self._order, key=lambda o: o[0])},
            }
            (self.out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
            paths.append(self.out_dir / INDEX)
        return paths
