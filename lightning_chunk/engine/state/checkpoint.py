"""Sharded checkpoints: every rank writes its own shards in parallel; any world size loads them.

[Note: the checkpoint layout]
A checkpoint is a directory ``NAME.ckpt/`` holding

- ``.metadata`` and ``__<rank>_<group>_0.distcp``: a ``torch.distributed.checkpoint`` (DCP) save in which
  each rank wrote, for every chunk, its shard of the fp32 master (``chunk.<c>.master``) and of
  each per-element optimizer state (``chunk.<c>.optim<o>.<key>``, e.g. Adam's ``exp_avg``), as
  DTensors sharded on dim 0 over the ranks (plain tensors with one rank), a chunk or two a file
  ([Note: a save streams the shards] in shard_writer.py);
- ``meta.pt``, written by rank 0 last: whatever the caller passed (Lightning: loops, callbacks, LR
  schedulers, precision state such as the loss scale), the library version, the chunk layout that
  maps each parameter to a chunk and offset, the buffers, the optimizers' param groups and their
  scalar state (``step``). The engine does not interpret the caller's part; ``lightning_chunk/consolidate.py``
  knows how a Lightning checkpoint keeps the model and the optimizers.

No rank ever holds more than its own shards plus one chunk. A save goes to ``.NAME.ckpt.partial``
next to the target and is renamed into place only after every rank's shards and ``meta.pt`` are
on disk: a save that dies half-way leaves the previous checkpoint untouched, and the dot-named
partial directory is never taken for a checkpoint (``ckpt_path="last"`` matches ``last*.ckpt``).

Loading never assumes the saver's layout or world size: it streams the saved chunks one at a
time (each rank reads whole chunks, ``no_dist``), and every rank copies out the pieces of each
parameter that its *own* current layout assigns to it, optimizer state included. Peak memory is
one saved chunk beyond this rank's shards.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError, ChunkError
from ..system.atomic import clear_leftovers, replace_dir
from .saved_chunks import KEY, iter_saved_chunks, rank_regions
from .shard_writer import GroupedWriter, Make, StreamingPlanner, chunk_of, placeholder

FORMAT_VERSION = 1
META = "meta.pt"
DCP_INDEX = ".metadata"


def partial_path(path: str | Path) -> Path:
    path = Path(path)
    return path.parent / f".{path.name}.partial"


# ================================================================== checks
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
    if saved_hash is not None and saved_hash != _sha256(path / DCP_INDEX):
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


# ============================================================ what to save
def placeholder_state_dict(engine: Any) -> dict[str, Any]:
    """The module's ``state_dict`` with a meta tensor (the parameter's shape and dtype, no data) for each packed
    parameter and the buffers as they are: what a sharded save offers the caller's hooks ([Note: the state_dict
    of a sharded save])."""
    mgr = engine.manager
    out: dict[str, Any] = {}
    for k, v in engine.module.state_dict(keep_vars=True).items():
        if id(v) in mgr.index_of:
            _, info = mgr.lookup(v)
            out[k] = torch.empty(info.shape, dtype=info.orig_dtype, device="meta")
        else:
            out[k] = v.detach() if torch.is_tensor(v) else v
    return out


class Selection:
    """What a sharded save writes of the model, after the caller's hooks edited the state_dict it was offered.

    [Note: the state_dict of a sharded save]
    Lightning hands the checkpoint dict to ``on_save_checkpoint`` before the strategy writes it, and users edit its
    ``state_dict`` there: they drop a frozen backbone or a teacher (a LoRA run keeping only its adapters), or add
    entries (an EMA's weights). A sharded save wrote every shard and ignored the dict, so a dropped key was saved
    anyway and an added entry was lost without a word. The dict offered (``placeholder_state_dict``) holds a meta
    tensor for each packed parameter; at the save, a parameter none of whose keys is left is *excluded* (not
    written: its slots leave the layout, a chunk with nothing left is not written at all, its optimizer
    state goes with it), and every entry that is not a meta tensor (a buffer, a replaced value, a new key) is
    kept in ``meta.pt`` as the caller gave it (rank 0's). At load the checkpoint's ``state_dict`` is rebuilt the
    same way (meta tensors for what the shards hold, the kept entries as saved) and loaded after
    ``on_load_checkpoint``, with Lightning's strictness: an excluded parameter is a missing key unless the hook
    supplies it or ``strict_loading`` is off, in which case it keeps the value it has (the pretrained weights a
    LoRA run loads in ``configure_model``). Every rank must drop the same keys; a save where they differ fails."""

    def __init__(self, engine: Any, state_dict: dict[str, Any] | None) -> None:
        mgr = engine.manager
        sd = engine.module.state_dict(keep_vars=True)
        if state_dict is None:  # the engine's own callers: everything as it is
            state_dict = placeholder_state_dict(engine)
        self.keys = list(state_dict)
        self.aliases = {
            k: mgr.names[mgr.index_of[id(sd[k])]] for k in self.keys if k in sd and id(sd[k]) in mgr.index_of
        }
        for k in self.aliases:  # a meta entry stands for the shards as they are: it cannot carry a conversion
            v, (_, info) = state_dict[k], mgr.lookup(sd[k])
            if torch.is_tensor(v) and v.is_meta and (v.dtype != info.orig_dtype or tuple(v.shape) != info.shape):
                raise CheckpointError(
                    f"the checkpoint's state_dict entry {k!r} was changed to {str(v.dtype).replace('torch.', '')} "
                    f"{tuple(v.shape)} (in on_save_checkpoint), but a sharded checkpoint saves the weights from the "
                    "shards as they are. Convert after `lightning-chunk consolidate`, or use state_dict_type='full'."
                )
        kept = set(self.aliases.values())
        self.excluded = {i for i, n in enumerate(mgr.names) if n not in kept}
        mine = sorted(self.excluded)
        if mgr.comm.world_size > 1 and any(other != mine for other in mgr.comm.all_gather_object(mine)):
            raise CheckpointError(
                "the ranks left different parameters out of the checkpoint's state_dict (in "
                "on_save_checkpoint): every rank must drop the same keys."
            )
        given = {
            k: (v.detach().cpu() if torch.is_tensor(v) else v)
            for k, v in state_dict.items()
            if not (torch.is_tensor(v) and v.is_meta)
        }
        is_buffer = {k for k, v in sd.items() if id(v) not in mgr.index_of and torch.is_tensor(v)}
        self.buffers = {k: v for k, v in given.items() if k in is_buffer and torch.is_tensor(v)}
        self.entries = {k: v for k, v in given.items() if k not in self.buffers}  # replaced values, new keys
        self.ema = getattr(engine, "ema", None)  # a ShardedEMA, whose shards go beside the masters

    def written(self, chunk: Any) -> bool:
        return any(t.slot.param_index not in self.excluded for t in chunk.tensors)

    def ema_buffers(self) -> dict[str, torch.Tensor]:
        """The averaged values of the saved buffers ([Note: averaged buffers]); none without an average."""
        if self.ema is None or self.ema.buffers is None or not self.ema.started:
            return {}
        return self.ema.buffers.saved(self.buffers)

    def ema_shard(self, chunk: Any) -> torch.Tensor | None:
        """The chunk's average, when it has one and is written ([Note: a sharded EMA])."""
        return self.ema.shard(chunk) if self.ema is not None and self.written(chunk) else None


def describe_layout(engine: Any, selection: Selection) -> dict[str, Any]:
    """The saved chunk layout: enough to find every saved parameter's values in the DCP keys."""
    mgr = engine.manager
    chunks = []
    for c in mgr.chunks:
        chunks.append(
            {
                "capacity": c.capacity_numel,
                "master_dtype": str(c.master_dtype).replace("torch.", ""),
                "slots": [
                    (t.name, t.offset, t.numel, tuple(t.shape))
                    for t in c.tensors
                    if t.slot.param_index not in selection.excluded
                ],
                "written": selection.written(c),
            }
        )
    kept = [i for i in range(len(mgr.params)) if i not in selection.excluded]
    dtypes = {
        t.name: str(t.orig_dtype).replace("torch.", "")
        for c in mgr.chunks
        for t in c.tensors
        if t.slot.param_index not in selection.excluded
    }
    return {
        "chunks": chunks,
        "params": {mgr.names[i]: tuple(mgr.params[i].shape) for i in kept},
        "param_dtypes": dtypes,
        "aliases": selection.aliases,
        "buffers": selection.buffers,
        "entries": selection.entries,
        "state_dict_keys": selection.keys,
        "excluded": [mgr.names[i] for i in sorted(selection.excluded)],
        "ema_chunks": [c.chunk_id for c in mgr.chunks if selection.ema_shard(c) is not None],
        "ema_buffers": selection.ema_buffers(),
        "world_size": mgr.comm.world_size,
    }


def offered_state_dict(ck: dict[str, Any], *, averaged: bool = False) -> dict[str, Any]:
    """A loaded checkpoint's ``state_dict`` as its save was given it: meta tensors for what the shards held, the
    entries kept as they were ([Note: the state_dict of a sharded save]). ``averaged``: the buffers ChunkEMA
    averaged where it did ([Note: averaged buffers])."""
    dtypes, shapes = ck["param_dtypes"], ck["params"]
    buffers = {**ck["buffers"], **(ck.get("ema_buffers", {}) if averaged else {})}
    out: dict[str, Any] = {}
    for k in ck["state_dict_keys"]:
        if k in ck.get("entries", {}):
            out[k] = ck["entries"][k]
        elif k in ck["aliases"]:
            name = ck["aliases"][k]
            out[k] = torch.empty(shapes[name], dtype=getattr(torch, dtypes[name]), device="meta")
        elif k in buffers:
            out[k] = buffers[k]
    return out


def _optimizer_shards(
    engine: Any, o: int, selection: Selection
) -> tuple[dict[str, tuple[Make, torch.Tensor]], dict[str, Any]]:
    """This rank's per-chunk shards of optimizer ``o``'s per-element state, each a function that makes it when it
    is written and a placeholder ([Note: a save streams the shards]), and the optimizer's meta."""
    from ..memory.consolidate import optimizer_state_parts, state_shard

    b, mgr = engine.bindings[o], engine.manager
    parts = optimizer_state_parts(mgr, b.views(), b.optimizer.state)
    out: dict[str, tuple[Make, torch.Tensor]] = {
        f"chunk.{chunk.chunk_id}.optim{o}.{key}": (
            functools.partial(state_shard, mgr, chunk, parts, key),
            placeholder(chunk.shard_numel, parts.keys[key]),
        )
        for chunk in mgr.chunks
        if selection.written(chunk)
        for key in sorted(parts.keys)
    }
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [mgr.names[i] for i in b.group_params[n]]}
        for n, g in enumerate(b.optimizer.param_groups)
    ]
    keys = {k: str(dtype).replace("torch.", "") for k, dtype in parts.keys.items()}
    scalars = {mgr.names[i]: st for i, st in parts.scalars.items() if i not in selection.excluded}
    return out, {"param_groups": groups, "keys": keys, "scalars": scalars}


