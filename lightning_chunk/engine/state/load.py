"""Loading a sharded checkpoint into the engine's chunks, on any world size: each rank reads the saved chunks that
overlap what its own layout holds ([Note: a resume reads what the rank holds] in ``saved_chunks.py``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .checkpoint_dir import check_checkpoint_dir, check_compatible, optim_name, read_meta, weights_key
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
            path, meta, functools.partial(optim_name, o, key), regions=rank_regions(mgr, index_of_name)
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
