"""A sharded save: every rank streams its shards into one DCP save in a partial directory, rank 0 writes
``meta.pt`` last, and the directory is renamed into place ([Note: the checkpoint layout] in ``checkpoint.py``)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..chunks.chunk import Tier
from ..errors import CheckpointError, ChunkError
from ..system.atomic import clear_leftovers, replace_dir
from .background_save import BackgroundSave
from .checkpoint_dir import DCP_INDEX, FORMAT_VERSION, MARK, META, find_partial, mark_partial, partial_path, sha256
from .saved_chunks import KEY
from .shard_writer import GroupedWriter, Make, StreamingPlanner, chunk_of, placeholder


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
        "outside_autocast": [mgr.names[i] for i in sorted(engine.hooks.outside_autocast.moved)],
        "ema_chunks": [c.chunk_id for c in mgr.chunks if selection.ema_shard(c) is not None],
        "ema_buffers": selection.ema_buffers(),
        "world_size": mgr.comm.world_size,
    }


def _optimizer_shards(
    engine: Any, o: int, selection: Selection
) -> tuple[dict[str, tuple[Make, torch.Tensor]], dict[str, Any]]:
    """This rank's per-chunk shards of optimizer ``o``'s per-element state, each a function that makes it when it
    is written and a placeholder ([Note: a save streams the shards]), and the optimizer's meta."""
    from ..memory.consolidate import optimizer_state_parts, state_shard

    b, mgr = engine.bindings[o], engine.manager
    parts = optimizer_state_parts(mgr, b.views(), b.optimizer.state, b.whole_keys)
    out: dict[str, tuple[Make, torch.Tensor]] = {
        f"chunk.{chunk.chunk_id}.optim{o}.{key}": (
            functools.partial(state_shard, mgr, chunk, parts, key),
            placeholder(chunk.shard_numel, parts.dtype(key, chunk)),
        )
        for chunk in mgr.chunks
        if selection.written(chunk)
        for key in parts.in_chunk(chunk)  # a frozen chunk's none: LoRA's base saves no moments of zeros
    }
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [mgr.names[i] for i in b.group_params[n]]}
        for n, g in enumerate(b.optimizer.param_groups)
    ]
    keys = {  # by master dtype, as saved_state_dtype reads them
        k: {str(m).removeprefix("torch."): str(d).removeprefix("torch.") for m, d in by.items()}
        for k, by in parts.keys.items()
    }
    scalars = {mgr.names[i]: st for i, st in parts.scalars.items() if i not in selection.excluded}
    held = {mgr.names[i]: sorted(parts.held.get(i, ())) for i in parts.scalars if i not in selection.excluded}
    return out, {"param_groups": groups, "keys": keys, "scalars": scalars, "held": held}


def _as_saved(local: dict[str, torch.Tensor], comm: Any) -> dict[str, Any]:
    """Wrap each rank's shard as a DTensor sharded on dim 0 (plain tensors with one rank), left on the host.

    The mesh is a CPU mesh over ``comm.host_group()``: ``DTensor.from_local`` moves a local tensor to
    its mesh's device type, so a mesh of the NCCL group staged every shard (masters and the whole optimizer
    state of an offloaded run) in device memory at the first checkpoint."""
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


def _write_meta(meta: dict[str, Any], target: Path) -> None:
    tmp = target.with_name(target.name + ".tmp")
    torch.save(meta, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)


class CheckpointSaveError(ChunkError, RuntimeError):
    """A save that failed on some rank; the checkpoint previously at the path is untouched."""


