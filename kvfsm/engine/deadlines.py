"""Deadlines as one FIFO per timed state (or phase), with lazy cancellation.

Every deadline a state arms is ``clock() + after`` with that state's single
``after``, so with a monotonic clock the order of arming is the order of
expiry: a deque per state is already sorted and arming is an append, not a
heap push.

Invariant: an entry ``(due, key)`` is live iff ``armed[key] is entry``. Only
:meth:`arm` and :meth:`arm_many` make entries (``Tracker.fire`` inlines
:meth:`arm`, its one copy: a call per event is a cost ``kvfsm bench`` shows);
to disarm, a caller pops ``armed[key]`` (``armed.pop(key, None)``: a key
disarmed already, by ``pop_due`` or a forced release, is no error), which
leaves the entry dead in its queue. Dead entries are dropped when they reach
the front of their queue, and :meth:`sweep` (run by ``poll`` and
``finished``) drops them all once they outnumber the live ones, so
``pop_due`` costs O(due + dead), never a scan of all armed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator

Entry = tuple[float, Hashable]


class Deadlines:
    __slots__ = ("armed", "queues")

    def __init__(self, count: int) -> None:
        """``count`` queues, one per timed thing (a state, by its index; a phase): nothing armed."""
        self.armed: dict[Hashable, Entry] = {}
        self.queues: list[deque[Entry]] = [deque() for _ in range(count)]

    def __len__(self) -> int:
        return len(self.armed)

    def arm(self, key: Hashable, state: int, due: float) -> None:
        """Arm ``key`` (not armed already) in ``state``'s queue: one step entering a timed state (fire inlines this)."""
        entry = (due, key)
        self.armed[key] = entry
        self.queues[state].append(entry)

    def arm_many(self, keys: list[Hashable], state: int, due: float) -> None:
        """Arm every key (none armed already) in ``state``'s queue, all due at once: a group's step."""
        entries = [(due, key) for key in keys]
        self.armed.update(zip(keys, entries, strict=True))
        self.queues[state].extend(entries)

    def sweep(self, slack: int = 4096) -> None:
        """Drop dead entries, in place, once there are more than ``slack`` beyond twice the live ones.

        Amortised O(1) per disarm. ``poll`` sweeps with the default slack; a
        tracker that is drained but never polled still sweeps (from
        ``finished()``), with a larger slack, so memory stays bounded either way.
        """
        armed = self.armed
        if sum(map(len, self.queues)) <= 2 * len(armed) + slack:
            return
        for queue in self.queues:
            live = [e for e in queue if armed.get(e[1]) is e]
            queue.clear()
            queue.extend(live)

    def ends(self) -> list[int]:
        """Each queue's length now: entries past these were armed later (see :meth:`pop_due`)."""
        return [len(q) for q in self.queues]

    def pop_due(self, now: float, ends: list[int] | None = None) -> Iterator[tuple[Hashable, int]]:
        """Yield (and disarm) ``(key, queue index)`` for each deadline at or before ``now``.

        Lazy, so the caller may fire each timeout (and arm new deadlines) before
        taking the next. Deadlines armed during this pass (or after ``ends``
        was taken), in any queue, wait for the next poll, so timeouts cannot
        chain or spin within one poll.
        """
        armed, queues = self.armed, self.queues
        if ends is None:
            ends = self.ends()
        for index, queue in enumerate(queues):
            for _ in range(ends[index]):
                if not queue or queue[0][0] > now:
                    break
                entry = queue.popleft()
                key = entry[1]
                if armed.get(key) is entry:
                    del armed[key]
                    yield key, index

    def next_due(self, prune: bool = True) -> float | None:
        """The earliest live deadline, or None; ``prune`` drops the dead entries it passes (never during a
        ``pop_due`` pass: its ``ends`` count the entries there were, so a pruned queue would let it run on
        into deadlines armed during the pass)."""
        armed = self.armed
        best: float | None = None
        for queue in self.queues:
            if prune:
                while queue and armed.get(queue[0][1]) is not queue[0]:
                    queue.popleft()
                first = queue[0] if queue else None
            else:
                first = next((e for e in queue if armed.get(e[1]) is e), None)
            if first is not None and (best is None or first[0] < best):
                best = first[0]
        return best
