"""The check that every rank built the same model, before anything is packed.

[Note: the same model on every rank]
Every collective of a chunk (the broadcast of rank 0's values at the first pack, each gather, each reduction) pairs
the ranks' chunks by their order and their size, and the chunks come from the parameters as each rank built them.
A rank whose model differs (a layer more, a vocabulary sized from the data only it read, a config read differently)
packed other chunks: on gloo the first broadcast of unequal size aborted the process (``terminate called after
throwing an instance of 'gloo::EnforceNotMet'``, and the other rank timed out blaming control flow), and one rank
with a layer more waited for a broadcast nobody sent. On NCCL, collectives of unequal sizes are undefined: a hang,
or values read past a buffer. DDP checks the parameters' shapes across ranks as it wraps the module for the same
reason (buffers, broadcast from rank 0 one dtype at a time, meet the same end). Here each rank hashes its parameters
in registration order (name, shape, dtype, ``requires_grad``, param group), then its buffers (name, shape, dtype),
and one all-reduce of the hash (its minimum and its maximum) tells whether all agree; where they do not, the
ranks exchange their lists and every rank raises the same error, naming the first tensor that differs and what each
rank has there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from ..comm.collectives import Collectives
from ..errors import ChunkError

Row = tuple[str, str, tuple[int, ...], str, bool, int | None]  # kind, name, shape, dtype, requires_grad, param group


class ModelsDifferError(ChunkError, ValueError):
    """The ranks built models whose parameters or buffers differ."""


def rows_of(
    named: Sequence[tuple[str, torch.nn.Parameter]], group_of: dict[int, int], module: torch.nn.Module
) -> list[Row]:
    """The parameters in registration order, then the buffers."""
    rows: list[Row] = [
        ("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad, group_of.get(i))
        for i, (n, p) in enumerate(named)
    ]
    return rows + [("buffer", n, tuple(b.shape), str(b.dtype), False, None) for n, b in module.named_buffers()]


def check_same_model(rows: list[Row], comm: Collectives) -> None:
    """Raise ``ModelsDifferError`` on every rank where some rank's ``rows`` differ from another's."""
    if comm.world_size == 1:
        return
    digest = int.from_bytes(hashlib.blake2b(repr(rows).encode(), digest_size=8).digest(), "little") >> 1
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=comm.tensor_device())
    low, minus_high = comm.all_reduce(t, "min", what="the check that every rank built the same model").tolist()
    if low == -minus_high:
        return
    raise ModelsDifferError(describe(comm.all_gather_object(rows)))


def describe(everyone: list[list[Row]]) -> str:
    """The first tensor (parameters in registration order, then buffers) on which the ranks' lists differ, and what
    each rank has there."""
    counts = [len(rows) for rows in everyone]
    k = next((i for i in range(max(counts)) if len({rows[i] if i < len(rows) else None for rows in everyone}) > 1), 0)
    seen: dict[Row | None, list[int]] = {}
    for r, rows in enumerate(everyone):
        seen.setdefault(rows[k] if k < len(rows) else None, []).append(r)
    sides = "; ".join(f"{_ranks(ranks)}: {_row(row)}" for row, ranks in seen.items())
    sizes = "" if len(set(counts)) == 1 else " (" + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)) + ")"
    return (
        f"the ranks built different models: their parameters and buffers{sizes} differ first at entry {k} (from 0: "
        f"the parameters in registration order, then the buffers). {sides}. Every rank must build the same model, "
        "as DDP requires (it checks the shapes as it wraps the module): the same parameters in the same order, with "
        "the same shapes, dtypes, requires_grad and optimizer param groups, and the same buffers. A size read from "
        "data only one rank has (a vocabulary built from its shard), or a config or a random choice that differs "
        "between ranks, does this."
    )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _row(row: Row | None) -> str:
    if row is None:
        return "nothing there"
    kind, name, shape, dtype, trainable, group = row
    said = f"{kind} {name!r} of shape {shape}, {dtype.removeprefix('torch.')}"
    if kind == "buffer":
        return said
    return f"{said}, {'trainable' if trainable else 'frozen'}, " + (
        "in no param group" if group is None else f"param group {group}"
    )
