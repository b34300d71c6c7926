"""A checkpoint directory: its files, whether it is complete, what its ``meta.pt`` says, and whether it fits the
engine that loads it ([Note: the checkpoint layout] in ``checkpoint.py``)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..errors import CheckpointError, ChunkError
from .saved_chunks import KEY

FORMAT_VERSION = 2  # 2 (2026-12-07): a chunk's optimizer state only for keys its parameters have; reads 1 too
META = "meta.pt"
DCP_INDEX = ".metadata"
MARK = ".rank0"  # in a partial directory while it is written: the number rank 0 drew for this save
SEEN_WITHIN_S = 60.0  # how long a rank looks for rank 0's mark: NFS may cache a directory's entries 60 s (acdirmax)


class NotSharedError(ChunkError, FileNotFoundError):
    """A rank does not see the directory rank 0 made for a save: the path is not on storage every node shares."""


def mark_partial(partial: Path, token: int) -> None:
    (partial / MARK).write_text(str(token))


def find_partial(partial: Path, token: int, rank: int) -> None:
    """Wait until this rank sees rank 0's mark in ``partial``, else raise ``NotSharedError``.

    [Note: one directory every rank sees]
    Every rank writes its shards into the one partial directory rank 0 made, and rank 0 alone renames it into
    place. A path on storage private to each node (a local disk, a ``/tmp``, a node-local NVMe) has a directory of
    that name on every node: DCP's writer made it where it was missing, each node's ranks wrote there, the save
    "succeeded", and the checkpoint on rank 0's node lacked every other node's shards (the others' were left as a
    partial directory nothing removes), found only when a resume failed. So before any shard is written, rank 0
    writes a number it drew into its partial directory, and every rank must read that number there (a number, not
    the directory alone: another node may hold a stale directory of that name); one that cannot
    within ``SEEN_WITHIN_S`` (a network file system may show a new file late) fails the save on every rank before a
    byte of it is written, naming the storage a sharded checkpoint needs (as DCP's and FSDP's need it). A resume first
    has every rank say whether it finds the checkpoint, and refuses on every rank where some do not
    (``_seen_by_every_rank`` in ``checkpointing.py``)."""
    within_s = SEEN_WITHIN_S
    deadline = time.monotonic() + within_s
    while True:
        try:
            if (partial / MARK).read_text() == str(token):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            break
        try:
            os.listdir(partial.parent)  # a directory read revalidates a network file system's cached view
        except OSError:
            pass
        time.sleep(0.2)
    raise NotSharedError(
        f"rank {rank} does not see the directory {str(partial)!r} that rank 0 made for this checkpoint (after "
        f"{within_s:.0f} s): every rank writes its shards into one directory, so the checkpoint path must be on "
        "storage every node shares (NFS, Lustre, GPFS, a shared volume), not a disk local to each node"
    )


def partial_path(path: str | Path) -> Path:
    path = Path(path)
    return path.parent / f".{path.name}.partial"


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir()


def check_checkpoint_dir(path: str | Path) -> Path:
    """Raise ``CheckpointError`` naming the file and what is wrong, unless ``path`` is a complete checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist.")
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a file, not a sharded lightning_chunk checkpoint directory.")
    meta, index = path / META, path / DCP_INDEX
    if not meta.is_file() and ((path / "latest").is_file() or any(path.glob("*/*mp_rank_*_model_states.pt"))):
        raise CheckpointError(
            f"{str(path)!r} is a DeepSpeed checkpoint, which chunk_offload does not resume: "
            "lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict(path, 'model.pt') "
            "writes its weights to one file, and ChunkOffloadStrategy(weights='model.pt') starts a fit from them "
            "(DeepSpeed's optimizer state is not read)."
        )
    if not meta.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a complete lightning_chunk checkpoint: {META} is missing "
            "(rank 0 writes it last; an interrupted save leaves a '.NAME.partial' directory instead)."
        )
    if not index.is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a complete lightning_chunk checkpoint: the "
            f"torch.distributed.checkpoint index {str(index)!r} is missing."
        )
    try:
        md = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable index is the same problem to the user
        raise CheckpointError(f"{str(index)!r} cannot be read ({type(e).__name__}: {e}).") from None
    need: dict[str, int] = {}
    for info in getattr(md, "storage_data", {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(need.items()):
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"shard file {str(f)!r} is missing from checkpoint {str(path)!r}.")
        have = f.stat().st_size
        if have < size:
            raise CheckpointError(
                f"shard file {str(f)!r} is truncated: it has {have} bytes, the index "
                f"{str(index)!r} expects at least {size}."
            )
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    path = check_checkpoint_dir(path)
    try:
        meta = torch.load(path / META, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{str(path / META)!r} cannot be read ({type(e).__name__}: {e}).") from None
    if not isinstance(meta, dict) or KEY not in meta:
        raise CheckpointError(f"{str(path / META)!r} holds no '{KEY}' section: not a lightning_chunk checkpoint.")
    saved_hash = meta[KEY].get("index_sha256")
    if saved_hash is not None and saved_hash != sha256(path / DCP_INDEX):
        raise CheckpointError(
            f"{str(path / META)!r} and {str(path / DCP_INDEX)!r} come from different saves: "
            "meta.pt records another index than the one in the directory (files copied in from "
            "another checkpoint?). Use a complete checkpoint directory as it was written."
        )
    if meta[KEY].get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{str(path / META)!r} has format version {meta[KEY]['format_version']}; this "
            f"lightning_chunk reads up to {FORMAT_VERSION}. Upgrade lightning_chunk."
        )
    return meta


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_compatible(meta: dict[str, Any], engine: Any, path: str | Path) -> None:
    """Same parameter names and shapes, or an error listing the differences (before anything is touched)."""
    saved: dict[str, tuple] = meta[KEY]["params"]
    mgr = engine.manager
    current = {n: tuple(p.shape) for n, p in zip(mgr.names, mgr.params, strict=True)}
    # left out by the saver's hooks: a missing key for the strict load that follows ([Note: the state_dict of a
    # sharded save]), not a sign of another model
    missing = sorted(set(current) - set(saved) - set(meta[KEY].get("excluded", ())))
    extra = sorted(set(saved) - set(current))
    shapes = [
        f"{n}: checkpoint {saved[n]} vs model {current[n]}"
        for n in sorted(set(saved) & set(current))
        if tuple(saved[n]) != current[n]
    ]
    if not (missing or extra or shapes):
        _check_master_dtypes(meta, engine, path)
        return
    parts = []
    if missing:
        parts.append(f"parameters missing from the checkpoint: {missing}")
    if extra:
        parts.append(f"parameters the model does not have: {extra}")
    if shapes:
        parts.append(f"shapes differ: {shapes}")
    raise CheckpointError(f"checkpoint {str(path)!r} was written for another model; " + "; ".join(parts) + ".")


def _check_master_dtypes(meta: dict[str, Any], engine: Any, path: str | Path) -> None:
    """The saved masters must be of the run's master dtype: loading float32 masters into a bf16-true run would
    round them silently, and bf16 ones into a float32 run would resume with another optimizer precision."""
    mgr = engine.manager
    mine = {t.name: str(c.master_dtype).replace("torch.", "") for c in mgr.chunks for t in c.tensors}
    differ: dict[tuple[str, str], list[str]] = {}
    for spec in meta[KEY]["chunks"]:
        for name, *_ in spec["slots"]:
            if name in mine and mine[name] != spec["master_dtype"]:
                differ.setdefault((spec["master_dtype"], mine[name]), []).append(name)
    if differ:
        parts = [
            f"{len(names)} parameters (e.g. {names[0]!r}) were saved as {saved}, this run keeps {run}"
            for (saved, run), names in sorted(differ.items())
        ]
        raise CheckpointError(
            f"checkpoint {str(path)!r} was written with another precision: " + "; ".join(parts) + ". Resume with "
            "the precision it was saved with, or start a run in the new precision from its weights "
            "(`lightning-chunk consolidate` writes them to a file that `weights=` or `load_state_dict` reads)."
        )


def weights_key(meta: dict[str, Any], path: str | Path, *, ema: bool = False) -> Callable[[int], str]:
    """The key of each saved chunk's weights: its master shards, or with ``ema`` its average where it has one (a
    chunk of parameters frozen from the start is its own average, [Note: a sharded EMA])."""
    averaged = set(meta[KEY].get("ema_chunks", ())) if ema else set()
    if ema and not averaged:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no average of the weights (saved without ChunkEMA).")
    return lambda c: f"chunk.{c}.{'ema' if c in averaged else 'master'}"


def optim_name(o: int, key: str, c: int) -> str:
    return f"chunk.{c}.optim{o}.{key}"
