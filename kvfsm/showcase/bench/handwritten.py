"""The baseline: the tracker a connector author writes by hand, doing the same work as Tracker and no more.

A ``__slots__`` record per request (int state, deadline entry) in a dict, a
tuple of per-state dicts mapping an event to a precomputed edge, the driver
methods bound once. ``fire`` checks legality (unknown event raises, ignored
event is a no-op), runs the edge's ``do``/acquire actions, changes state,
disarms (lazily) and arms the deadline, runs the releases and records a
finished request. What it leaves out is exactly what the Tracker adds on top:
the lock (``threadsafe=True`` adds the same one), run-to-completion queueing, error isolation per action and
``on_error``, counters, generations, heap compaction, observers.

The tables are written out by hand, as a connector author would, not derived
from the spec; ``tests/test_bench.py`` checks they make the same driver calls
as the Tracker.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from ...errors import DuplicateKey, IllegalTransition

Action = Callable[..., Any]
Edge = tuple[int, tuple[Action, ...], tuple[Action, ...], float | None, bool]
"""(target, actions before the state change, releases after it, timeout of the target, target is final)."""

IGNORE: Any = object()
"""Table value for an event that is a legal no-op in that state."""


class Req:
    __slots__ = ("deadline", "state")

    def __init__(self, state: int) -> None:
        self.state = state
        self.deadline: tuple[float, int, Hashable] | None = None


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
        self.clock = clock
        self.reqs: dict[Hashable, Req] = {}
        self.heap: list[tuple[float, int, Hashable]] = []
        self.seq = itertools.count()
        self.done: list[Hashable] = []
        self.unknown = 0
        self.lock = threading.RLock() if threadsafe else None
        """One lock per call, as a connector author makes it safe for worker threads."""

    def begin(self, key: Hashable) -> None:
        lock = self.lock
        if lock is not None:
            lock.acquire()
        try:
            if key in self.reqs:
                raise DuplicateKey(key)
            self.reqs[key] = Req(0)
        finally:
            if lock is not None:
                lock.release()

    def fire(self, key: Hashable, event: str) -> int | None:
        lock = self.lock
        if lock is not None:
            lock.acquire()
        try:
            req = self.reqs.get(key)
            if req is None:
                self.unknown += 1
                return None
            edge = self.table[req.state].get(event)
            if edge is None:
                raise IllegalTransition(key, event, self.names[req.state], list(self.table[req.state]))
            if edge is IGNORE:
                return req.state
            target: int
            target, before, releases, timeout, final = edge
            for action in before:
                action(key)
            req.state = target
            if req.deadline is not None:
                req.deadline = None  # lazy disarm: the heap entry is skipped when it surfaces
            if timeout is not None:
                entry = (self.clock() + timeout, next(self.seq), key)
                req.deadline = entry
                heapq.heappush(self.heap, entry)
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
        heap, reqs, timeout_events = self.heap, self.reqs, self.timeout_events
        fired = 0
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            key = entry[2]
            req = reqs.get(key)
            if req is None or req.deadline is not entry:
                continue  # disarmed since
            req.deadline = None
            event = timeout_events[req.state]
            assert event is not None
            self.fire(key, event)
            fired += 1
        return fired

    def finished(self) -> list[tuple[Hashable, str]]:
        done, self.done = self.done, []
        reqs, names = self.reqs, self.names
        return [(key, names[reqs.pop(key).state]) for key in done]


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
