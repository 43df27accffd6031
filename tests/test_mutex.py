"""The Tracker's lock: mutual exclusion, re-entry by its owner, and no lost wakeup.

The wakeup tests raise ``RECHECK`` to a minute, so a waiter that missed its
notify would sleep past the join timeout and fail the test instead of being
rescued by the bounded wait.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator

import pytest

import kvfsm
from kvfsm.engine import mutex as mutex_module
from kvfsm.engine.mutex import Mutex

JOIN = 30.0

SPEC = kvfsm.parse(
    """
kvfsm: 1
machine: callback
key: id
states:
  a: {initial: true, waits: local}
  b: {waits: local}
  c: {final: success}
  failed: {final: failure}
transitions:
  - {event: go, from: a, to: b, do: work}
  - {event: end, from: b, to: c}
  - {event: fail, from: [a, b], to: failed}
  - {event: abort, from: [a, b], to: failed}
ignore:
  - {event: [fail, abort], in: [c, failed]}
on_error: fail
""",
    "callback.yaml",
)


class Idle:
    def work(self, key: str) -> None:
        pass


@pytest.fixture(autouse=True)
def no_rescue(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mutex_module, "RECHECK", 60.0)


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond, so that races show up in a short run."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def run_threads(count: int, target: object) -> None:
    threads = [threading.Thread(target=target) for _ in range(count)]  # type: ignore[arg-type]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN)
    assert not any(thread.is_alive() for thread in threads), "a thread is still blocked: a wakeup was lost"


def test_excludes_other_threads(fast_switching: None) -> None:
    mutex = Mutex()
    inside = [0]
    overlaps = [0]
    total = [0]

    def work() -> None:
        for _ in range(3_000):
            with mutex:
                inside[0] += 1
                if inside[0] != 1:
                    overlaps[0] += 1
                value = total[0]
                time.sleep(0) if value % 7 == 0 else None  # hand the GIL over while holding the lock
                total[0] = value + 1
                inside[0] -= 1

    run_threads(4, work)
    assert overlaps[0] == 0
    assert total[0] == 4 * 3_000
    assert not mutex.locked()
    assert mutex.waiters == 0


def test_a_blocked_waiter_is_woken_by_the_release() -> None:
    mutex = Mutex()
    got = threading.Event()

    def waiter() -> None:
        with mutex:
            got.set()

    with mutex:
        thread = threading.Thread(target=waiter)
        thread.start()
        deadline = time.monotonic() + JOIN
        while mutex.waiters == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert mutex.waiters == 1
        assert not got.is_set()
    assert got.wait(JOIN), "the waiter was not woken by the release"
    thread.join(JOIN)
    assert mutex.waiters == 0
    assert not mutex.locked()


def test_the_owner_reenters_without_waiting_and_only_the_outer_exit_releases() -> None:
    mutex = Mutex()
    with mutex:
        with mutex:
            with mutex:
                assert mutex.locked()
            assert mutex.locked()
        assert mutex.locked()
        assert mutex.owner == threading.get_ident()
    assert not mutex.locked()
    assert mutex.owner == 0


def test_an_exception_inside_releases() -> None:
    mutex = Mutex()
    with pytest.raises(ValueError), mutex:
        raise ValueError("boom")
    assert not mutex.locked()
    done = threading.Event()

    def other() -> None:
        with mutex:
            done.set()

    thread = threading.Thread(target=other)
    thread.start()
    assert done.wait(JOIN)
    thread.join(JOIN)


def test_another_thread_waits_while_an_action_calls_back() -> None:
    """A Tracker action that calls back is re-entry (queued, no wait); another thread's call waits for the step."""
    seen: list[str | None] = []
    entered = threading.Event()
    proceed = threading.Event()

    class Driver:
        tracker: kvfsm.Tracker

        def work(self, key: str) -> None:
            if key == "x":
                entered.set()
                assert proceed.wait(JOIN)
                seen.append(self.tracker.fire("x", "end"))  # re-entry: queued until this step is over
                seen.append(self.tracker.state("y"))  # a query answers at once

    driver = Driver()
    tracker = kvfsm.Tracker(SPEC, driver)
    driver.tracker = tracker
    tracker.begin("x")
    tracker.begin("y")
    results: dict[str, str | None] = {}

    def first() -> None:
        results["x"] = tracker.fire("x", "go")

    def second() -> None:
        results["y"] = tracker.fire("y", "go")

    one = threading.Thread(target=first)
    one.start()
    assert entered.wait(JOIN)
    two = threading.Thread(target=second)
    two.start()
    deadline = time.monotonic() + JOIN
    while tracker._mutex is not None and tracker._mutex.waiters == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert "y" not in results, "another thread ran a step while an action of this one was running"
    proceed.set()
    one.join(JOIN)
    two.join(JOIN)
    assert not one.is_alive() and not two.is_alive()
    assert seen == [None, "a"]
    assert results == {"x": "c", "y": "b"}


def test_callbacks_outside_a_step_may_call_back_without_deadlock() -> None:
    """on_anomaly and log handlers run under the lock but outside any step: their calls re-enter, they do not wait."""
    answers: list[str | None] = []
    tracker: kvfsm.Tracker

    def on_anomaly(anomaly: kvfsm.Anomaly) -> None:
        answers.append(tracker.state("x"))

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            answers.append(str(tracker.live()))

    tracker = kvfsm.Tracker(SPEC, Idle(), on_anomaly=on_anomaly)
    tracker.begin("x")
    handler = Handler()
    logging.getLogger("kvfsm.anomalies").addHandler(handler)
    try:
        thread = threading.Thread(target=lambda: tracker.fire("nobody", "go"))
        thread.start()
        thread.join(JOIN)
        assert not thread.is_alive(), "a callback's call waited for the lock its own thread holds"
    finally:
        logging.getLogger("kvfsm.anomalies").removeHandler(handler)
    assert answers == ["1", "a"]
    assert tracker.counts["unknown"] == 1
    assert tracker._mutex is not None and not tracker._mutex.locked()
