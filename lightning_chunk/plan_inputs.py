"""What ``lightning-chunk plan`` reads besides the model: a class from its path, and a LightningCLI config's
sections (its precision plugin, its callbacks)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import lightning as L

from .precision import ChunkPrecision


def load_class(spec: str) -> type:
    """``package.module.Class``, ``package.module:Class`` or ``path/to/file.py:Class`` (relative to the current
    folder)."""
    if ":" in spec:
        file, name = spec.rsplit(":", 1)
        path = Path(file)
        if not path.is_file():
            if file.endswith(".py") or "/" in file or "\\" in file:
                raise ValueError(
                    f"{spec!r}: {file!r} is not a file (a path is taken from the current folder, {str(Path.cwd())!r})."
                )
            return load_class(f"{file}.{name}")  # package.module:Class
        mod_name = f"_lightning_chunk_plan_{path.stem}"
        module = sys.modules.get(mod_name)
        if module is None:
            s = importlib.util.spec_from_file_location(mod_name, path)
            assert s is not None and s.loader is not None
            module = importlib.util.module_from_spec(s)
            sys.modules[mod_name] = module
            s.loader.exec_module(module)
    else:
        mod_path, _, name = spec.rpartition(".")
        if not mod_path:
            raise ValueError(
                f"{spec!r} is not a class path: use package.module.Class, package.module:Class or "
                "path/to/file.py:Class."
            )
        try:
            module = importlib.import_module(mod_path)
        except ImportError as e:
            raise ValueError(
                f"{spec!r}: cannot import {mod_path!r} ({e}); give an importable package.module, or "
                "path/to/file.py:Class."
            ) from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{spec!r}: no {name!r} there.") from None


def _entries(trainer: dict[str, Any], key: str) -> list[tuple[str, dict[str, Any]]]:
    """A config's ``trainer.plugins`` or ``trainer.callbacks`` as ``(class name, init_args)`` (a ``class_path``
    entry, or the class path alone)."""
    given = trainer.get(key) or []
    out = []
    for c in given if isinstance(given, list) else [given]:
        path = c.get("class_path", "") if isinstance(c, dict) else c
        if isinstance(path, str):
            out.append((path.rsplit(".", 1)[-1], (c.get("init_args") or {}) if isinstance(c, dict) else {}))
    return out


def chunk_precision_args(trainer: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a ``ChunkPrecision`` among a config's ``trainer.plugins`` (its ``precision`` sets it in place
    of ``trainer.precision``, and ``reduce_dtype`` the gradient payloads' dtype); ``{}``: there is none."""
    for name, args in _entries(trainer, "plugins"):
        if name == "ChunkPrecision":
            return {"precision": "32-true", **args}
    return {}


def chunk_precision(precision: str, args: dict[str, Any]) -> ChunkPrecision:
    """The ``ChunkPrecision`` of a config's ``trainer.plugins`` (``chunk_precision_args``) under ``precision``: its
    ``fp32_embeddings_and_norms``, ``full_precision_modules`` (class paths) and ``reduce_dtype`` set the payloads'
    dtypes, as the fit's plugin will."""
    given = {k: v for k, v in args.items() if k != "precision"}
    modules = given.get("full_precision_modules")
    if isinstance(modules, (list, tuple)):
        given["full_precision_modules"] = [load_class(m) if isinstance(m, str) else m for m in modules]
    return ChunkPrecision(precision, **given)


def has_async_save(trainer: dict[str, Any]) -> bool:
    """Lightning's ``AsyncCheckpointIO`` among a config's ``trainer.plugins``: saves written beside training."""
    return any(name == "AsyncCheckpointIO" for name, _ in _entries(trainer, "plugins"))


def has_chunk_ema(trainer: dict[str, Any]) -> bool:
    """A ``ChunkEMA`` among a config's ``trainer.callbacks``."""
    return any(name == "ChunkEMA" for name, _ in _entries(trainer, "callbacks"))


def has_train_dataloader(model_cls: type) -> bool:
    return getattr(model_cls, "train_dataloader", None) is not getattr(L.LightningModule, "train_dataloader", None)
