"""A closed-loop load of 1P1D requests through the MoRIIO drivers (:func:`kvfsm.harness.load.closed_loop`), and what
it left behind.

:func:`run_load` keeps ``concurrency`` requests open on the decode side (as
``vllm bench serve --max-concurrency`` does), sends each request to the
prefill engine (a ``prefill`` command on the decode transport, so it arrives
before the request's ``remote_blocks``), and steps both engines until every
request has finished or the run's own limit has passed. The prefill engine
is stepped here when it is in this process, or steps itself in its own
(:mod:`kvfsm.harness.moriio.peer`). The result counts what a hang leaves
behind: requests still live on either side or never admitted, and blocks
still held.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ...drivers.block_pool import NoFreeBlocks
from ...drivers.moriio.consumer import DecodeEngine, Source
from ...drivers.moriio.messages import Prefill, StatsQuery
from ..load import Loop, closed_loop


@dataclass
class LoadResult:
    """What a run did: requests, outcomes on both sides, faults, leaks, hangs, latencies and kvfsm's cost."""

    requests: int
    concurrency: int
    started: int
    """Requests the decode side began (the rest never left the prefill's queue)."""
    decode: dict[str, Any]
    prefill: dict[str, Any]
    faults: dict[str, int]
    loop: Loop

    @property
    def finished(self) -> int:
        return self.loop.ended

    @property
    def late(self) -> int:
        return self.loop.late

    @property
    def latencies(self) -> list[float]:
        return self.loop.latencies

    @property
    def wall(self) -> float:
        return self.loop.wall

    def percentile(self, q: float) -> float:
        return self.loop.percentile(q)

    @property
    def leaked_blocks(self) -> int:
        return int(self.decode["held_blocks"]) + int(self.prefill["held_blocks"])

    @property
    def hung(self) -> int:
        """Requests not finished on both sides: live anywhere, queued at the prefill, or never started."""
        live = int(self.decode["live"]) + int(self.prefill["live"])
        return live + int(self.prefill["queued"]) + (self.requests - self.started)

    @property
    def kvfsm_us_per_request(self) -> float:
        """Microseconds spent in the two trackers per request: what kvfsm adds over the transport."""
        seconds = float(self.decode["tracker_seconds"]) + float(self.prefill["tracker_seconds"])
        return 1e6 * seconds / max(1, self.started)

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "concurrency": self.concurrency, "finished": self.finished,
            "faults": self.faults, "leaked_blocks": self.leaked_blocks, "hung": self.hung, "late": self.late,
            **self.loop.ms(), "kvfsm_us_per_request": round(self.kvfsm_us_per_request, 1),
            "wall_s": round(self.wall, 2), "decode_outcomes": self.decode["outcomes"],
            "prefill_outcomes": self.prefill["outcomes"], "verified_blocks": self.decode["verified_blocks"],
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
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[float], object] = time.sleep,
) -> LoadResult:
    """Run ``requests`` requests at ``concurrency`` through ``decode`` and the prefill engine named ``prefill``.

    ``deadline``: seconds a request may take on the decode side (its spec's
    timeouts); ``settle``: how long after the last decode finish the prefill
    side may take to finish too (its own deadlines). ``step_prefill`` steps
    an in-process prefill engine; ``prefill_stats`` reads its counters
    (default: ask it with a ``stats_query``). ``tick`` is called with the
    number of requests ended so far on every loop (to kill a peer mid-run);
    ``clock`` and ``wait``: the loop's time (:func:`~kvfsm.harness.load.closed_loop`).
    """
    if blocks_per_request < 1:
        raise ValueError(f"blocks_per_request must be positive, not {blocks_per_request}")
    pending: dict[str, str] = {}  # transfer id → request id: sent to prefill, not begun here yet
    sources: dict[str, Source] = {}  # READ mode: where prefill computed them (its `computed` answers)
    decode.on_computed = sources.__setitem__
    stats = prefill_stats if prefill_stats is not None else lambda: ask_stats(decode, prefill)

    def open_requests(indices: range) -> list[Hashable]:
        keys: list[Hashable] = []
        for i in indices:
            rid = f"{prefix}{i}"
            tid = f"{rid}-xfer"
            decode.transport.notify(prefill, Prefill(f"p-{rid}", tid, blocks_per_request, decode.transport.name))
            pending[tid] = rid
            keys.append(rid)
        return keys

    def step() -> list[Hashable]:
        if step_prefill is not None:
            step_prefill()
        ended: list[Hashable] = [str(key) for key in decode.step().recving]
        for tid, rid in list(pending.items()):
            if decode.mode == "read" and tid not in sources:
                continue
            try:
                decode.start(rid, tid, blocks_per_request, sources.pop(tid, None))
            except NoFreeBlocks:
                break
            del pending[tid]
        return ended

    loop = closed_loop(
        requests, concurrency, start=open_requests, step=step, deadline=deadline, settle=settle,
        idle=lambda: _idle(stats()), tick=tick, clock=clock, wait=wait,
    )  # fmt: skip
    return LoadResult(requests, concurrency, loop.opened - len(pending), decode.stats(), stats(), faults(), loop)


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
