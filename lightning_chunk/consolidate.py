"""``lightning-chunk consolidate``: a sharded checkpoint directory into one plain Lightning checkpoint file.

The Lightning side of the checkpoint format: the engine (``engine/state/checkpoint.py``) writes and reads its
own sections (the shards, and ``meta.pt``'s ``chunk_checkpoint``) and carries whatever else the caller
gave it untouched; this module knows that a Lightning checkpoint keeps the model under ``state_dict``
and the optimizers under ``optimizer_states``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

from .engine.files.torchfile import StreamingTorchFile
from .engine.state.checkpoint import (
    KEY,
    CheckpointError,
    check_checkpoint_dir,
    iter_saved_chunks,
    read_meta,
    saved_state_dtype,
    weights_key,
)
from .engine.state.peer_checkpoint import as_plain, read_peer_checkpoint
from .engine.state.saved_chunks import load_chunk
from .engine.system.atomic import replace_dir
from .engine.system.host_heap import release_freed_memory

T = TypeVar("T")
MODEL_KEY = "state_dict"  # where a Lightning checkpoint keeps the model's state
OPTIMIZERS_KEY = "optimizer_states"  # and the optimizers', one plain optimizer state dict each


def consolidate(
    path: str | Path,
    out: str | Path,
    *,
    with_optimizer: bool = False,
    progress: bool = True,
    ema: bool = False,
    force: bool = False,
) -> Path:
    """Write ``out``: one plain Lightning checkpoint whose ``state_dict`` ``model.load_state_dict`` accepts.

    Streams chunk by chunk (``StreamingTorchFile``), so peak memory stays near one saved chunk however
    large the model. With ``with_optimizer`` the optimizer state goes in too, in the plain
    per-parameter format, so ``Trainer(strategy="auto").fit(ckpt_path=out)`` continues from it.
    Nothing in ``path`` is modified; ``out`` appears only once complete. With ``ema`` the ``state_dict`` holds the
    weights ``ChunkEMA`` averaged, where Lightning's ``WeightAveraging`` puts them in its checkpoints. An existing
    ``out`` is refused unless ``force``, and then replaced only once the new file is complete.
    """
    path = check_checkpoint_dir(path)
    meta = read_meta(path)
    ck = meta[KEY]
    out = check_output(path, out, force=force)
    if with_optimizer and not ck["optimizers"]:
        raise CheckpointError(f"checkpoint {str(path)!r} holds no optimizer state (saved with weights only).")
    key_of = weights_key(meta, path, ema=ema)
    tmp = out.with_name(f".{out.name}.partial")
    writer = StreamingTorchFile(tmp)
    try:
        dtypes = ck["param_dtypes"]
        params = {}
        for spec in ck["chunks"]:
            for name, _, _, shape in spec["slots"]:
                params[name] = writer.placeholder(tuple(shape), getattr(torch, dtypes[name]))
        obj = {k: v for k, v in meta.items() if k not in (KEY, OPTIMIZERS_KEY)}
        entries = ck.get("entries", {})  # what the saver's hooks put in ([Note: the state_dict of a sharded save])
        buffers = {**ck["buffers"], **(ck.get("ema_buffers", {}) if ema else {})}  # [Note: averaged buffers]
        obj[MODEL_KEY] = {
            k: (entries[k] if k in entries else params[ck["aliases"][k]] if k in ck["aliases"] else buffers[k])
            for k in ck["state_dict_keys"]
        }
        optim_records: list[_Record] = []
        if with_optimizer:
            obj[OPTIMIZERS_KEY], optim_records = _optimizer_layout(ck, writer.placeholder)
        writer.write_object(obj)
        bar = _progress(len(params) + len(optim_records), progress, f"consolidating {path.name}")
        for _, spec, full in iter_saved_chunks(path, meta, key_of):
            for name, off, numel, shape in spec["slots"]:
                writer.write(params[name], full[off : off + numel].view(shape))
                bar.update(1)
            del full
        _fill_optimizer_state(path, ck, optim_records, writer.write, bar)
        bar.close()
        writer.close()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    replace_dir(tmp, out) if out.is_dir() else os.replace(tmp, out)
    return out


def read_checkpoint(path: str | Path, map_location: Any = None) -> dict[str, Any]:
    """A sharded checkpoint as ``torch.load`` gives a plain Lightning checkpoint file: the whole weights under
    ``state_dict``, the optimizers' states (``StatesOnRead``: read when first looked into) and what else the saver put
    in beside them (hyperparameters, callbacks' and loops' states). Weights left out of the save (keys deleted in
    ``on_save_checkpoint``) are left out here. ``map_location``, a device or its name, moves every tensor; otherwise
    they stay on the CPU. A directory Lightning's FSDP or ModelParallel strategy saved is read too ([Note: resuming a
    peer's sharded checkpoint])."""
    peer = read_peer_checkpoint(path)
    if peer is not None:
        obj = {k: v for k, v in as_plain(peer).items() if k != "optimizer_states"}
        obj[MODEL_KEY] = dict(obj[MODEL_KEY])
        return _moved(obj, map_location)
    path = check_checkpoint_dir(path)
    meta = read_meta(path)
    ck = meta[KEY]
    states = StatesOnRead(lambda: _moved(plain_optimizer_states(path, ck), map_location)) if ck["optimizers"] else None
    params: dict[str, torch.Tensor] = {}
    for _, spec, full in iter_saved_chunks(path, meta, weights_key(meta, path)):
        for name, off, numel, shape in spec["slots"]:
            params[name] = full[off : off + numel].view(shape).to(getattr(torch, ck["param_dtypes"][name]), copy=True)
        del full
    entries, aliases = ck.get("entries", {}), ck["aliases"]
    obj = {k: v for k, v in meta.items() if k not in (KEY, OPTIMIZERS_KEY)}
    obj[MODEL_KEY] = {
        k: entries[k] if k in entries else params[aliases[k]] if k in aliases else ck["buffers"][k]
        for k in ck["state_dict_keys"]
        if k in entries or aliases.get(k, "") in params or k in ck["buffers"]
    }
    obj = _moved(obj, map_location)
    if states is not None:
        obj[OPTIMIZERS_KEY] = states
    return obj


