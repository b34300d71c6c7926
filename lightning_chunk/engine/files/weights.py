"""Weights read from disk straight into the chunks: a plain ``state_dict`` file, a consolidated
``lightning-chunk`` file, a ``save_pretrained`` directory of ``safetensors`` shards, or the sharded directory of
Lightning's FSDP or ModelParallel strategy.

[Note: streamed weight loading] Nothing here reads a whole model. ``open_weights`` maps the file
(``torch.load(mmap=True)``; ``safetensors`` maps its shards) and reads a tensor, or only the piece
``[a, b)`` of its flat elements, when the pack asks for it; the pack copies it into the chunk
being built and lets go. When every tensor of a chunk comes from the file, each rank reads only
the piece its shard holds (no broadcast: the file is the same for every rank), so a rank touches
about ``1 / world_size`` of the file. ``ModuleWeights`` matches the file's names to the module's
(finding the prefix when the module wraps the saved model, e.g. ``model.``) and checks names and
shapes for every tensor before the first value is read: missing, unexpected or mis-shaped tensors
are one error listing them, raised before any parameter is written.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from .dcp_tree import DCPTree, is_dcp_directory

INDEX_SUFFIX = ".safetensors.index.json"
_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightsError(ValueError):
    """A weights file that cannot be read, or that does not match the module."""


class Weights:
    """Names, shapes and dtypes of a weights file's tensors, and lazy reads of them (or of flat pieces)."""

    path: Path

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> torch.Size:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def read(self, key: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        """Flat elements ``[a, b)`` of ``key`` (all by default), on the host, in the file's dtype."""
        raise NotImplementedError


class TorchFileWeights(Weights):
    """A ``torch.save`` file: a state dict, or a Lightning checkpoint with a ``state_dict`` (memory-mapped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # a Lightning checkpoint pickles its hyperparameters: the user named this file
            if "weights_only" not in str(e) and "Unpickler" not in str(e) and "unpickl" not in str(e).lower():
                raise WeightsError(f"{path} is not a file torch.load can read: {e}") from None
            obj = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
            raise WeightsError(
                f"{path} holds a {type(obj).__name__}, not a state dict (names to tensors) or a "
                "checkpoint with a 'state_dict'."
            )
        self._t = {k: v for k, v in obj.items() if torch.is_tensor(v)}

    def keys(self) -> list[str]:
        return list(self._t)

    def shape(self, key: str) -> torch.Size:
        return self._t[key].shape

    def dtype(self, key: str) -> torch.dtype:
        return self._t[key].dtype

    def read(self, key: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        return self._t[key].reshape(-1)[a:b]


class SafetensorsWeights(Weights):
    """One ``.safetensors`` file, or a directory with a ``*.safetensors.index.json`` and its shards."""

    def __init__(self, path: Path, files: dict[str, Path]) -> None:
        try:
            from safetensors import safe_open
        except ImportError:
            raise WeightsError(
                f"{path} holds safetensors files; reading them needs the safetensors package: "
                "pip install 'lightning_chunk[hf]' (or pip install safetensors)."
            ) from None
        self.path = path
        self._open: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        self._meta: dict[str, tuple[torch.Size, torch.dtype]] = {}
        for key, file in files.items():
            f = self._open.get(file)
            if f is None:
                if not file.is_file():
                    raise WeightsError(f"{path}: the index names {file.name} for {key!r}, but that file is missing.")
                f = self._open[file] = safe_open(str(file), framework="pt", device="cpu")
            if key not in f.keys():
                raise WeightsError(f"{path}: the index puts {key!r} in {file.name}, which does not hold it.")
            sl = f.get_slice(key)
            dt = _ST_DTYPES.get(sl.get_dtype())
            if dt is None:
                raise WeightsError(f"{file}: tensor {key!r} has dtype {sl.get_dtype()}, which is not supported.")
            self._where[key] = file
            self._meta[key] = (torch.Size(sl.get_shape()), dt)

    @classmethod
    def from_file(cls, file: Path) -> SafetensorsWeights:
        from safetensors import safe_open

        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = list(f.keys())
        return cls(file, {k: file for k in keys})

    @classmethod
    def from_index(cls, index: Path) -> SafetensorsWeights:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {e}") from None
        return cls(index.parent, {k: index.parent / v for k, v in weight_map.items()})

    def keys(self) -> list[str]:
        return list(self._meta)

    def shape(self, key: str) -> torch.Size:
        return self._meta[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key][1]

    def read(self, key: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        shape = self.shape(key)
        numel = math.prod(shape)
        b = numel if b is None else b
        f = self._open[self._where[key]]
        if len(shape) == 0 or (a == 0 and b == numel):
            return f.get_tensor(key).reshape(-1)[a:b]
        row = math.prod(shape[1:])  # read the rows that cover [a, b) only
        r0, r1 = a // row, -(-b // row)
        return f.get_slice(key)[r0:r1].reshape(-1)[a - r0 * row : b - r0 * row]


class DCPWeights(Weights):
    """The model's state in a directory Lightning's FSDP or ModelParallel strategy saved: a tensor read whole from
    the shard files when asked ([Note: resuming a peer's sharded checkpoint] in ``state/peer_checkpoint.py``)."""

    def __init__(self, tree: DCPTree, root: str) -> None:
        self.path, self.tree = tree.path, tree
        self._keys = {p[0]: k for p, k in tree.under(root).items() if len(p) == 1 and tree.dtype(k) is not None}

    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> torch.Size:
        return self.tree.shape(self._keys[key])

    def dtype(self, key: str) -> torch.dtype:
        dtype = self.tree.dtype(self._keys[key])
        assert dtype is not None
        return dtype

    def read(self, key: str, a: int = 0, b: int | None = None) -> torch.Tensor:
        k = self._keys[key]
        return self.tree.read([k])[k].reshape(-1)[a:b]


def open_weights(path: str | Path) -> Weights:
    """A weights file or directory, by what it holds (see the module docstring)."""
    p = Path(path)
    if p.is_dir():
        indexes = sorted(p.glob(f"*{INDEX_SUFFIX}"))
        if len(indexes) > 1:
            raise WeightsError(
                f"{p} holds several safetensors indexes ({', '.join(i.name for i in indexes)}); name the one to load."
            )
        if indexes:
            return SafetensorsWeights.from_index(indexes[0])
        singles = sorted(p.glob("*.safetensors"))
        if len(singles) == 1:
            return SafetensorsWeights.from_file(singles[0])
        tree = DCPTree(p) if is_dcp_directory(p) else None
        root = tree.model_root() if tree is not None else None
        if tree is not None and root is not None:
            return DCPWeights(tree, root)
        if (p / "meta.pt").is_file():
            raise WeightsError(
                f"{p} is a sharded lightning-chunk checkpoint: resume from it with ckpt_path=, or "
                "turn it into one file with `lightning-chunk consolidate` and load that."
            )
        what = f"{len(singles)} .safetensors files and no *{INDEX_SUFFIX}" if singles else "no weights"
        raise WeightsError(
            f"{p} is a directory with {what}: expected a save_pretrained directory (safetensors "
            f"shards and a *{INDEX_SUFFIX}) or one model.safetensors."
        )
    if not p.is_file():
        raise WeightsError(f"weights {str(path)!r}: no such file or directory.")
    if p.name.endswith(INDEX_SUFFIX):
        return SafetensorsWeights.from_index(p)
    if p.suffix == ".safetensors":
        return SafetensorsWeights.from_file(p)
    return TorchFileWeights(p)


def _listing(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


class ModuleWeights:
    """Which of ``module``'s tensors ``weights`` provides, matched by name and checked before any read.

    ``prefix``: what the module's names have in front of the file's (``None``: the submodule prefix,
    ``""`` included, under which most of the file's names are found). ``strict``: every parameter and
    persistent buffer must be in the file; otherwise the ones that are not keep their own values.
    """

    def __init__(
        self,
        weights: Weights,
        module: torch.nn.Module,
        *,
        strict: bool = True,
        prefix: str | None = None,
        optional: Collection[int] = (),
        wrapped: Callable[[str], str | None] | None = None,
    ) -> None:
        """``optional``: ids of tensors the file need not hold (adapters added to a pretrained model);
        ``wrapped(name)``: where a file name is found in the model when a wrapper moved it (``None``: nowhere else),
        as ``peft`` moves ``q_proj.weight`` to ``q_proj.base_layer.weight``."""
        self.weights = weights
        named = module.state_dict(keep_vars=True)  # parameters and persistent buffers, every name of a tied one
        file_keys = weights.keys()

        def find(name: str) -> torch.Tensor | None:
            t = named.get(name)
            moved = wrapped(name) if t is None and wrapped is not None else None
            return named.get(moved) if moved is not None else t

        if prefix is None:
            candidates = [""] + [f"{n}." for n, _ in module.named_modules() if n]
            prefix = max(candidates, key=lambda c: (sum(find(c + k) is not None for k in file_keys), -len(c)))
        self.prefix = prefix
        self.key_of: dict[int, str] = {}  # id(tensor) -> file key
        unexpected, shapes = [], []
        for k in file_keys:
            t = find(prefix + k)
            if t is None:
                unexpected.append(k)
            elif tuple(t.shape) != tuple(weights.shape(k)):
                shapes.append(f"{k}: {tuple(weights.shape(k))} in the file, {tuple(t.shape)} in the model")
            else:
                self.key_of.setdefault(id(t), k)
        in_file = {prefix + k for k in file_keys}
        missing = (
            [n for n, t in named.items() if id(t) not in self.key_of and n not in in_file and id(t) not in optional]
            if strict
            else []
        )
        problems = []
        if missing:
            problems.append(f"missing from the file ({len(missing)}): {_listing(missing)}")
        if unexpected:
            problems.append(f"in the file but not in the model ({len(unexpected)}): {_listing(unexpected)}")
        if shapes:
            problems.append(f"of another shape ({len(shapes)}): {_listing(shapes, 6)}")
        if problems:
            where = f" (model names = '{prefix}' + file names)" if prefix else ""
            raise WeightsError(
                f"weights {weights.path} do not match {type(module).__name__}{where}; nothing was "
                "loaded. Tensors " + "; ".join(problems) + "."
            )
        self.buffers = [
            (m, n, b) for m in module.modules() for n, b in m._buffers.items() if b is not None and id(b) in self.key_of
        ]

    def provides(self, t: torch.Tensor) -> bool:
        return id(t) in self.key_of

    def read(self, t: torch.Tensor, a: int = 0, b: int | None = None) -> torch.Tensor:
        return self.weights.read(self.key_of[id(t)], a, b)