@dataclasses.dataclass
class SaveJob:
    """A sharded save as taken from the training state at one moment: a placeholder for each shard (what DCP
    plans with), the function that makes the shard when the writer reaches it ([Note: a save streams the
    shards]), and ``meta.pt``'s content but the index checksum. ``run`` writes it, on the calling thread or on a
    thread beside training ([Note: training beside a save] in ``background_save.py``)."""

    mgr: Any
    path: Path
    local: dict[str, torch.Tensor]
    make: dict[str, Make]
    fresh: set[str]  # items whose ``make`` returns a tensor of its own (a copy), not a view of the training state
    extra: dict[str, Any]
    head: dict[str, Any]  # format and package version, the optimizers' meta
    layout: dict[str, Any]

    def run(self, comm: Any) -> None:
        """Every rank calls this. Writes ``path`` (a directory) atomically; see [Note: the checkpoint layout].

        A failure on any rank (a full disk, a write error, an exception while reading the shards) raises on every
        rank, removes the partial directory and leaves whatever was at ``path`` as it was; the training state in
        memory is only read, so a later save can succeed."""
        path, partial = self.path, partial_path(self.path)
        # each step raises on every rank if it failed on any, before the next begins
        # with replicas, the first shard group writes the shards ([Note: replicas of the shard group])
        token = secrets.randbits(62)  # rank 0's marks its directory ([Note: one directory every rank sees])
        _on_each_rank(comm, path, "preparing", lambda: _prepare(path, partial, token) if comm.all_rank == 0 else None)
        if comm.all_size > 1:
            token = int(comm.broadcast(torch.tensor([token]), 0, what=f"the save of {str(path)!r}").item())
            _on_each_rank(comm, path, "finding rank 0's directory", lambda: find_partial(partial, token, comm.all_rank))
        _on_each_rank(comm, path, "writing its shards", lambda: self._write(comm, partial, comm.replica_index == 0))
        _on_each_rank(comm, path, "finishing", lambda: self._finish(partial) if comm.all_rank == 0 else None)

    def _write(self, comm: Any, partial: Path, writes: bool) -> None:
        try:
            if not writes:  # a replica of the first shard group: its shards are the same ones
                return
            per_chunk: dict[int | None, int] = {}
            for name, t in self.local.items():
                per_chunk[chunk_of(name)] = per_chunk.get(chunk_of(name), 0) + t.numel() * t.element_size()
            with warnings.catch_warnings():  # one rank: "assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
                dcp.save(
                    _as_saved(self.local, comm),
                    storage_writer=GroupedWriter(str(partial), max(per_chunk.values(), default=0)),
                    no_dist=comm.world_size == 1,
                    process_group=comm.host_group() if comm.world_size > 1 else None,
                    planner=StreamingPlanner(self.mgr, self.make),
                )
        finally:
            self.local, self.make = {}, {}
            self.mgr.tiers.page_out()

    def _finish(self, partial: Path) -> None:
        (partial / MARK).unlink()
        meta = dict(self.extra)
        meta[KEY] = {**self.head, "index_sha256": sha256(partial / DCP_INDEX), **self.layout}
        _write_meta(meta, partial / META)
        replace_dir(partial, self.path)


def stage_save(
    engine: Any,
    path: str | Path,
    extra: dict[str, Any],
    *,
    with_optimizer: bool,
    version: str = "",
    state_dict: dict[str, Any] | None = None,
    copy_meta: bool = False,
) -> SaveJob:
    """Every rank calls this (a collective with several ranks). The save of the training state as it is now;
    ``state_dict``: the one ``placeholder_state_dict`` offered, as the caller's hooks left it ([Note: the
    state_dict of a sharded save]); ``None``: the whole model. ``copy_meta``: every value the meta holds is
    copied, for a save written while training goes on. A failure on any rank raises on every rank."""
    staged: list[SaveJob] = []
    _on_each_rank(
        engine.manager.comm,
        Path(path),
        "staging",
        lambda: staged.append(_stage(engine, path, extra, with_optimizer, version, state_dict, copy_meta)),
    )
    return staged[0]


