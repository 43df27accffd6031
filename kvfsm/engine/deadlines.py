"""A heap of per-instance deadlines with lazy cancellation.

Invariant: an entry ``(due, seq, inst)`` is live iff ``inst.deadline is entry``.
Disarming only clears ``inst.deadline``; the dead entry is skipped when it
surfaces, and the heap is rebuilt when dead entries outnumber live ones, so
``pop_due`` costs O((due + dead) log n), never a scan of everything armed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import Any, Protocol


class Armable(Protocol):
    deadline: Any


class DeadlineHeap:
    __slots__ = ("_dead", "_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._dead = 0

    def __len__(self) -> int:
        return len(self._heap) - self._dead

    def arm(self, inst: Armable, due: float) -> None:
        if inst.deadline is not None:
            self._dead += 1
        entry = (due, next(self._seq), inst)
        inst.deadline = entry
        heapq.heappush(self._heap, entry)

    def disarm(self, inst: Armable) -> None:
        inst.deadline = None
        self._dead += 1
        if self._dead > 1024 and self._dead * 2 > len(self._heap):
            self._heap = [e for e in self._heap if e[2].deadline is e]
            heapq.heapify(self._heap)
            self._dead = 0

    def pop_due(self, now: float) -> Iterator[Any]:
        """Yield (and disarm) each instance whose deadline is at or before ``now``, earliest first.

        Lazy, so the caller may fire each timeout (and arm new deadlines) before
        the next is taken. Deadlines armed during this pass wait for the next
        poll, so a state that times out into itself cannot spin.
        """
        heap = self._heap
        fresh = next(self._seq)
        later: list[tuple[float, int, Any]] = []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            inst = entry[2]
            if inst.deadline is not entry:
                self._dead -= 1
            elif entry[1] > fresh:
                later.append(entry)
            else:
                inst.deadline = None
                yield inst
        for entry in later:
            heapq.heappush(heap, entry)

    def next_due(self) -> float | None:
        """The earliest live deadline, or None."""
        heap = self._heap
        while heap and heap[0][2].deadline is not heap[0]:
            heapq.heappop(heap)
            self._dead -= 1
        return heap[0][0] if heap else None
