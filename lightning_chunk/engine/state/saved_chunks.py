"""Reading a sharded checkpoint's saved chunks back, whole or only the part a rank holds.

[Note: a resume reads what the rank holds]
A saved chunk is one tensor in the checkpoint, written by every rank of the saving run as a piece of it. A resume
(on any world size, into any layout) once read every saved chunk whole on every rank and kept the pieces its new
shards hold: every rank read the whole checkpoint, world_size times the checkpoint from the shared filesystem
(about 5 TB for 13B on 32 GPUs). Each rank now reads, of each saved chunk, only the span covering the pieces of its
parameters that its new shards hold (``rank_regions``), through a DCP load planner that asks for that span: DCP
then opens only the saved pieces the span overlaps (one, when the layout and world size are unchanged), and a chunk
the rank holds nothing of is not read at all. The span is read into a chunk-sized tensor that is allocated and never
touched elsewhere, so its pages outside the span never become resident: the consumers slice whole parameters from
it as before and read only this rank's pieces.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..chunks.repack import piece_range
from ..errors import CheckpointError
from ..system.host_heap import release_freed_memory

KEY = "chunk_checkpoint"  # the entry of a checkpoint's meta that describes its chunks
Regions = Callable[[dict[str, Any]], tuple[int, int] | None]  # a saved chunk's meta -> the span to read


class _SpanPlanner(DefaultLoadPlanner):
    """Reads elements ``[lo, hi)`` of one saved flat tensor into a buffer of ``hi - lo`` elements."""

    def __init__(self, key: str, lo: int, hi: int) -> None:
        super().__init__()
        self.span = (key, lo, hi)

    def create_local_plan(self) -> LoadPlan:
        key, lo, hi = self.span
        md = self.metadata.state_dict_metadata[key]  # type: ignore[union-attr]
        wanted = ChunkStorageMetadata(offsets=torch.Size([lo]), sizes=torch.Size([hi - lo]))
        return LoadPlan(create_read_items_for_chunk_list(key, md, [wanted]))  # type: ignore[arg-type]

    def lookup_tensor(self, index: Any) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the buffer of the span: read items' offsets are relative to it


def saved_state_dtype(keys: dict[str, Any], key: str, master_dtype: str) -> torch.dtype:
    """The dtype optimizer state ``key`` was saved in for a chunk of ``master_dtype`` masters: an optimizer's
    ``keys`` in ``meta.pt`` map each master dtype to its state's (``OptimizerStateParts.keys``); checkpoints
    written before 2026-11-30 name one dtype for all."""
    entry = keys[key]
    return getattr(torch, entry if isinstance(entry, str) else entry.get(master_dtype, master_dtype))


def load_chunk(
    path: Path, key: str, numel: int, dtype: torch.dtype, span: tuple[int, int] | None = None
) -> torch.Tensor:
    """A saved chunk as a flat tensor of ``numel`` elements; with ``span``, only those elements are read (the rest
    is allocated, never written: [Note: a resume reads what the rank holds])."""
    t = torch.empty(numel, dtype=dtype)
    lo, hi = span if span is not None else (0, numel)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            if span is None:
                dcp.load({key: t}, checkpoint_id=str(path), no_dist=True)
            else:
                dcp.load({key: t[lo:hi]}, checkpoint_id=str(path), no_dist=True, planner=_SpanPlanner(key, lo, hi))
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {str(path)!r}: reading {key!r} failed ({type(e).__name__}: {e}).") from None
    return t


def iter_saved_chunks(
    path: Path,
    meta: dict[str, Any],
    key_of: Callable[[int], str],
    only: Collection[int] | None = None,
    regions: Regions | None = None,
) -> Iterator[tuple[int, dict[str, Any], torch.Tensor]]:
    """Yield ``(chunk index, saved chunk meta, tensor)`` one saved chunk at a time (those in ``only``): the whole
    chunk, or with ``regions`` the span it names (a chunk it names no span of is skipped)."""
    for c, spec in enumerate(meta[KEY]["chunks"]):
        if not spec.get("written", True) or (only is not None and c not in only):  # not in the save
            continue
        span = regions(spec) if regions is not None else None
        if regions is not None and span is None:
            continue
        yield c, spec, load_chunk(path, key_of(c), spec["capacity"], getattr(torch, spec["master_dtype"]), span)
        release_freed_memory()


def rank_regions(mgr: Any, index_of_name: dict[str, int]) -> Regions:
    """For a saved chunk's meta: the span of its elements that holds this rank's pieces of its parameters in the
    current layout, or None when the rank holds none of them."""

    def span(spec: dict[str, Any]) -> tuple[int, int] | None:
        lo, hi = None, None
        for name, off, _numel, _ in spec["slots"]:
            i = index_of_name.get(name)
            if i is None:
                continue
            chunk, info = mgr.lookup(mgr.params[i])
            a, b = piece_range(chunk, info.offset, info.numel)
            if a < b:
                s, e = off + a - info.offset, off + b - info.offset
                lo, hi = (s, e) if lo is None else (min(lo, s), max(hi, e))  # type: ignore[type-var]
        return None if lo is None else (lo, hi)  # type: ignore[return-value]

    return span