def _stage(
    engine: Any,
    path: str | Path,
    extra: dict[str, Any],
    with_optimizer: bool,
    version: str,
    state_dict: dict[str, Any] | None,
    copy_meta: bool,
) -> SaveJob:
    mgr = engine.manager
    selection = Selection(engine, state_dict)
    local: dict[str, torch.Tensor] = {}
    make: dict[str, Make] = {}
    fresh: set[str] = set()
    for c in mgr.chunks:
        if selection.written(c):
            make[f"chunk.{c.chunk_id}.master"] = functools.partial(_master, c)
            local[f"chunk.{c.chunk_id}.master"] = placeholder(c.shard_numel, c.master_dtype)
    for c in mgr.chunks:  # the average of the weights, beside the masters ([Note: a sharded EMA])
        shard = selection.ema_shard(c)
        if shard is not None:
            make[f"chunk.{c.chunk_id}.ema"] = functools.partial(_detached, shard)
            local[f"chunk.{c.chunk_id}.ema"] = placeholder(shard.numel(), shard.dtype)
    optim_meta = []
    tier_of = {c.chunk_id: c.shard_tier for c in mgr.chunks}
    if with_optimizer:
        for o in range(len(engine.bindings)):
            shards, om = _optimizer_shards(engine, o, selection)
            for name, (fn, shape) in shards.items():
                make[name], local[name] = fn, shape
                if tier_of[chunk_of(name)] is not Tier.DISK:  # a disk shard's state is read in place, any other
                    fresh.add(name)  # copied into a shard of its own
            optim_meta.append(om)
    head = {"format_version": FORMAT_VERSION, "version": version, "optimizers": optim_meta}
    layout = describe_layout(engine, selection)
    if copy_meta:
        extra, head, layout = copy.deepcopy((extra, head, layout))
    return SaveJob(mgr, Path(path), local, make, fresh, dict(extra), head, layout)


def save_sharded(
    engine: Any,
    path: str | Path,
    extra: dict[str, Any],
    *,
    with_optimizer: bool,
    version: str = "",
    state_dict: dict[str, Any] | None = None,
    background: bool = False,
) -> BackgroundSave | None:
    """Every rank calls this. Writes ``path`` atomically (``SaveJob.run``); with ``background`` on a thread beside
    training, returned once the save is staged ([Note: training beside a save]). A save waits for the one before
    it, and raises there if that one failed."""
    engine.manager.readers.settle()
    engine.settle_state()  # a resumed state no step read yet: the save may overwrite the checkpoint it is in
    if engine.early is not None:  # a backward that raised may have left host steps running on their thread
        engine.early.backward_ended()
    job = stage_save(
        engine,
        path,
        extra,
        with_optimizer=with_optimizer,
        version=version,
        state_dict=state_dict,
        copy_meta=background,
    )
    if not background:
        job.run(engine.manager.comm)
        return None
    save = BackgroundSave(job, engine.manager.comm.beside(), copy_aside=engine.config.host_memory_limit is None)
    engine.manager.readers.add(save)
    save.start()
    return save


def when_saved(engine: Any, fn: Callable[[], None]) -> None:
    """Run ``fn`` once the save in flight has succeeded, now when none is; never when it fails (removing an older
    checkpoint waits for the new one, so that a kill in between still leaves one to resume from)."""
    running = [r for r in engine.manager.readers.running if isinstance(r, BackgroundSave)]
    if running:
        running[-1].then(fn)
    else:
        fn()


def _prepare(path: Path, partial: Path, token: int) -> None:
    clear_leftovers(path)
    shutil.rmtree(partial, ignore_errors=True)  # a stale one from an interrupted save
    partial.mkdir(parents=True)
    mark_partial(partial, token)


def _master(c: Any) -> torch.Tensor:
    """The master shard where it lives (the writer copies a device one to the host)."""
    return c.master_tensor_for_read().detach()


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach()


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
    if comm.all_rank == 0:
        shutil.rmtree(partial_path(path), ignore_errors=True)
    comm.failed_ranks(True, what=f"removing the partial save of {str(path)!r}")  # gone before any rank returns
    kept = (
        f"the checkpoint already at {str(path)!r} is untouched"
        if os.path.lexists(path)
        else f"nothing was written at {str(path)!r}"
    )
    if isinstance(error, CheckpointError):  # the checkpoint asked for is refused (the same on every rank)
        raise error
    if error is not None:
        raise CheckpointSaveError(
            f"[rank {comm.all_rank}] saving checkpoint {str(path)!r} failed while {what}: "
            f"{_describe(error).rstrip('.')}. {kept[0].upper() + kept[1:]}."
        ) from error
    raise CheckpointSaveError(
        f"[rank {comm.all_rank}] saving checkpoint {str(path)!r} failed on rank(s) {failed} while "
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
