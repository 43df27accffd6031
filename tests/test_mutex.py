"""The Tracker's lock: mutual exclusion, re-entry by its owner, handover to waiters, and no lost wakeup.

Every test raises ``RECHECK`` to a minute, so a waiter that missed its
handover would sleep past the join timeout and fail the test instead of being
rescued by the bounded wait. Threads are daemons: one left blocked fails its
test instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

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


def start(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def join(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(JOIN)
    assert not any(thread.is_alive() for thread in threads), "a thread is still blocked: a handover was lost"


def join_while_moving(threads: list[threading.Thread], progress: Callable[[], int]) -> None:
    """Join ``threads`` for as long as ``progress()`` keeps rising: on a loaded machine a long run is slow, not
    stuck; only :data:`JOIN` seconds without a step is a lost handover."""
    seen, since = progress(), time.monotonic()
    while any(thread.is_alive() for thread in threads):
        for thread in threads:
            thread.join(0.5)
        now = progress()
        if now != seen:
            seen, since = now, time.monotonic()
        assert time.monotonic() - since < JOIN, f"no thread took a step in {JOIN:g} s: a handover was lost"


def run_threads(count: int, target: Callable[[], object]) -> None:
    join(*[start(target) for _ in range(count)])


def wait_for_waiters(mutex: Mutex, count: int) -> None:
    deadline = time.monotonic() + JOIN
    while mutex.waiters < count and time.monotonic() < deadline:
        time.sleep(0.001)
    assert mutex.waiters == count


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
        thread = start(waiter)
        wait_for_waiters(mutex, 1)
        assert not got.is_set()
    assert got.wait(JOIN), "the waiter was not handed the lock by the release"
    join(thread)
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


def test_enter_and_exit_are_with_and_a_reentry_is_counted_not_given_back() -> None:
    """What ``Tracker.begin`` calls and ``Tracker.fire`` inlines: only the outermost exit gives the lock back."""
    mutex = Mutex()
    mutex.enter()
    assert mutex.owner == threading.get_ident()
    mutex.enter()  # held by this thread already
    mutex.exit()
    assert mutex.locked()
    mutex.exit()
    assert not mutex.locked() and mutex.owner == 0
    got = threading.Event()

    def waiter() -> None:
        mutex.enter()
        got.set()
        mutex.exit()

    mutex.enter()
    thread = start(waiter)
    wait_for_waiters(mutex, 1)
    mutex.exit()
    assert got.wait(JOIN), "the waiter was not handed the lock by exit()"
    join(thread)
    assert not mutex.locked() and mutex.waiters == 0


def test_an_exception_inside_releases() -> None:
    mutex = Mutex()
    with pytest.raises(ValueError), mutex:
        raise ValueError("boom")
    assert not mutex.locked()
    done = threading.Event()

    def other() -> None:
        with mutex:
            done.set()

    thread = start(other)
    assert done.wait(JOIN)
    join(thread)


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
                self.tracker.begin("z")  # begin's own inlined copy of the lock: re-entry, queued too
                seen.append(self.tracker.state("z"))

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

    def third() -> None:
        tracker.begin("w")
        results["w"] = tracker.state("w")

    one = start(first)
    assert entered.wait(JOIN)
    two = start(second)
    assert tracker._mutex is not None
    wait_for_waiters(tracker._mutex, 1)
    three = start(third)
    wait_for_waiters(tracker._mutex, 2)
    assert "y" not in results and "w" not in results, "another thread ran while an action of this one was running"
    proceed.set()
    join(one, two, three)
    assert seen == [None, "a", None]
    assert results == {"x": "c", "y": "b", "w": "a"}
    assert tracker.state("z") == "a"
    assert not tracker._mutex.locked() and tracker._mutex.waiters == 0


def _inlined_lock(method: str) -> tuple[str, str]:
    """The AST of the lock's fast path as ``Tracker.<method>`` inlines it: the take before its ``try``, the give
    back in its ``finally``."""
    import ast
    import inspect
    import textwrap

    from kvfsm.engine.tracker import Tracker

    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(Tracker, method))))
    body = tree.body[0].body  # type: ignore[attr-defined]
    take = next(s for s in body if isinstance(s, ast.If) and "mutex" in ast.unparse(s.test))
    outer = next(s for s in body if isinstance(s, ast.Try))
    give = next(s for s in outer.finalbody if isinstance(s, ast.If) and "mutex" in ast.unparse(s.test))
    return ast.dump(take), ast.dump(give)


def test_fire_and_begin_inline_one_form_of_the_lock() -> None:
    """The two calls made per request take and give back the lock inline (a method call costs 3% of the bench's
    locked lifecycle): the two copies must not drift apart. Their behaviour is held to ``enter`` and ``exit``
    by the threaded tests in this file."""
    assert _inlined_lock("fire") == _inlined_lock("begin")


def test_callbacks_outside_a_step_may_call_back_without_deadlock() -> None:
    """on_anomaly and log handlers run under the lock but outside any step: their calls re-enter, they do not wait."""
    answers: list[str | None] = []
    tracker: kvfsm.Tracker

    def on_anomaly(anomaly: kvfsm.Anomaly) -> None:
        answers.append(str(tracker.census()["a"]))

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            answers.append(str(tracker.live()))

    tracker = kvfsm.Tracker(SPEC, Idle(), on_anomaly=on_anomaly)
    tracker.begin("x")
    handler = Handler()
    logging.getLogger("kvfsm.anomalies").addHandler(handler)
    try:
        join(start(lambda: tracker.fire("nobody", "go")))
    finally:
        logging.getLogger("kvfsm.anomalies").removeHandler(handler)
    assert answers == ["1", "1"]
    assert tracker.counts["unknown"] == 1
    assert tracker._mutex is not None and not tracker._mutex.locked()


def test_a_release_hands_the_lock_to_the_waiter_before_the_releasing_thread_can_take_it_again() -> None:
    """As with RLock: a thread that releases and at once asks again queues behind the thread already waiting."""
    mutex = Mutex()
    order: list[str] = []

    def waiter() -> None:
        with mutex:
            order.append("waiter")

    with mutex:
        thread = start(waiter)
        wait_for_waiters(mutex, 1)
    with mutex:  # asked again at once, with the GIL still held: the token was handed over already
        order.append("releaser")
    join(thread)
    assert order == ["waiter", "releaser"]


def test_a_waiter_interrupted_by_an_exception_leaves_nothing_behind() -> None:
    """A KeyboardInterrupt (here: any exception from a signal handler) while waiting: no ticket, no token lost."""
    mutex = Mutex()
    release = threading.Event()

    def holder() -> None:
        with mutex:
            assert release.wait(JOIN)

    thread = start(holder)
    wait_for_locked(mutex)

    def interrupt(signum: int, frame: object) -> None:
        raise TimeoutError("interrupted while waiting")

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(TimeoutError), mutex:
            pytest.fail("the lock was taken while another thread held it")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert mutex.waiters == 0
    release.set()
    join(thread)
    assert not mutex.locked(), "the token was lost with the interrupted waiter"
    with mutex:
        pass


def wait_for_locked(mutex: Mutex) -> None:
    deadline = time.monotonic() + JOIN
    while not mutex.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert mutex.locked()


def test_collector_finalizers_that_call_the_tracker_never_deadlock(fast_switching: None) -> None:
    """A finalizer runs on whichever thread allocates when the collector triggers, inside any tracker call:
    one that calls back must re-enter (holder) or wait its turn (waiter), never wait for itself."""
    tracker = kvfsm.Tracker(SPEC, Idle())
    threshold = gc.get_threshold()

    class Request:  # aborts its instance when collected: a reference cycle, freed only by the collector
        def __init__(self, key: object) -> None:
            self.me = self
            weakref.finalize(self, tracker.fire, key, "abort")

    errors: list[BaseException] = []
    steps = [0]

    def worker(name: str) -> Callable[[], None]:
        def run() -> None:
            try:
                for i in range(1_500):
                    steps[0] += 1
                    key = (name, i)
                    tracker.begin(key)
                    Request(key)
                    with contextlib.suppress(kvfsm.IllegalTransition):  # aborted by a finalizer already
                        tracker.fire(key, "go")
                    tracker.census()  # a 'with' method
                    if i % 100 == 0:
                        tracker.finished()
            except BaseException as exc:
                errors.append(exc)

        return run

    gc.set_threshold(20)
    try:
        join_while_moving([start(worker(name)) for name in "abc"], lambda: steps[0])
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert errors == []
    assert tracker.counts["ignored"] + tracker.census()["failed"] > 0, "no finalizer ran"
    assert tracker._mutex is not None and not tracker._mutex.locked()
    assert tracker._mutex.waiters == 0
