"""Loading a sharded checkpoint into the engine's chunks, on any world size: each rank reads the saved chunks that
overlap what its own layout holds ([Note: a resume reads what the rank holds] in ``saved_chunks.py``).

[Note: optimizer state read after the warm-up]
A resume restores into the layout a fit starts in, which under a device limit keeps every shard on the host until
the warm-up's trace places them. Read then, the optimizer state (8 of the 18 bytes a bf16-mixed parameter holds)
sat on the host beside everything else, and the warm-up repack carried it chunk by chunk to where it belongs: a
resumed rank held its whole training state on the host twice in a row (the resume, the repack), the phases that
bound the largest model one GPU and its host can train (7B at most on 80 GB with 128 GiB). A fresh fit has no
optimizer state until its first step, after the repack. So a resume does what a fresh fit does: it restores the
values and the param groups' hyperparameters (a scheduler or a callback reads the learning rate before the first
step), and reads each rank's pieces of the per-parameter state (Adam's moments and steps) at the first optimizer
step, after the warm-up repack, straight into the tiers the trace chose (``ChunkEngine.settle_state``). Anything
that reads the state before then reads it first: a save (the checkpoint it resumed from may be the one it
overwrites), the end of fit. Hyperparameters are the optimizer's own then, not read again: a callback may have
changed them. The checkpoint must stay where it is until then: its index files are compared with what the restore saw,
and a changed one raises rather than mixing two saves' state. Removed through the strategy (Lightning's tuners
restore theirs and remove it at once) it is read first. The values cannot wait: the warm-up step runs them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..errors import GROUPS_ADDED_HINT, CheckpointError
from .checkpoint_dir import (
    DCP_INDEX,
    META,
    check_checkpoint_dir,
    check_compatible,
    optim_name,
    read_meta,
    weights_key,
)
from .saved_chunks import KEY, iter_saved_chunks, rank_regions


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


def load_sharded(
    engine: Any,
    path: str | Path,
    *,
    with_optimizer: bool,
    averaged: bool = False,
    defer: bool = False,
    before_optimizer: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every rank calls this. Loads values (and optimizer state) into the engine's current layout; returns meta.
    ``before_optimizer(meta)`` runs between the two (param groups added back: [Note: finetuning callbacks]).
    ``averaged``: the weights are the average the checkpoint holds where it holds one ([Note: a sharded EMA]).
    ``defer``: the per-parameter optimizer state is left to ``engine.settle_state()`` ([Note: optimizer state read
    after the warm-up]); the hyperparameters load now."""
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
    engine.hooks.outside_autocast.restore(ck.get("outside_autocast", ()))  # [Note: parameters read outside autocast]
    ema = getattr(engine, "ema", None)
    if ema is not None and ck.get("ema_chunks"):  # [Note: a sharded EMA]; ignored by a run without one
        for _, spec, full in iter_saved_chunks(
            path, meta, lambda c: f"chunk.{c}.ema", only=set(ck["ema_chunks"]), regions=mine
        ):
            ema.load({index_of_name[n]: full[off : off + numel] for n, off, numel, _ in spec["slots"]})
        ema.after_load()  # [Note: the same averages on every rank]
    buffers = dict(ck.get("buffers", {}))
    if averaged:  # the buffers averaged with the weights, where there are ([Note: averaged buffers])
        buffers.update(ck.get("ema_buffers", {}))
    if buffers:
        engine.module.load_state_dict(buffers, strict=False)
    if ema is not None and ema.buffers is not None and ck.get("ema_buffers"):
        ema.buffers.load(ck["ema_buffers"])
    if with_optimizer and before_optimizer is not None:
        before_optimizer(meta)
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
            _check_groups(engine.bindings[o], o, om, path)
            engine.bindings[o].load_local_state({}, _hypers(om["param_groups"]))
        pending = PendingOptimizerState(path, meta, index_of_name)
        if defer:
            engine.pending_state = pending
        else:
            pending.load(engine)
    return meta


def _hypers(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]


