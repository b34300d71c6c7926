"""Write a file ``torch.load`` reads, producing its tensors one at a time.

``torch.save`` needs every tensor in memory at once. Its format does not: a zip archive with
``data.pkl`` (the object, pickled with each storage replaced by a key) and one ``data/<key>``
record per storage. ``StreamingTorchFile`` pickles the object with *placeholder* tensors (right
shape and dtype, storage released, so they cost nothing), then writes each placeholder's record
when its data arrives. Peak memory is the largest tensor in flight, not the whole object.
"""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.serialization as ts


class StreamingTorchFile:
    def __init__(self, path: Path) -> None:
        self._ctx = ts._open_zipfile_writer(str(path))
        self._zip = self._ctx.__enter__()  # the PyTorchFileWriter itself
        self._numel: dict[int, tuple[str, int]] = {}  # storage cdata -> (key, numel)
        self._pending: list[torch.Tensor] = []  # placeholders, in key order
        self._extra: list[torch.UntypedStorage] = []  # real storages met while pickling (buffers, scalars)
        self._next = 0

    def placeholder(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor that pickles as a record to be written later, holding no memory now."""
        t = torch.empty(shape, dtype=dtype)
        numel = t.numel()
        t.untyped_storage().resize_(0)
        self._numel[t.untyped_storage()._cdata] = (str(len(self._numel)), numel)
        self._pending.append(t)
        return t

    def write_object(self, obj: Any) -> None:
        numel, extra = self._numel, self._extra

        def persistent_id(o: Any) -> Any:
            if isinstance(o, torch.storage.TypedStorage):
                untyped, dtype_name = o._untyped_storage, o._pickle_storage_type()
                entry = numel.get(untyped._cdata)
                if entry is None:  # a real tensor (a buffer): written right after the placeholders
                    entry = numel[untyped._cdata] = (str(len(numel)), o._size())
                    extra.append(untyped)
                return ("storage", getattr(torch, dtype_name), entry[0], "cpu", entry[1])
            return None

        buf = io.BytesIO()
        pickler = pickle.Pickler(buf, protocol=2)
        pickler.persistent_id = persistent_id  # type: ignore[method-assign]
        pickler.dump(obj)
        data = buf.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", "1", len("1"))
        alignment = str(ts._get_storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))

    def write(self, placeholder: torch.Tensor, value: torch.Tensor) -> None:
        """The data of ``placeholder`` (placeholders must be written in the order they were made)."""
        key, numel = self._numel[placeholder.untyped_storage()._cdata]
        if key != str(self._next):
            raise RuntimeError(f"record {key} written out of order (expected {self._next})")
        v = value.detach().to("cpu", placeholder.dtype).contiguous()
        if v.numel() != numel:
            raise ValueError(f"record {key}: {v.numel()} elements for a placeholder of {numel}")
        if v.storage_offset() != 0 or v.untyped_storage().nbytes() != v.numel() * v.element_size():
            v = v.clone()  # a view into a larger buffer: only its own bytes (write_record takes whole storages)
        self._zip.write_record(f"data/{key}", v.untyped_storage(), v.numel() * v.element_size())
        del v
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._pending):
            raise RuntimeError(f"{len(self._pending) - self._next} placeholder records were never written")
        for storage in self._extra:
            storage = storage.cpu()
            self._zip.write_record(f"data/{self._next}", storage, storage.nbytes())
            self._next += 1
        self._ctx.__exit__(None, None, None)
