"""The Tracker under events fired concurrently from worker threads, a poller and an aborter.

Whatever the interleaving, every request must end in a final state, the
driver's real holdings must return to zero, and the tracker's census, ledger and
counters must agree with what the threads did.
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections.abc import Hashable
from typing import Any

import kvfsm
from kvfsm import IllegalTransition, Tracker
from kvfsm.testing import VirtualClock

SPEC = kvfsm.parse(
    """
kvfsm: 1
machine: threaded_send
key: request_id
params:
  transfer_timeout: 0.5
  retry_timeout: 0.2
resources:
  gpu_blocks: {acquire: alloc_gpu_blocks, release: free_gpu_blocks}
  queue_slot: {acquire: take_slot, release: give_slot}
states:
  pinned:       {initial: true, holds: [gpu_blocks], waits: local}
  queued:       {holds: [gpu_blocks, queue_slot], waits: local}
  transferring: {holds: [gpu_blocks, queue_slot], timeout: {after: transfer_timeout, fire: expire}}
  retrying:     {holds: [gpu_blocks], timeout: {after: retry_timeout, fire: give_up}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: enqueue,  from: pinned,       to: queued}
  - {event: start,    from: queued,       to: transferring, do: start_transfer}
  - {event: complete, from: transferring, to: done}
  - {event: expire,   from: transferring, to: retrying}
  - {event: give_up,  from: retrying,     to: expired}
  - {event: fail,     from: [pinned, queued, transferring, retrying], to: failed}
  - {event: abort,    from: "*",          to: aborted}
ignore:
  - {event: [abort, complete, fail, expire, give_up], in: [done, failed, aborted, expired]}
on_error: fail
""",
    "threaded_send.yaml",
)

THREADS = 4
REQUESTS = 2_000
BATCH = 50
FINALS = {"done", "failed", "aborted", "expired"}


class CountingPool:
    """GPU blocks with ref counts and a bounded queue; raises on any double acquire or release."""

    def __init__(self, blocks: int, queue_cap: int) -> None:
        self.lock = threading.Lock()
        self.ref_cnt = [0] * blocks
        self.free = list(range(blocks))
        self.owned: dict[Hashable, list[int]] = {}
        self.queue: set[Hashable] = set()
        self.queue_cap = queue_cap
        self.errors: list[str] = []

    def _bad(self, message: str) -> None:
        self.errors.append(message)
        raise AssertionError(message)

    def alloc_gpu_blocks(self, key: Hashable, **_p: Any) -> None:
        with self.lock:
            if key in self.owned:
                self._bad(f"{key!r} allocated twice")
            blocks = [self.free.pop() for _ in range(2)]
            for b in blocks:
                self.ref_cnt[b] += 1
            self.owned[key] = blocks

    def free_gpu_blocks(self, key: Hashable, **_p: Any) -> None:
        with self.lock:
            blocks = self.owned.pop(key, None)
            if blocks is None:
                self._bad(f"{key!r} freed blocks it does not own")
                return
            for b in blocks:
                self.ref_cnt[b] -= 1
                if self.ref_cnt[b] == 0:
                    self.free.append(b)

    def take_slot(self, key: Hashable, **_p: Any) -> None:
        with self.lock:
            if key in self.queue:
                self._bad(f"{key!r} queued twice")
            if len(self.queue) >= self.queue_cap:
                raise OverflowError("queue full")
            self.queue.add(key)

    def give_slot(self, key: Hashable, **_p: Any) -> None:
        with self.lock:
            if key not in self.queue:
                self._bad(f"{key!r} gave back a slot it does not hold")
                return
            self.queue.remove(key)

    def start_transfer(self, key: Hashable, **_p: Any) -> None:
        pass

    def blocks_in_use(self) -> int:
        return sum(1 for c in self.ref_cnt if c)


def test_events_from_worker_threads_leave_every_request_final_and_nothing_held() -> None:
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # switch threads often, so that events really interleave
    try:
        run_threads()
    finally:
        sys.setswitchinterval(interval)


def run_threads() -> None:
    pool = CountingPool(blocks=4 * THREADS * BATCH * 2 + 64, queue_cap=THREADS * BATCH * 2)
    clock = VirtualClock()
    entered_final: list[Hashable] = []
    tracker = Tracker(
        SPEC,
        pool,
        clock=clock,
        spaces=("transfer_id",),
        observer=lambda key, _g, _e, _s, target, _w: entered_final.append(key) if target in FINALS else None,
    )
    unexpected: list[BaseException] = []
    stop = threading.Event()
    unknown_aborts = [0]

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for base in range(0, REQUESTS, BATCH):
                keys = [(tid, i) for i in range(base, base + BATCH)]
                for key in keys:
                    tracker.begin(key)
                    tracker.link(key, "transfer_id", ("t", key))
                for event in ("enqueue", "start"):
                    for key in keys:
                        with contextlib.suppress(IllegalTransition):  # aborted or expired meanwhile
                            tracker.fire(key, event)
                for key in keys:
                    event = "fail" if rng.random() < 0.1 else "complete"
                    with contextlib.suppress(IllegalTransition):  # retrying after a timeout: the poller ends it
                        tracker.fire_by("transfer_id", ("t", key), event)
        except BaseException as exc:  # any other error is a failure of the test
            unexpected.append(exc)

    def aborter() -> None:
        rng = random.Random(99)
        try:
            while not stop.is_set():
                key = (rng.randrange(THREADS), rng.randrange(REQUESTS))
                if tracker.fire(key, "abort") is None:
                    unknown_aborts[0] += 1
        except BaseException as exc:
            unexpected.append(exc)

    def poller() -> None:
        try:
            while not stop.is_set():
                clock.now += 0.05
                tracker.poll()
        except BaseException as exc:
            unexpected.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    helpers = [threading.Thread(target=aborter), threading.Thread(target=poller)]
    for th in workers + helpers:
        th.start()
    for th in workers:
        th.join(timeout=60)
    stop.set()
    for th in helpers:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in workers + helpers)
    assert unexpected == []
    assert pool.errors == []

    # Whatever a timeout left in retrying finishes at the next polls.
    for _ in range(3):
        clock.now += 10.0
        tracker.poll()

    census = tracker.census()
    assert {s: n for s, n in census.items() if s not in FINALS and n} == {}
    assert sum(census.values()) == THREADS * REQUESTS
    assert tracker.live() == 0
    assert set(tracker.holding().values()) == {0}
    assert (pool.blocks_in_use(), len(pool.owned), len(pool.queue)) == (0, 0, 0)

    finished = tracker.finished()
    assert len(finished) == THREADS * REQUESTS
    assert {k for k, _ in finished} == {(t, i) for t in range(THREADS) for i in range(REQUESTS)}
    assert {s for _, s in finished} <= FINALS

    assert tracker.counts["unknown"] == unknown_aborts[0]
    assert sorted(entered_final) == sorted(k for k, _ in finished), "each request enters a final state once"