def _as_saved(local: dict[str, torch.Tensor], engine: Any) -> dict[str, Any]:
    """Wrap each rank's shard as a DTensor sharded on dim 0 (plain tensors with one rank), left on the host.

    The mesh is a CPU mesh over ``Collectives.host_group()``: ``DTensor.from_local`` moves a local tensor to
    its mesh's device type, so a mesh of the NCCL group staged every shard (masters and the whole optimizer
    state of an offloaded run) in device memory at the first checkpoint."""
    comm = engine.manager.comm
    if comm.world_size == 1:
        return local
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = DeviceMesh.from_group(comm.host_group(), "cpu")
    return {
        k: DTensor.from_local(
            t, mesh, [Shard(0)], shape=torch.Size((t.numel() * comm.world_size,)), stride=(1,), run_check=False
        )
        for k, t in local.items()
    }


# ==================================================================== save
def _write_meta(meta: dict[str, Any], target: Path) -> None:
    tmp = target.with_name(target.name + ".tmp")
    torch.save(meta, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)


class CheckpointSaveError(ChunkError, RuntimeError):
    """A save that failed on some rank; the checkpoint previously at the path is untouched."""


def save_sharded(
    engine: Any,
    path: str | Path,
    extra: dict[str, Any],
    *,
    with_optimizer: bool,
    version: str = "",
    state_dict: dict[str, Any] | None = None,
) -> None:
    """Every rank calls this. Writes ``path`` (a directory) atomically; see [Note: the checkpoint layout].
    ``state_dict``: the one ``placeholder_state_dict`` offered, as the caller's hooks left it ([Note: the
    state_dict of a sharded save]); ``None``: the whole model.

    A failure on any rank (a full disk, a write error, an exception while reading the shards) raises on every
    rank, removes the partial directory and leaves whatever was at ``path`` as it was; the training state in
    memory is only read, so a later save can succeed."""
    mgr = engine.manager
    comm = mgr.comm
    path = Path(path)
    partial = partial_path(path)
    selection = Selection(engine, state_dict)
    optim_meta: list[dict[str, Any]] = []
    # each step raises on every rank if it failed on any, before the next begins
    _on_each_rank(comm, path, "preparing", lambda: _prepare(path, partial) if comm.rank == 0 else None)
    _on_each_rank(
        comm,
        path,
        "writing its shards",
        lambda: optim_meta.extend(_write_shards(engine, partial, selection, with_optimizer=with_optimizer)),
    )
    _on_each_rank(
        comm,
        path,
        "finishing",
        lambda: _finish(engine, partial, path, extra, version, optim_meta, selection) if comm.rank == 0 else None,
    )