def plain_optimizer_states(path: Path, ck: dict[str, Any]) -> list[dict[str, Any]]:
    """The optimizers' whole states in the plain per-parameter format, as ``consolidate(with_optimizer=True)`` writes
    them, in memory."""
    states, records = _optimizer_layout(ck, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    _fill_optimizer_state(path, ck, records, lambda t, v: t.copy_(v), _NoBar())
    return states


class StatesOnRead(list):
    """A checkpoint's ``optimizer_states`` read from the shards the first time it is looked into ([Note:
    load_from_checkpoint on a directory] in ``module_loading.py``): a fit resumed under another strategy reads them,
    a test or ``load_from_checkpoint`` never does. Pickled as the plain list it becomes; made from items (as
    ``apply_to_collection`` remakes a sequence), it holds them."""

    def __init__(self, read: Callable[[], list[dict[str, Any]]] | Iterable[dict[str, Any]] = ()) -> None:
        super().__init__(() if callable(read) else read)
        self._read: Callable[[], list[dict[str, Any]]] | None = read if callable(read) else None

    def _fill(self) -> None:
        if self._read is not None:
            read, self._read = self._read, None
            self.extend(read())

    def __iter__(self) -> Any:
        self._fill()
        return super().__iter__()

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def __getitem__(self, i: Any) -> Any:
        self._fill()
        return super().__getitem__(i)

    def __reduce__(self) -> tuple[type, tuple[list[Any]]]:
        return list, (list(self),)


_Record = tuple[int, str, int, str, Any]  # (optimizer, state key, chunk, parameter name, where its value goes)


def _optimizer_layout(ck: dict[str, Any], make: Callable[[tuple[int, ...], torch.dtype], Any]) -> tuple[list, list]:
    """The optimizers' states in the plain per-parameter format, each tensor ``make(shape, dtype)`` (a placeholder
    the caller fills), and a record of where each goes, ordered by (optimizer, key, chunk)."""
    states, records = [], []
    for o, om in enumerate(ck["optimizers"]):
        order = [n for g in om["param_groups"] for n in g["params"]]
        pos = {n: k for k, n in enumerate(order)}
        state: dict[int, dict[str, Any]] = {pos[n]: dict(st) for n, st in om["scalars"].items()}
        has_keys = om.get("held")  # [Note: state keys a parameter has]: every key, without it
        for key in sorted(om["keys"]):
            for c, spec in enumerate(ck["chunks"]):
                dtype = saved_state_dtype(om["keys"], key, spec["master_dtype"])
                for name, _, _, shape in spec["slots"]:
                    if name in om["scalars"] and (has_keys is None or key in has_keys.get(name, ())):
                        state[pos[name]][key] = made = make(tuple(shape), dtype)
                        records.append((o, key, c, name, made))
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [pos[n] for n in g["params"]]}
            for g in om["param_groups"]
        ]
        states.append({"state": dict(sorted(state.items())), "param_groups": groups})
    return states, records


def _fill_optimizer_state(
    path: Path, ck: dict[str, Any], records: list[_Record], put: Callable[[Any, torch.Tensor], Any], bar: Any
) -> None:
    """``put(where, value)`` for each record of ``_optimizer_layout``, one saved chunk's state in memory at a time."""
    loaded: tuple[int, str, int] | None = None
    held: torch.Tensor | None = None
    for o, key, c, name, where in records:
        spec = ck["chunks"][c]
        if (o, key, c) != loaded:
            held = None
            release_freed_memory()
            dtype = saved_state_dtype(ck["optimizers"][o]["keys"], key, spec["master_dtype"])
            held = load_chunk(path, f"chunk.{c}.optim{o}.{key}", spec["capacity"], dtype)
            loaded = (o, key, c)
        _, off, numel, shape = next(s for s in spec["slots"] if s[0] == name)
        assert held is not None
        put(where, held[off : off + numel].view(shape))
        bar.update(1)


def _moved(obj: T, map_location: Any) -> T:
    if isinstance(map_location, (str, torch.device)):
        obj = apply_to_collection(obj, torch.Tensor, lambda t: t.to(map_location))
    return obj


def check_output(checkpoint: Path, out: str | Path, *, force: bool = False) -> Path:
    """``out`` as a path a consolidation may write: outside the checkpoint, in a folder that exists, and new unless
    ``force`` (an empty directory counts as new)."""
    out = Path(out)
    if out.resolve().is_relative_to(checkpoint.resolve()):
        raise CheckpointError(f"output {str(out)!r} is inside the checkpoint {str(checkpoint)!r}; write it elsewhere.")
    if not out.parent.is_dir():
        raise CheckpointError(f"the folder of the output {str(out)!r} does not exist.")
    empty_dir = out.is_dir() and not out.is_symlink() and not any(out.iterdir())
    if os.path.lexists(out) and not empty_dir and not force:
        raise CheckpointError(
            f"output {str(out)!r} exists; name a new one, or pass --force (force=True) to replace "
            "it once the new one is complete."
        )
    return out


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, desc: str) -> Any:
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="tensor")
        except ImportError:
            pass
    return _NoBar()
