"""Checkpoints that Lightning's FSDP and ModelParallel strategies write, read as plain ones, a tensor at a time.

[Note: resuming a peer's sharded checkpoint]
``FSDPStrategy(state_dict_type="sharded")`` and ``ModelParallelStrategy`` (FSDP2) write a directory as this package
does: ``torch.distributed.checkpoint`` (DCP) files and ``meta.pt``. Theirs hold the model's state under ``model``
(FSDP) or ``state_dict`` (ModelParallel) and each optimizer's under ``optimizer_<i>``, keyed by parameter name
([Note: optimizer state keyed by name] in ``optim/plain_keys.py``); ``meta.pt`` holds the rest of Lightning's
checkpoint (loops, schedulers, callbacks). Lightning's own answer to reading one elsewhere is to consolidate it into
one file first, which holds the whole model and its optimizer state in one process's memory: 84 GB for a 7B Adam run.

``read_peer_checkpoint`` instead gives what ``torch.load`` gives for a plain checkpoint, lazily: ``state_dict`` and
each optimizer's ``state`` are mappings that read a parameter's value, or its optimizer state, from the files when
asked and keep nothing (``PeerValues``, ``_optimizer_state``). DCP reads any saver's sharding into the whole tensor.
The loaders ask for a parameter only where this rank holds a piece of it (``load_values``, ``local_optimizer_state``
in ``memory/consolidate.py``), so a rank's memory grows by one parameter's tensors at a time. Each reads the whole
parameter (a parameter spread over k ranks' shards is read k times; this package's own directories read only the
pieces, [Note: a resume reads what the rank holds]). The small entries (buffers, ``step``, hyperparameters) are read
whole. The optimizer's groups must be made as the saver's were (their names are checked). The files are those of a
complete save: ``check_checkpoint_dir`` checks them against DCP's index first, as for this package's own.

``as_plain(checkpoint)`` also names, as Lightning's Trainer expects, what a one-file consolidation of such a
directory leaves under the directory's names (``model``, ``optimizer_<i>``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from ..files.dcp_tree import DCPTree, is_dcp_directory
from ..system.lazy_mapping import LazyMapping
from .checkpoint_dir import META, check_checkpoint_dir
from .saved_chunks import KEY

_OPTIMIZER = re.compile(r"optimizer_(\d+)")


def as_plain(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` with a ``state_dict`` and ``optimizer_states`` where it holds them under FSDP's or ModelParallel's
    names (``model``; ``optimizer_0``, ``optimizer_1``, ...), as Lightning's own consolidation leaves them."""
    if "state_dict" not in checkpoint and "model" in checkpoint:
        checkpoint["state_dict"] = checkpoint.pop("model")
    numbered = sorted(int(m.group(1)) for k in checkpoint if isinstance(k, str) and (m := _OPTIMIZER.fullmatch(k)))
    if "optimizer_states" not in checkpoint and numbered:
        if numbered != list(range(len(numbered))):
            raise CheckpointError(f"the checkpoint holds optimizer states {numbered}: not 0 to {len(numbered) - 1}")
        checkpoint["optimizer_states"] = [checkpoint.pop(f"optimizer_{i}") for i in numbered]
    return checkpoint


def read_peer_checkpoint(path: str | Path) -> dict[str, Any] | None:
    """The checkpoint in directory ``path`` if Lightning's FSDP or ModelParallel strategy wrote it (else ``None``: a
    directory of this package's, or not a checkpoint, which its own reader explains)."""
    path = Path(path)
    if not (path / META).is_file() or not is_dcp_directory(path):
        return None
    try:
        meta = torch.load(path / META, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - this package's reader names what is wrong with it
        return None
    if not isinstance(meta, dict) or KEY in meta:
        return None
    tree = DCPTree(path)
    model = tree.model_root()
    if model is None:
        return None
    check_checkpoint_dir(path)
    meta["state_dict"] = PeerValues(tree, model)
    optimizers = sorted(int(m.group(1)) for r in tree.roots if isinstance(r, str) and (m := _OPTIMIZER.fullmatch(r)))
    if optimizers:
        meta["optimizer_states"] = [_optimizer(tree, f"optimizer_{i}") for i in optimizers]
    return meta


class PeerValues(LazyMapping[str, Any]):
    """A peer checkpoint's ``state_dict``: each value read from the files when asked."""

    def __init__(self, tree: DCPTree, root: str) -> None:
        super().__init__({p[0]: k for p, k in tree.under(root).items() if len(p) == 1}, self._value)
        self.tree = tree

    def _value(self, key: str) -> Any:
        return self.tree.read([key])[key]

    def shape_of(self, name: str) -> tuple[int, ...]:
        """The value's shape, from the index alone."""
        return tuple(self.tree.shape(self.where[name]))


def _optimizer_state(tree: DCPTree, root: str) -> LazyMapping[str, dict[str, Any]]:
    """A peer checkpoint optimizer's ``state``: parameter name -> its state (``step``, ``exp_avg``, ...), read from
    the files when asked."""
    keys: dict[str, dict[str, str]] = {}
    for p, k in tree.under(root, "state").items():
        if len(p) == 2:
            keys.setdefault(p[0], {})[p[1]] = k

    def read(fields: dict[str, str]) -> dict[str, Any]:
        values = tree.read(list(fields.values()))
        return {field: values[k] for field, k in fields.items()}

    return LazyMapping(keys, read)


def _optimizer(tree: DCPTree, root: str) -> dict[str, Any]:
    fields = tree.under(root, "param_groups")
    values = tree.read(list(fields.values()))
    groups: dict[int, dict[str, Any]] = {}
    for p, k in fields.items():
        if len(p) != 2:
            raise CheckpointError(f"{str(tree.path)!r}: {root}'s param group entry {p} is not (group, field)")
        groups.setdefault(int(p[0]), {})[p[1]] = values[k]
    return {"state": _optimizer_state(tree, root), "param_groups": [groups[j] for j in sorted(groups)]}
