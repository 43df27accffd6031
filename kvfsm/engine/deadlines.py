"""Deadlines as one FIFO per timed state, with lazy cancellation.

Every deadline a state arms is ``clock() + after`` with that state's single
``after``, so with a monotonic clock the order of arming is the order of
expiry: a deque per state is already sorted and ``arm`` is an append, not a
heap push. Invariant: an entry ``(due, key)`` is live iff ``armed[key] is
entry``; disarming only forgets the key, and dead entries are dropped when
they reach the front (or in a sweep once they outnumber the live ones), so
``pop_due`` costs O(due + dead), never a scan of everything armed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator

Entry = tuple[float, Hashable]


class Deadlines:
    __slots__ = ("_dead", "_polling", "_queues", "armed")

    def __init__(self, states: int) -> None:
        self.armed: dict[Hashable, Entry] = {}
        self._queues: list[deque[Entry]] = [deque() for _ in range(states)]
        self._dead = 0
        self._polling = False

    def __len__(self) -> int:
        return len(self.armed)

    def arm(self, key: Hashable, state: int, due: float) -> None:
        entry = (due, key)
        if self.armed.get(key) is not None:
            self._dead += 1
        self.armed[key] = entry
        self._queues[state].append(entry)

    def disarm(self, key: Hashable) -> None:
        """Forget ``key``'s deadline (if it still has one: ``pop_due`` disarms what it yields)."""
        if self.armed.pop(key, None) is None:
            return
        self._dead += 1
        if self._dead > 4096 and self._dead > 2 * len(self.armed) and not self._polling:
            self._sweep()

    def _sweep(self) -> None:
        """Drop dead entries, in place (``pop_due`` may be part-way through a queue)."""
        armed = self.armed
        for queue in self._queues:
            live = [e for e in queue if armed.get(e[1]) is e]
            queue.clear()
            queue.extend(live)
        self._dead = 0

    def pop_due(self, now: float) -> Iterator[tuple[Hashable, int]]:
        """Yield (and disarm) ``(key, state index)`` for each deadline at or before ``now``.

        Lazy, so the caller may fire each timeout (and arm new deadlines) before
        taking the next. Deadlines armed during this pass, in any state, wait
        for the next poll, so timeouts cannot chain or spin within one poll.
        """
        armed, queues = self.armed, self._queues
        ends = [len(q) for q in queues]  # entries past these were armed during this pass
        self._polling = True
        try:
            for index, queue in enumerate(queues):
                for _ in range(ends[index]):
                    if not queue or queue[0][0] > now:
                        break
                    entry = queue.popleft()
                    key = entry[1]
                    if armed.get(key) is entry:
                        del armed[key]
                        yield key, index
                    else:
                        self._dead -= 1
        finally:
            self._polling = False

    def next_due(self) -> float | None:
        """The earliest live deadline, or None."""
        armed = self.armed
        best: float | None = None
        for queue in self._queues:
            while queue and armed.get(queue[0][1]) is not queue[0]:
                queue.popleft()
                self._dead -= 1
            if queue and (best is None or queue[0][0] < best):
                best = queue[0][0]
        return best
