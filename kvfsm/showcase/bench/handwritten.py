"""The baseline: the tracker a connector author writes by hand, doing the same work as Tracker and no more.

It has the Tracker's own layout, the fastest one measured for plain Python:
a dict key → int state, a tuple of per-state dicts mapping an event to a
precomputed edge, one FIFO of deadline entries per timed state (a state's
timeout is fixed, so entries go in due order and need no heap) with a dict
of the armed entry per key, and the driver methods bound once. ``fire``
checks legality (unknown event raises, ignored event is a no-op), runs the
edge's ``do``/acquire actions, changes state, disarms and arms the deadline,
runs the releases and records a finished request. What it leaves out is
exactly what the Tracker adds on top: the lock (``threadsafe=True`` adds an
``RLock``, as a connector author would), run-to-completion queueing, error isolation per action and
``on_error``, payload checks, counters, generations, observers.

The tables are written out by hand, as a connector author would, not derived
from the spec; ``tests/test_bench.py`` checks they make the same driver calls
as the Tracker.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ...errors import DuplicateKey, IllegalTransition

Action = Callable[..., Any]
TableEdge = tuple[int, tuple[Action, ...], tuple[Action, ...], float | None, bool]
"""(target, actions before the state change, releases after it, timeout of the target, target is final)."""

IGNORE: Any = object()
"""Table value for an event that is a legal no-op in that state."""


class HandTracker:
    """A hand-written tracker over one hand-written table (see :func:`kv_request_table`)."""

    def __init__(
        self,
        table: Sequence[dict[str, Any]],
        names: Sequence[str],
        timeout_events: Sequence[str | None],
        clock: Callable[[], float],
        threadsafe: bool = False,
    ) -> None:
        self.table = table
        self.names = names
        self.timeout_events = timeout_events
        self.timed = tuple(event is not None for event in timeout_events)
        self.clock = clock
        self.states: dict[Hashable, int] = {}
        self.armed: dict[Hashable, tuple[float, Hashable]] = {}
        self.queues: tuple[deque[tuple[float, Hashable]], ...] = tuple(deque() for _ in names)
        self.done: list[Hashable] = []
        self.unknown = 0
        self.lock = threading.RLock() if threadsafe else None
        """One lock per call, as a connector author makes it safe for worker threads."""

    def begin(self, key: Hashable) -> None:
        lock = self.lock
        if lock is not None:
            lock.acquire()
        try:
            if key in self.states:
                raise DuplicateKey(key)
            self.states[key] = 0
        finally:
            if lock is not None:
                lock.release()

    def fire(self, key: Hashable, event: str) -> int | None:
        lock = self.lock
        if lock is not None:
            lock.acquire()
        try:
            state = self.states.get(key)
            if state is None:
                self.unknown += 1
                return None
            edge = self.table[state].get(event)
            if edge is None:
                raise IllegalTransition(key, event, self.names[state], list(self.table[state]))
            if edge is IGNORE:
                return state
            target: int
            target, before, releases, timeout, final = edge
            for action in before:
                action(key)
            self.states[key] = target
            if self.timed[state]:
                self.armed.pop(key, None)
            if timeout is not None:
                entry = (self.clock() + timeout, key)
                self.armed[key] = entry
                self.queues[target].append(entry)
            for action in releases:
                action(key)
            if final:
                self.done.append(key)
            return target
        finally:
            if lock is not None:
                lock.release()

    def poll(self, now: float) -> int:
        """Fire every due timeout; returns how many fired."""
        armed, timeout_events = self.armed, self.timeout_events
        fired = 0
        for state, queue in enumerate(self.queues):
            while queue and queue[0][0] <= now:
                entry = queue.popleft()
                key = entry[1]
                if armed.get(key) is not entry:
                    continue  # disarmed since
                del armed[key]
                event = timeout_events[state]
                assert event is not None
                self.fire(key, event)
                fired += 1
        return fired

    def finished(self) -> list[tuple[Hashable, str]]:
        done, self.done = self.done, []
        states, names = self.states, self.names
        return [(key, names[states.pop(key)]) for key in done]


KV_REQUEST_STATES = ("pinned", "queued", "transferring", "done", "failed", "aborted", "expired")


def kv_request_table(driver: Any, transfer_timeout: float) -> list[dict[str, Any]]:
    """specs/kv_request.yaml written out by hand: who releases what on which edge."""
    _pinned, queued, transferring, done, failed, aborted, expired = range(7)
    free, task_done = driver.free_gpu_blocks, driver.task_done
    both = (free, task_done)
    final_row = dict.fromkeys(("abort", "complete", "fail", "expire"), IGNORE)
    return [
        {
            "enqueue": (queued, (driver.enqueue_job,), (), None, False),
            "fail": (failed, (), (free,), None, True),
            "abort": (aborted, (), (free,), None, True),
        },
        {
            "start": (transferring, (driver.start_transfer,), (), transfer_timeout, False),
            "fail": (failed, (), both, None, True),
            "abort": (aborted, (), both, None, True),
        },
        {
            "complete": (done, (), both, None, True),
            "fail": (failed, (), both, None, True),
            "abort": (aborted, (), both, None, True),
            "expire": (expired, (), both, None, True),
        },
        dict(final_row),
        dict(final_row),
        dict(final_row),
        dict(final_row),
    ]


def kv_request_tracker(
    driver: Any, clock: Callable[[], float], transfer_timeout: float = 30.0, *, threadsafe: bool = False
) -> HandTracker:
    timeouts = (None, None, "expire", None, None, None, None)
    return HandTracker(kv_request_table(driver, transfer_timeout), KV_REQUEST_STATES, timeouts, clock, threadsafe)


def pingpong_tracker(driver: Any, clock: Callable[[], float]) -> HandTracker:
    """The scaling spec (see ``workloads.PINGPONG``) by hand."""
    idle, busy, aborted = range(3)
    table: list[dict[str, Any]] = [
        {"ping": (busy, (driver.take_slot,), (), None, False), "abort": (aborted, (), (), None, True)},
        {"pong": (idle, (), (driver.give_slot,), None, False), "abort": (aborted, (), (driver.give_slot,), None, True)},
        {},
    ]
    return HandTracker(table, ("idle", "busy", "aborted"), (None, None, None), clock)