def _prepare(path: Path, partial: Path) -> None:
    clear_leftovers(path)
    shutil.rmtree(partial, ignore_errors=True)  # a stale one from an interrupted save
    partial.mkdir(parents=True)


def _write_shards(engine: Any, partial: Path, selection: Selection, *, with_optimizer: bool) -> list[dict[str, Any]]:
    mgr = engine.manager
    comm = mgr.comm
    local: dict[str, torch.Tensor] = {}
    make: dict[str, Make] = {}  # [Note: a save streams the shards]
    for c in mgr.chunks:
        if selection.written(c):
            make[f"chunk.{c.chunk_id}.master"] = functools.partial(_master_on_host, c)
            local[f"chunk.{c.chunk_id}.master"] = placeholder(c.shard_numel, c.master_dtype)
    for c in mgr.chunks:  # the average of the weights, beside the masters ([Note: a sharded EMA])
        shard = selection.ema_shard(c)
        if shard is not None:
            local[f"chunk.{c.chunk_id}.ema"] = shard
    optim_meta = []
    if with_optimizer:
        for o in range(len(engine.bindings)):
            shards, om = _optimizer_shards(engine, o, selection)
            for name, (fn, shape) in shards.items():
                make[name], local[name] = fn, shape
            optim_meta.append(om)
    per_chunk: dict[int | None, int] = {}
    for name, t in local.items():
        per_chunk[chunk_of(name)] = per_chunk.get(chunk_of(name), 0) + t.numel() * t.element_size()
    try:
        with warnings.catch_warnings():  # one rank: "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            dcp.save(
                _as_saved(local, engine),
                storage_writer=GroupedWriter(str(partial), max(per_chunk.values(), default=0)),
                no_dist=comm.world_size == 1,
                process_group=comm.host_group() if comm.world_size > 1 else None,
                planner=StreamingPlanner(mgr, make),
            )
    finally:
        del local, make
        mgr.tiers.page_out()
    return optim_meta