def _check_groups(b: Any, o: int, om: dict[str, Any], path: Path) -> None:
    if len(om["param_groups"]) != len(b.optimizer.param_groups):
        raise CheckpointError(
            f"checkpoint {str(path)!r}: optimizer {o} had {len(om['param_groups'])} param groups, "
            f"the run has {len(b.optimizer.param_groups)}: {GROUPS_ADDED_HINT}."
        )


def _files(path: Path) -> dict[str, tuple[int, int, int] | None]:
    """What identifies a checkpoint directory's contents: inode, size and modification time of the two files that
    name every other and that a save writes last (a save renames a whole directory into place, [Note: the
    checkpoint layout] in ``checkpoint.py``)."""
    out: dict[str, tuple[int, int, int] | None] = {}
    for name in (META, DCP_INDEX):
        try:
            st = (path / name).stat()
        except FileNotFoundError:
            out[name] = None
        else:
            out[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


class PendingOptimizerState:
    """A restored checkpoint's per-parameter optimizer state, read when first needed ([Note: optimizer state read
    after the warm-up])."""

    def __init__(self, path: Path, meta: dict[str, Any], index_of_name: dict[str, int]) -> None:
        self.path, self.meta, self.index_of_name = path, meta, index_of_name
        self.files = _files(path)

    def load(self, engine: Any) -> None:
        """This rank's pieces into the engine's current layout and tiers, the hyperparameters kept as they are."""
        same = torch.tensor([int(_files(self.path) == self.files)], dtype=torch.int32)
        comm = engine.manager.comm
        if comm.world_size > 1:  # every rank raises, or none: a rank alone would leave the others in a collective
            same = comm.all_reduce(same.to(comm.tensor_device()), "min", what="the check of the resumed checkpoint")
        if not same.item():
            raise CheckpointError(
                f"checkpoint {str(self.path)!r} changed between the restore and the first optimizer step, where "
                "its optimizer state is read ([Note: optimizer state read after the warm-up]): keep it in place "
                "until the first step, or resume from a copy."
            )
        for o, om in enumerate(self.meta[KEY]["optimizers"]):
            _load_optimizer(engine, o, om, self.path, self.meta, self.index_of_name)


def _holds(spec: dict[str, Any], held: dict[str, list[str]], key: str) -> bool:
    """Saved chunk ``spec`` has state ``key`` saved: a parameter of it had that key (a frozen chunk has none)."""
    return any(key in held.get(name, ()) for name, *_ in spec["slots"])


def _load_optimizer(
    engine: Any, o: int, om: dict[str, Any], path: Path, meta: dict[str, Any], index_of_name: dict[str, int]
) -> None:
    from ..memory.consolidate import local_optimizer_state

    b, mgr = engine.bindings[o], engine.manager
    views = b.views()
    local: dict[int, dict[str, Any]] = {}
    for name, st in om["scalars"].items():
        i = index_of_name[name]
        if i in views:
            local[i] = dict(st)
    held = om.get("held")  # [Note: state keys a parameter has] in memory/consolidate.py: every key, without it
    chunks = meta[KEY]["chunks"]
    for key, _dtype in om["keys"].items():
        saved = None if held is None else [c for c, spec in enumerate(chunks) if _holds(spec, held, key)]
        for _c, spec, full in iter_saved_chunks(
            path, meta, functools.partial(optim_name, o, key), saved, rank_regions(mgr, index_of_name)
        ):
            whole = {
                index_of_name[n]: {key: full[off : off + numel]}
                for n, off, numel, _ in spec["slots"]
                if index_of_name[n] in local and (held is None or key in held.get(n, ()))
            }
            for i, st in local_optimizer_state(mgr, views, whole, b.whole_keys).items():
                chunk = mgr.lookup(mgr.params[i])[0]
                # a disk shard's piece goes straight into its file: no copy of the rank's whole state in memory
                local[i][key] = mgr.tiers.keep_state(chunk, views[i], key, st[key])
            mgr.tiers.page_out()
    mgr.tiers.page_out()
    b.load_local_state(local, _hypers(b.optimizer.param_groups))
