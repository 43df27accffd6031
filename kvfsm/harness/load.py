"""The closed loop every soak and demo of the transfer drivers runs: ``concurrency`` requests open, a new one as
each ends, until every one has ended or the run's own limit has passed.

A system under load is two calls and an optional third: ``start(indices)``
opens those requests and returns their keys (a request may wait inside the
system until it can begin: it counts as open all the same), ``step()`` steps
the system once and returns the keys of the requests that ended, and
``idle()`` says that nothing is left anywhere (the far side's requests and
deadlines included). The loop times each request from its opening, and
counts it late when it ended after a step that began past its ``deadline``:
step start times, not latencies, so a loop the OS delayed is not taken for a
deadline that did not fire. Once every request has ended it waits up to
``settle`` seconds for ``idle``.

The loop reads time from ``clock`` and idles with ``wait``: the wall clock
and ``time.sleep`` by default. A system that runs in this one process can
run on a :class:`~kvfsm.testing.VirtualClock` instead, moved by its own
``step``: then every deadline fires at the same step in every run, however
busy the machine (what a test that counts expiries needs).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

STARTS_PER_STEP = 64
"""Requests opened per step at most: a wave of 512 opens would delay the next step, and with it every deadline."""


@dataclass
class Loop:
    """What a closed loop did: requests opened and ended, their latencies, the late ones, and the wall time."""

    requests: int
    concurrency: int
    opened: int = 0
    ended: int = 0
    late: int = 0
    wall: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)
    still_open: list[Hashable] = field(default_factory=list)
    """Requests opened that never ended here: hung on this side."""

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile latency in seconds (NaN with none)."""
        if not self.latencies:
            return float("nan")
        if len(self.latencies) == 1:
            return self.latencies[0]
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[round(q) - 1]

    def ms(self) -> dict[str, float]:
        """p50, p99 and max latency in milliseconds, rounded for a report."""
        return {
            "p50_ms": round(1e3 * self.percentile(50), 2) if self.latencies else 0.0,
            "p99_ms": round(1e3 * self.percentile(99), 2) if self.latencies else 0.0,
            "max_ms": round(1e3 * max(self.latencies, default=0.0), 2),
        }


def closed_loop(
    requests: int,
    concurrency: int,
    *,
    start: Callable[[range], Sequence[Hashable]],
    step: Callable[[], Iterable[Hashable]],
    deadline: float,
    settle: float = 0.0,
    idle: Callable[[], bool] | None = None,
    give_up: float | None = None,
    stall: float | None = None,
    tick: Callable[[int], object] | None = None,
    per_step: int = STARTS_PER_STEP,
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], object] = time.sleep,
) -> Loop:
    """Run ``requests`` requests, ``concurrency`` open at a time (see the module docstring).

    ``deadline``: seconds a request may take; ``give_up``: seconds after which the loop stops whatever is left
    (default: room for every wave to take its deadline and settle twice over); ``stall``: seconds after which
    the loop stops once no request has ended for that long (a bound on a hang, not on the run's length, so any
    number of requests runs: with it, ``give_up`` has no default); ``tick`` is called with the number of
    requests ended so far before each step (to kill a peer mid-run).
    """
    if requests < 1 or concurrency < 1:
        raise ValueError(f"requests and concurrency must be positive, not {requests} and {concurrency}")
    loop = Loop(requests, concurrency)
    began: dict[Hashable, float] = {}
    t0 = clock()
    if give_up is None:
        give_up = float("inf") if stall is not None else (requests / concurrency + 2) * (deadline + settle) + settle
    limit = t0 + give_up
    last_step = last_end = last_look = t0
    while clock() < limit:
        if tick is not None:
            tick(loop.ended)
        room = min(concurrency - len(began), per_step, requests - loop.opened)
        if room > 0:
            keys = start(range(loop.opened, loop.opened + room))
            now = clock()  # once they are open: a deadline the system armed on opening is not earlier
            for key in keys:
                began[key] = now
            loop.opened += room
        step_began = clock()
        ended = list(step())
        now = clock()
        for key in ended:
            opened_at = began.pop(key)
            loop.latencies.append(now - opened_at)
            loop.late += last_step > opened_at + deadline
            loop.ended += 1
            last_end = now
        last_step = step_began
        if loop.opened == requests and not began:
            if idle is None or now - last_end > settle:
                break
            if now - last_look > 0.05:
                last_look = now
                if idle():
                    break
        if stall is not None and now - last_end > stall:
            break
        if not ended and room <= 0:
            wait(0.0005)
    loop.wall = clock() - t0
    loop.still_open = list(began)
    return loop
