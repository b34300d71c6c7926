"""The modules a micro-batch ran, compared across ranks.

With sharded chunks every rank must run the same modules that own parameters, in the same order: a rank that
skipped a module whose payload happened to be resident would issue no collective at all and go unnoticed, until a
later step in which the payload was evicted desynchronised the all-gathers. So each backward's end compares a CRC
of the moments since the last check (one fixed-size agreement collective), and only when the CRCs differ gathers
the sequences to name the first difference.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

from .collectives import CollectiveMismatchError, first_difference

GRADIENTS = "gradients"  # the entry a backward's end adds: whether parameter gradients arrived in it


class ModuleSequence:
    def __init__(self) -> None:
        self.moments: list[tuple[str, str]] = []  # (kind, module key), or (GRADIENTS, "delivered" / "none ...")

    def add(self, kind: str, key: str) -> None:
        self.moments.append((kind, key))

    def clear(self) -> None:
        self.moments = []

    def check(
        self, comm: Any, chunks_of: Callable[[str], tuple[int, ...]], hint: Callable[[list[str]], str] = lambda _: ""
    ) -> None:
        """Raise ``CollectiveMismatchError`` naming the first moment where the ranks differ, and ``hint`` of the
        modules the ranks ran there; start a new sequence."""
        seq, self.moments = self.moments, []
        if comm.all_size == 1:
            return
        crc = zlib.crc32(repr(seq).encode())
        if comm.agree_on_value(crc, what="the check that every rank ran the same modules"):
            return
        seqs = comm.all_gather_object(seq)
        i = first_difference(seqs)

        def at(r: int) -> str:
            if i >= len(seqs[r]):
                return "nothing more"
            kind, key = seqs[r][i]
            if kind == GRADIENTS:
                return f"the end of a backward, parameter gradients {key}"
            return f"{kind} of module {key!r} (chunks {list(chunks_of(key))})"

        raise CollectiveMismatchError(
            f"[rank {comm.all_rank}] ranks ran different modules in this micro-batch; first difference at moment {i}: "
            + "; ".join(f"rank {r}: {at(r)}" for r in range(len(seqs)))
            + ". Every rank must run the same modules that own parameters, in the same order (no data-dependent "
            "skipping): with sharded chunks a skipped module desynchronises the all-gathers."
            + hint(sorted({s[i][1] for s in seqs if i < len(s) and s[i][0] != GRADIENTS}))
        )
