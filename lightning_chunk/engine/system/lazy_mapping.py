"""A mapping whose values are read only when asked: what lets a checkpoint be loaded a tensor at a time through code
written for plain dicts ([Note: resuming a peer's sharded checkpoint] in ``state/peer_checkpoint.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LazyMapping(Mapping[K, V]):
    """Each key ``k`` of ``where`` maps to ``read(where[k])``, called at every lookup and kept nowhere. Membership and
    iteration read nothing (``Mapping``'s own ``__contains__`` would read the value)."""

    def __init__(self, where: Mapping[K, Any], read: Callable[[Any], V]) -> None:
        self.where, self.read = where, read

    def __getitem__(self, key: K) -> V:
        return self.read(self.where[key])

    def __iter__(self) -> Iterator[K]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def __contains__(self, key: object) -> bool:
        return key in self.where