def _master_on_host(c: Any) -> torch.Tensor:
    return c.master_tensor_for_read().detach().cpu()


def _finish(
    engine: Any,
    partial: Path,
    path: Path,
    extra: dict[str, Any],
    version: str,
    optim_meta: list[dict[str, Any]],
    selection: Selection,
) -> None:
    layout = describe_layout(engine, selection)
    meta = dict(extra)
    meta[KEY] = {
        "format_version": FORMAT_VERSION,
        "version": version,
        "optimizers": optim_meta,
        "index_sha256": _sha256(partial / DCP_INDEX),
        **layout,
    }
    _write_meta(meta, partial / META)
    replace_dir(partial, path)


def _on_each_rank(comm: Any, path: Path, what: str, fn: Callable[[], Any]) -> None:
    """Run this rank's part of a save, then agree with every rank; raise on every rank if any part failed."""
    error: BaseException | None = None
    try:
        fn()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - reported to the other ranks, then re-raised
        error = e  # (DCP's CheckpointException is a BaseException)
    failed = comm.failed_ranks(error is None, what=f"saving checkpoint {str(path)!r} ({what})")
    if not failed:
        return
    if comm.rank == 0:
        shutil.rmtree(partial_path(path), ignore_errors=True)
    comm.failed_ranks(True, what=f"removing the partial save of {str(path)!r}")  # gone before any rank returns
    kept = (
        f"the checkpoint already at {str(path)!r} is untouched"
        if os.path.lexists(path)
        else f"nothing was written at {str(path)!r}"
    )
    if error is not None:
        raise CheckpointSaveError(
            f"[rank {comm.rank}] saving checkpoint {str(path)!r} failed while {what}: "
            f"{_describe(error)}. {kept[0].upper() + kept[1:]}."
        ) from error
    raise CheckpointSaveError(
        f"[rank {comm.rank}] saving checkpoint {str(path)!r} failed on rank(s) {failed} while "
        f"{what} (see their errors); {kept}."
    )


def _describe(error: BaseException) -> str:
    """One line per failing rank for DCP's exception (whose text is every rank's whole traceback)."""
    failures = getattr(error, "failures", None)
    if isinstance(error, CheckpointException) and isinstance(failures, dict):
        parts = []
        for rank, wrapped in sorted(failures.items()):
            exc = wrapped[0] if isinstance(wrapped, tuple) else getattr(wrapped, "exc", wrapped)
            parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
        return "; ".join(parts)
    return f"{type(error).__name__}: {error}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ==================================================================== load
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
    if missing or extra or shapes:
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


