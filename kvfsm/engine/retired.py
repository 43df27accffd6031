"""The ids of drained instances, so that a message naming one is reported ``late``, not ``unknown``.

Draining is on the hot path and the lookup is not: it runs only for a
message whose id names no live instance. So a drain records its ids as one
list, in O(1), and the lookup index is built from those lists when asked,
once per id. At least the newest ``limit`` ids are remembered; the oldest
are forgotten a whole list at a time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class RetiredIds:
    __slots__ = ("_batches", "_count", "_index", "_indexed", "_serial", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._batches: deque[tuple[int, list[Hashable]]] = deque()
        self._count = 0
        self._index: dict[Hashable, int] = {}
        """Id → serial of the newest list it is in, for the lists with a serial below ``_indexed``."""
        self._indexed = 0
        self._serial = 0

    def __len__(self) -> int:
        return self._count

    def add(self, ids: list[Hashable]) -> None:
        """Remember ``ids`` (the list is kept: the caller must not change it afterwards)."""
        if not ids:
            return
        batches = self._batches
        batches.append((self._serial, ids))
        self._serial += 1
        self._count += len(ids)
        while self._count - len(batches[0][1]) >= self.limit:
            serial, old = batches.popleft()
            self._count -= len(old)
            if serial < self._indexed:
                index = self._index
                for ident in old:
                    if index.get(ident) == serial:
                        del index[ident]

    def __contains__(self, ident: object) -> bool:
        """Raises TypeError for an unhashable ``ident``, as a dict lookup does."""
        if self._indexed < self._serial:
            fresh = []
            for serial, ids in reversed(self._batches):
                if serial < self._indexed:
                    break
                fresh.append((serial, ids))
            index = self._index
            for serial, ids in reversed(fresh):
                index.update(dict.fromkeys(ids, serial))
            self._indexed = self._serial
        return ident in self._index
