"""Work running beside training that reads the shards (a save written in the background), and the points where
training must let it finish with what it reads before changing them ([Note: training beside a save] in
``state/background_save.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol


class ShardReader(Protocol):
    def let_go(self, chunks: Iterable[Any] | None) -> None:
        """Return once training may change the shards of ``chunks`` (every chunk when ``None``)."""

    def finish(self) -> None:
        """Return once the work is over; raise its error if it failed."""

    @property
    def done(self) -> bool:
        """The work is over and succeeded: nothing is left to wait for or to raise."""


class ShardReaders:
    """The readers running now. ``before_change`` comes before a step, an EMA update or anything else that writes
    shards in place; ``settle`` before a repack, a load, a save or the end of the run, which move, overwrite or
    free them, and is where a reader's failure is raised: points every rank reaches together."""

    def __init__(self) -> None:
        self._readers: list[ShardReader] = []

    def add(self, reader: ShardReader) -> None:
        self._readers.append(reader)

    @property
    def running(self) -> list[ShardReader]:
        return list(self._readers)

    def before_change(self, chunks: Iterable[Any] | None = None) -> None:
        for r in self._readers:
            r.let_go(chunks)

    def drop_done(self) -> bool:
        """Forget the readers whose work is over and succeeded; whether there were any (what they held is free)."""
        kept = [r for r in self._readers if not r.done]
        dropped, self._readers = len(kept) < len(self._readers), kept
        return dropped

    def settle(self) -> None:
        """Wait for every reader; raise the first failure once all are over."""
        readers, self._readers = self._readers, []
        error: BaseException | None = None
        for r in readers:
            try:
                r.finish()
            except BaseException as e:  # noqa: BLE001 - every reader is waited for before the first error is raised
                error = error or e
        if error is not None:
            raise error
