"""A closed-loop load of 1P1D requests through the MoRIIO drivers, and what it left behind.

:func:`run_load` keeps ``concurrency`` requests open on the decode side (as
``vllm bench serve --max-concurrency`` does), sends each request to the
prefill engine (a ``prefill`` command on the decode transport, so it arrives
before the request's ``remote_blocks``), and steps both engines until every
request has finished or the run's own deadline has passed. The prefill engine
is stepped here when it is in this process, or steps itself in its own
(:mod:`kvfsm.harness.moriio.peer`). The result counts what a hang leaves behind: requests still
live on either side or never admitted, and blocks still held.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...drivers.block_pool import NoFreeBlocks
from ...drivers.moriio.consumer import DecodeEngine, Source
from ...drivers.moriio.messages import Prefill, StatsQuery

STARTS_PER_STEP = 64
"""Requests started per loop at most: a wave of 512 starts would delay the next poll, and with it every deadline."""


@dataclass
class LoadResult:
    """What a run did: requests, outcomes on both sides, faults, leaks, hangs, latencies and kvfsm's cost."""

    requests: int
    concurrency: int
    started: int
    finished: int
    decode: dict[str, Any]
    prefill: dict[str, Any]
    faults: dict[str, int]
    latencies: list[float] = field(repr=False)
    deadline: float
    wall: float

    @property
    def leaked_blocks(self) -> int:
        return int(self.decode["held_blocks"]) + int(self.prefill["held_blocks"])

    @property
    def hung(self) -> int:
        """Requests not finished on both sides: live anywhere, queued at the prefill, or never started."""
        live = int(self.decode["live"]) + int(self.prefill["live"])
        return live + int(self.prefill["queued"]) + (self.requests - self.started)

    @property
    def late(self) -> int:
        """Requests the decode side finished after their deadline."""
        return sum(1 for t in self.latencies if t > self.deadline)

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        if len(self.latencies) == 1:
            return self.latencies[0]
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[round(q) - 1]

    @property
    def kvfsm_us_per_request(self) -> float:
        """Microseconds spent in the two trackers per request: what kvfsm adds over the transport."""
        seconds = float(self.decode["tracker_seconds"]) + float(self.prefill["tracker_seconds"])
        return 1e6 * seconds / max(1, self.started)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "concurrency": self.concurrency, "finished": self.finished,
            "faults": self.faults, "leaked_blocks": self.leaked_blocks, "hung": self.hung, "late": self.late,
            "p50_ms": round(1e3 * self.percentile(50), 2), "p99_ms": round(1e3 * self.percentile(99), 2),
            "max_ms": round(1e3 * max(self.latencies, default=0.0), 2),
            "kvfsm_us_per_request": round(self.kvfsm_us_per_request, 1), "wall_s": round(self.wall, 2),
            "decode_outcomes": self.decode["outcomes"], "prefill_outcomes": self.prefill["outcomes"],
            "verified_blocks": self.decode["verified_blocks"],
        }  # fmt: skip


def run_load(
    decode: DecodeEngine,
    prefill: str,
    *,
    requests: int,
    concurrency: int,
    blocks_per_request: int,
    deadline: float,
    settle: float,
    step_prefill: Callable[[], object] | None = None,
    prefill_stats: Callable[[], dict[str, Any]] | None = None,
    faults: Callable[[], dict[str, int]] = dict,
    prefix: str = "r",
    tick: Callable[[int], object] | None = None,
) -> LoadResult:
    """Run ``requests`` requests at ``concurrency`` through ``decode`` and the prefill engine named ``prefill``.

    ``deadline``: seconds a request may take on the decode side (its spec's
    timeouts); ``settle``: how long after the last decode finish the prefill
    side may take to finish too (its own deadlines). ``step_prefill`` steps
    an in-process prefill engine; ``prefill_stats`` reads its counters
    (default: ask it with a ``stats_query``). ``tick`` is called with the
    number of requests ended so far on every loop (to kill a peer mid-run).
    """
    if requests < 1 or concurrency < 1 or blocks_per_request < 1:
        raise ValueError("requests, concurrency and blocks_per_request must be positive")
    begun: dict[str, float] = {}
    pending: dict[str, tuple[str, float]] = {}  # READ mode: sent to prefill, waiting for where its blocks are
    sources: dict[str, Source] = {}  # READ mode: where prefill computed them (its `computed` answers)
    decode.on_computed = sources.__setitem__
    latencies: list[float] = []
    n_started = n_finished = 0
    t0 = time.monotonic()
    hard_stop = t0 + (requests / concurrency + 2) * (deadline + settle) + settle
    last_finish = last_check = t0
    stats = prefill_stats if prefill_stats is not None else lambda: ask_stats(decode, prefill)
    while time.monotonic() < hard_stop:
        busy = False
        if tick is not None:
            tick(n_finished)
        if step_prefill is not None:
            step_prefill()
        for key in decode.step().recving:
            latencies.append(time.monotonic() - begun.pop(str(key)))
            n_finished += 1
            last_finish = time.monotonic()
            busy = True
        room = min(concurrency - len(begun) - len(pending), STARTS_PER_STEP)
        for _ in range(max(0, min(room, requests - n_started))):
            rid = f"{prefix}{n_started}"
            tid = f"{rid}-xfer"
            decode.transport.notify(prefill, Prefill(f"p-{rid}", tid, blocks_per_request, decode.transport.name))
            pending[tid] = (rid, time.monotonic())
            n_started += 1
            busy = True
        for tid, (rid, t) in list(pending.items()):
            if decode.mode == "read" and tid not in sources:
                continue
            try:
                decode.start(rid, tid, blocks_per_request, sources.pop(tid, None))
            except NoFreeBlocks:
                break
            begun[rid] = t
            del pending[tid]
        if n_started == requests and not begun and not pending:
            now = time.monotonic()
            if now - last_finish > settle:
                break
            if now - last_check > 0.05:
                last_check = now
                if _idle(stats()):
                    break
        if not busy:
            time.sleep(0.0005)
    wall = time.monotonic() - t0
    pstats = stats()
    return LoadResult(
        requests, concurrency, n_started - len(pending), n_finished, decode.stats(), pstats, faults(), latencies,
        deadline, wall,
    )  # fmt: skip


def _idle(stats: dict[str, Any]) -> bool:
    return bool(stats["live"] == 0 and stats["queued"] == 0)


def ask_stats(decode: DecodeEngine, prefill: str, timeout: float = 10.0) -> dict[str, Any]:
    """A prefill engine's counters over the control plane (a ``stats_query``, answered by ``stats``)."""
    decode.replies.clear()
    decode.transport.notify(prefill, StatsQuery(decode.transport.name))
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        decode.step()
        if decode.replies:
            return dict(decode.replies.pop().values)
        time.sleep(0.002)
    raise TimeoutError(f"the prefill engine {prefill!r} did not answer a stats query within {timeout} s")


def count(*counters: Counter[str]) -> dict[str, int]:
    total: Counter[str] = Counter()
    for c in counters:
        total.update(c)
    return dict(total)