def load_sharded(engine: Any, path: str | Path, *, with_optimizer: bool, averaged: bool = False) -> dict[str, Any]:
    """Every rank calls this. Loads values (and optimizer state) into the engine's current layout; returns meta.
    ``averaged``: the weights are the average the checkpoint holds where it holds one ([Note: a sharded EMA])."""
    from ..memory.consolidate import load_values

    path = check_checkpoint_dir(path)
    meta = read_meta(path)
    check_compatible(meta, engine, path)
    ck = meta[KEY]
    mgr = engine.manager
    index_of_name = {n: i for i, n in enumerate(mgr.names)}
    key_of = weights_key(meta, path, ema=True) if averaged and ck.get("ema_chunks") else lambda c: f"chunk.{c}.master"
    mine = rank_regions(mgr, index_of_name)  # [Note: a resume reads what the rank holds]
    for _, spec, full in iter_saved_chunks(path, meta, key_of, regions=mine):
        load_values(
            mgr, {index_of_name[n]: full[off : off + numel].view(shape) for n, off, numel, shape in spec["slots"]}
        )
        mgr.tiers.page_out()  # what this saved chunk wrote into disk shards leaves the process
    ema = getattr(engine, "ema", None)
    if ema is not None and ck.get("ema_chunks"):  # [Note: a sharded EMA]; ignored by a run without one
        for _, spec, full in iter_saved_chunks(
            path, meta, lambda c: f"chunk.{c}.ema", only=set(ck["ema_chunks"]), regions=mine
        ):
            ema.load({index_of_name[n]: full[off : off + numel] for n, off, numel, _ in spec["slots"]})
    buffers = dict(ck.get("buffers", {}))
    if averaged:  # the buffers averaged with the weights, where there are ([Note: averaged buffers])
        buffers.update(ck.get("ema_buffers", {}))
    if buffers:
        engine.module.load_state_dict(buffers, strict=False)
    if ema is not None and ema.buffers is not None and ck.get("ema_buffers"):
        ema.buffers.load(ck["ema_buffers"])
    if with_optimizer and engine.bindings:
        if not ck["optimizers"]:  # as Lightning says for its own checkpoints
            raise KeyError(
                f"Trying to restore optimizer state but checkpoint {str(path)!r} contains only the model. "
                "This is probably due to `ModelCheckpoint.save_weights_only` being set to `True`."
            )
        if len(ck["optimizers"]) != len(engine.bindings):
            raise CheckpointError(
                f"checkpoint {str(path)!r} holds state for {len(ck['optimizers'])} optimizers, "
                f"the run has {len(engine.bindings)}."
            )
        for o, om in enumerate(ck["optimizers"]):
            _load_optimizer(engine, o, om, path, meta, index_of_name)
    return meta


def _load_optimizer(
    engine: Any, o: int, om: dict[str, Any], path: Path, meta: dict[str, Any], index_of_name: dict[str, int]
) -> None:
    from ..memory.consolidate import local_optimizer_state

    b, mgr = engine.bindings[o], engine.manager
    if len(om["param_groups"]) != len(b.optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: optimizer {o} had {len(om['param_groups'])} param groups, "
            f"the run has {len(b.optimizer.param_groups)}."
        )
    views = b.views()
    local: dict[int, dict[str, Any]] = {}
    for name, st in om["scalars"].items():
        i = index_of_name[name]
        if i in views:
            local[i] = dict(st)
    for key, _dtype in om["keys"].items():
        for _c, spec, full in iter_saved_chunks(
            path, meta, functools.partial(_optim_name, o, key), regions=rank_regions(mgr, index_of_name)
        ):
            whole = {
                index_of_name[n]: {key: full[off : off + numel]}
                for n, off, numel, _ in spec["slots"]
                if index_of_name[n] in local
            }
            for i, st in local_optimizer_state(mgr, views, whole).items():
                chunk = mgr.lookup(mgr.params[i])[0]
                # a disk shard's piece goes straight into its file: no copy of the rank's whole state in memory
                local[i][key] = mgr.tiers.keep_state(chunk, views[i], key, st[key])
            mgr.tiers.page_out()
    mgr.tiers.page_out()
    hypers = [{k: v for k, v in g.items() if k != "params"} for g in om["param_groups"]]
    b.load_local_state(local, hypers)


# ============================================================= consolidate


def _optim_name(o: int, key: str, c: int) -> str:
    return f"chunk.{c}.optim{o}.{key}"
