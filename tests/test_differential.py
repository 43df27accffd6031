"""The compiled Tracker and the transitions-based Reference agree on every operation.

Hypothesis drives both engines, each with its own recording driver, through the
same random operations on several specs: begin (new and reused keys), fire any
event (legal, ignored, illegal, unknown event, unknown key), make the next
driver action raise, advance a virtual clock and poll, drain finished(), close.
After every operation they must agree on the outcome (value, IllegalTransition,
ActionError and its failures), every key's state and held resources, the
timeouts that fired, the anomalies, and the exact driver calls (after close(),
which may visit keys in any order, as multisets and per key). Independently of
the reference, the Tracker's driver must never release what it did not acquire,
and what it still has acquired must be what the spec says the key holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from drivers import ANY, Call, InjectedFault, RecordingDriver, recording_driver
from hypothesis import event, example, given, note, settings
from hypothesis import strategies as st

import kvfsm
from kvfsm import ActionError, DuplicateKey, IllegalTransition, Spec, Tracker, TrackerClosed
from kvfsm.engine.reference import NOT_BEGUN, Reference
from kvfsm.spec import run_checks

ROOT = Path(__file__).resolve().parents[1]

# Acquire actions at begin and on an edge that takes two resources at once; a
# non-final on_error target that is itself left by a raising (acquiring) edge,
# fired by a timeout; the on_error edge a self-loop there; `do` on a self-loop;
# ignore rules in live states as well as final ones; timeouts of four lengths;
# an abort whose action can raise, leaving the instance live (close() forces it).
ACQUIRE_PIPELINE = """
kvfsm: 1
machine: acquire_pipeline
key: request_id
params:
  lease: 2.0
  transfer_timeout: 3.5
resources:
  gpu_blocks: {release: free_gpu_blocks}
  host_buffer: {acquire: alloc_host, release: free_host}
  queue_slot: {acquire: enqueue_job, release: task_done}
  channel: {acquire: open_channel, release: close_channel}
states:
  reserving:    {initial: true, holds: [gpu_blocks, host_buffer], timeout: {after: lease, fire: expire}}
  staged:       {holds: [gpu_blocks, host_buffer], waits: local}
  queued:       {holds: [gpu_blocks, host_buffer, queue_slot, channel], timeout: {after: 1.0, fire: expire}}
  transferring: {holds: [gpu_blocks, queue_slot, channel], timeout: {after: transfer_timeout, fire: expire}}
  retrying:     {holds: [gpu_blocks], timeout: {after: 0.5, fire: retry}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: stage,    from: reserving,    to: staged,       do: copy_to_host}
  - {event: enqueue,  from: staged,       to: queued}
  - {event: start,    from: queued,       to: transferring, do: start_transfer}
  - {event: progress, from: transferring, to: transferring, do: note_progress}
  - {event: complete, from: transferring, to: done,         do: confirm}
  - {event: fault,    from: [reserving, staged, queued, transferring, retrying], to: retrying}
  - {event: retry,    from: retrying,     to: reserving}
  - {event: give_up,  from: retrying,     to: failed}
  - {event: abort,    from: "*",          to: aborted,      do: cancel_job}
  - {event: expire,   from: [reserving, queued, transferring], to: expired}
ignore:
  - {event: [enqueue], in: [queued, transferring]}
  - {event: [progress], in: [queued]}
  - {event: [abort, complete, expire, fault, progress], in: [done, failed, aborted, expired]}
on_error: fault
"""

# Timeouts of equal and different lengths armed together (ties), a timeout
# self-loop with a `do` (re-armed during poll: must wait for the next poll), a
# timeout edge that acquires (can raise inside poll), an abort with a `do`
# (close() must force-release what abort cannot finish), a live state holding
# nothing.
TIMERS = """
kvfsm: 1
machine: timers
key: room
params: {short: 1.0, long: 3.0}
resources:
  slot:  {release: free_slot}
  lease: {acquire: take_lease, release: drop_lease}
states:
  waiting:  {initial: true, holds: [slot], timeout: {after: short, fire: tick}}
  polling:  {holds: [slot, lease], timeout: {after: 1.0, fire: tick}}
  draining: {holds: [lease], timeout: {after: long, fire: expire}}
  idle:     {waits: local}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: tick,    from: waiting,  to: polling}
  - {event: tick,    from: polling,  to: polling,  do: probe}
  - {event: ready,   from: polling,  to: draining, do: hand_off}
  - {event: drained, from: draining, to: done}
  - {event: pause,   from: [waiting, polling], to: idle}
  - {event: resume,  from: idle,     to: waiting}
  - {event: error,   from: [waiting, polling, draining, idle], to: failed}
  - {event: expire,  from: draining, to: expired}
  - {event: abort,   from: "*",      to: aborted, do: cancel}
ignore:
  - {event: [tick], in: [draining, idle]}
  - {event: [ready, pause], in: [draining]}
  - {event: [abort, error, drained, expire, tick, ready, pause, resume], in: [done, failed, aborted, expired]}
on_error: error
"""

# Deliberately fails KVF109: the on_error edge has its own `do`, so the engine's
# "an error while handling an error still ends where on_error leads" path runs.
ERROR_CLEANUP = """
kvfsm: 1
machine: error_cleanup
key: request_id
resources:
  blocks: {release: free_blocks}
  slot:   {acquire: take_slot, release: give_slot}
states:
  held:    {initial: true, holds: [blocks], waits: local}
  sending: {holds: [blocks, slot], timeout: {after: 2.0, fire: expire}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: send,     from: held,    to: sending, do: post}
  - {event: complete, from: sending, to: done,    do: ack}
  - {event: fail,     from: [held, sending], to: failed, do: report_failure}
  - {event: abort,    from: "*",     to: aborted}
  - {event: expire,   from: sending, to: expired, do: report_expiry}
ignore:
  - {event: [abort, fail, complete, expire], in: [done, failed, aborted, expired]}
on_error: fail
"""


@dataclass(frozen=True)
class Case:
    spec: Spec
    params: Mapping[str, float]
    examples: int


CASES = {
    "kv_request": Case(kvfsm.load(ROOT / "specs" / "kv_request.yaml"), {"transfer_timeout": 2.0}, 600),
    "acquire_pipeline": Case(kvfsm.parse(ACQUIRE_PIPELINE, "acquire_pipeline.yaml"), {}, 600),
    "timers": Case(kvfsm.parse(TIMERS, "timers.yaml"), {"long": 2.5}, 500),
    "error_cleanup": Case(kvfsm.parse(ERROR_CLEANUP, "error_cleanup.yaml"), {}, 400),
}
"""2,100 examples in all."""

KEYS = ("r1", "r2", "r3")
GHOST = "ghost"
"""A key never begun: every event for it is an 'unknown' anomaly."""
BOGUS = "no_such_event"
STEPS = 40
DTS = (0.0, 0.25, 0.5, 0.5, 1.0, 2.0, 3.5)
LEADS = (None, 0.0, 0.0, 2.5)
"""How far ahead of the clock poll(now) looks; ahead, deadlines re-armed during the poll are already due."""
PAYLOADS: tuple[dict[str, Any], ...] = ({}, {"n": 1}, {"n": 2})


class Clock:
    """The virtual clock both engines read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    """What a call did, in a form both engines can be compared on."""
    try:
        return ("ok", call())
    except IllegalTransition as exc:
        return ("illegal", exc.key, exc.event, exc.state, frozenset(exc.accepted))
    except ActionError as exc:
        failures = tuple(
            (f.key, f.event, f.action, f.phase, f.state, type(f.error).__name__, getattr(f.error, "action", None))
            for f in exc.failures
        )
        assert all(isinstance(f.error, InjectedFault) for f in exc.failures), exc
        return ("action_error", failures)
    except DuplicateKey:
        return ("duplicate",)
    except TrackerClosed:
        return ("closed",)


class Pair:
    """A Tracker and a Reference on the same spec, clock and fault plan, each with its own driver."""

    def __init__(self, case: Case) -> None:
        self.spec = case.spec
        self.clock = Clock()
        self.tdriver = recording_driver(case.spec)
        self.rdriver = recording_driver(case.spec)
        self.tracker = Tracker(case.spec, self.tdriver, clock=self.clock, params=case.params)
        self.ref = Reference(case.spec, self.rdriver, clock=self.clock, params=case.params)
        self.tracked = set(self.tdriver.resource_of_acquire.values())
        self.closed = False
        """After close() the engines may have visited keys in different orders (DESIGN.md
        does not fix one), so from then on results are compared as multisets, calls per key."""

    def both(self, op: str, call: Callable[[Tracker | Reference], Any]) -> tuple[Any, ...]:
        t = outcome(lambda: call(self.tracker))
        r = outcome(lambda: call(self.ref))
        note(f"{op} -> tracker {t!r}")
        event(f"{op.split('(')[0]}: {t[0]}")
        if self.closed:
            t, r = unordered(t), unordered(r)
        assert t == r, f"{op}: tracker {t!r} != reference {r!r}"
        return t

    def begin(self, key: str, payload: dict[str, Any]) -> None:
        before = self.tracker.generation(key)
        t = self.both(f"begin({key!r}, {payload})", lambda e: e.begin(key, **payload))
        after = self.tracker.generation(key)
        if t[0] == "ok":
            assert after is not None and after != before, "a successful begin starts a new generation"
        else:
            assert after == before, "a refused begin leaves the key's instance as it was"

    def fire(self, key: str, event_name: str, payload: dict[str, Any]) -> None:
        self.both(f"fire({key!r}, {event_name!r}, {payload})", lambda e: e.fire(key, event_name, **payload))

    def fault(self, action: str | None) -> None:
        note(f"fail_next({action!r})")
        self.tdriver.fail_next(action)
        self.rdriver.fail_next(action)

    def tick(self, dt: float, lead: float | None) -> None:
        """Advance the clock by ``dt``, then poll at the clock (``lead`` None) or ``lead`` ahead of it."""
        self.clock.now += dt
        now = None if lead is None else self.clock.now + lead
        self.both(f"poll({now}) at {self.clock.now}", lambda e: e.poll(now))

    def finished(self) -> None:
        self.both("finished()", lambda e: e.finished())

    def close(self, faults: list[tuple[int, str]]) -> None:
        """close(), with faults aimed at (action, key) so that which call fails does not depend on order."""
        self.tdriver.clear_faults()
        self.rdriver.clear_faults()
        actions = self.spec.actions()
        for n, key in faults:
            note(f"fail_next({actions[n % len(actions)]!r}, key={key!r})")
            self.tdriver.fail_next(actions[n % len(actions)], key)
            self.rdriver.fail_next(actions[n % len(actions)], key)
        self.closed = True
        self.both("close()", lambda e: e.close())

    def check(self) -> None:
        """Everything observable agrees, and the Tracker's driver matches the spec's ledger."""
        tracker, ref, tdriver = self.tracker, self.ref, self.tdriver
        for key in (*KEYS, GHOST):
            assert tracker.state(key) == ref.state(key), key
            held = tracker.held(key)
            assert sorted(held) == sorted(ref.held(key)), key
            assert tdriver.outstanding(key) == set(held) & self.tracked, (
                f"{key}: driver still has {tdriver.outstanding(key)} acquired, spec says it holds {held}"
            )
        if self.closed:
            assert by_key(tdriver.calls) == by_key(self.rdriver.calls)
            assert sorted(map(repr, tdriver.pending_faults())) == sorted(map(repr, self.rdriver.pending_faults()))
            assert sorted(map(repr, tracker.anomalies())) == sorted(map(repr, ref.anomalies()))
        else:
            assert tdriver.calls == self.rdriver.calls
            assert tdriver.pending_faults() == self.rdriver.pending_faults()
            assert tracker.anomalies() == ref.anomalies()
        assert not tdriver.over_released(), f"released without an acquire: {tdriver.over_released()}"
        assert tracker.holding() == ref.holding()


def unordered(result: tuple[Any, ...]) -> tuple[Any, ...]:
    """An outcome with its list (poll, finished) or failures in a canonical order."""
    if result[0] in ("ok", "action_error") and isinstance(result[1], (list, tuple)):
        return (result[0], sorted(result[1], key=repr))
    return result


def by_key(calls: list[Call]) -> dict[Hashable, list[Call]]:
    """Each key's calls in order: what must agree when keys may be visited in any order."""
    out: dict[Hashable, list[Call]] = {}
    for call in calls:
        out.setdefault(call.key, []).append(call)
    return out


def forward_events(spec: Spec, state: str | None) -> list[str]:
    """Events that move ``state`` along its lifecycle: not abort, on_error or its own timeout."""
    if state is None:
        return []
    timeout = spec.states[state].timeout
    skip = {"abort", spec.on_error, timeout.fire if timeout else None}
    return sorted({e.event for e in spec.edges() if e.source == state and e.event not in skip})


def legal_events(spec: Spec, state: str | None) -> list[str]:
    """Events handled or ignored in ``state`` (for biasing the generator, not for judging)."""
    if state is None:
        return []
    out = {e.event for e in spec.edges() if e.source == state}
    out.update(ev for st_, ev, _rule in spec.ignored() if st_ == state)
    return sorted(out)


Op = tuple[str, int, int, int]
"""(kind, a, b, c): the small numbers pick keys, events, actions and times once the
pair's current states are known, so every operation is drawn from one fixed strategy
(cheap to generate). ``finished`` comes first so that shrinking pads with drains."""

OP = st.tuples(
    st.sampled_from(("finished", "fire", "fire", "fire", "fire", "fire", "begin", "begin", "fault", "tick", "tick")),
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(0, len(PAYLOADS) - 1),
)


def nearby_actions(spec: Spec, states: list[str | None]) -> list[str]:
    """Actions the next event on one of ``states`` may call, including undoing its acquires.

    Faults aimed at these land on the next steps instead of waiting for a call
    that may never come, so double faults (an acquire, then its undo) happen.
    """
    out: set[str] = set()
    for e in spec.edges():
        if e.source not in states:
            continue
        out.update(spec.raising_actions(e))
        moved = (*spec.acquires(e.source, e.target), *spec.releases(e.source, e.target))
        out.update(spec.resources[r].release for r in moved)
    return sorted(out)


def pick_key(pair: Pair, n: int, live: bool) -> str:
    """Three times in four a key that is live (``live``) or free to begin (not ``live``); else any key."""
    finals = pair.spec.finals
    fits = [k for k in KEYS if (pair.tracker.state(k) not in (None, *finals)) == live]
    if fits and n % 4:
        return fits[n // 4 % len(fits)]
    anyone = (*KEYS, GHOST) if live else KEYS
    return anyone[n // 4 % len(anyone)]


def pick_event(spec: Spec, state: str | None, n: int) -> str:
    """Half the time an event that moves the lifecycle on, a quarter any legal one, a quarter any at all."""
    forward, legal = forward_events(spec, state), legal_events(spec, state)
    if forward and n % 4 >= 2:
        pool = forward
    elif legal and n % 4 == 1:
        pool = legal
    else:
        pool = sorted({*spec.events, *(ev for _s, ev, _r in spec.ignored()), BOGUS})
    return pool[n // 4 % len(pool)]


def step(pair: Pair, op: Op) -> None:
    kind, a, b, c = op
    spec = pair.spec
    if kind == "fire":
        key = pick_key(pair, a, live=True)
        pair.fire(key, pick_event(spec, pair.tracker.state(key), b), PAYLOADS[c])
    elif kind == "begin":
        pair.begin(pick_key(pair, a, live=False), PAYLOADS[c])
    elif kind == "fault":
        near = nearby_actions(spec, [pair.tracker.state(k) for k in KEYS])
        actions = near if near and a % 4 else [ANY, *spec.actions()]
        pair.fault(actions[a // 4 % len(actions)])
    elif kind == "tick":
        pair.tick(DTS[a % len(DTS)], LEADS[b % len(LEADS)])
    else:
        pair.finished()
    pair.check()


CloseFaults = list[tuple[int, str]] | None
"""None: do not close; else close() with faults on (action number, key)."""

CLOSE = st.none() | st.lists(st.tuples(st.integers(0, 255), st.sampled_from(KEYS)), max_size=2)


def run(case: Case, ops: list[Op], close: CloseFaults, after: list[Op]) -> None:
    """The operations, then unless ``close`` is None: close() and a few operations on the closed pair."""
    pair = Pair(case)
    for op in ops:
        step(pair, op)
    if close is not None:
        pair.close(close)
        pair.check()
        for op in after:
            step(pair, op)


def fault_op(spec: Spec, action: str) -> Op:
    """The operation that arms a fault on ``action`` (``a % 4 == 0`` picks from every action)."""
    return ("fault", 4 * [ANY, *spec.actions()].index(action), 0, 0)


BEGIN_R1: Op = ("begin", 0, 0, 0)
"""begin('r1') while no key is live."""
FORWARD_R1: Op = ("fire", 1, 2, 0)
"""fire the first forward event on 'r1' while it is the only live key."""

REGRESSIONS: dict[str, list[list[Op]]] = {
    "acquire_pipeline": [
        # enqueue from staged: enqueue_job succeeds, open_channel raises, undoing enqueue_job's
        # slot with task_done raises too -> the failure must name task_done (see the repro tests below)
        [
            fault_op(CASES["acquire_pipeline"].spec, "open_channel"),
            fault_op(CASES["acquire_pipeline"].spec, "task_done"),
            BEGIN_R1,
            FORWARD_R1,  # stage -> staged
            FORWARD_R1,  # enqueue
        ],
    ],
}
"""Operation lists that once made the engines disagree; each runs before the random ones."""


@pytest.mark.parametrize("name", list(CASES))
def test_tracker_and_reference_agree_on_random_operations(name: str) -> None:
    case = CASES[name]

    @settings(max_examples=case.examples, deadline=None, database=None)
    @given(ops=st.lists(OP, min_size=10, max_size=STEPS), close=CLOSE, after=st.lists(OP, max_size=3))
    def agree(ops: list[Op], close: CloseFaults, after: list[Op]) -> None:
        run(case, ops, close, after)

    for ops in REGRESSIONS.get(name, []):
        agree = example(ops=ops, close=None, after=[])(agree)
    agree()


# -- the specs are what they claim to be ------------------------------------------


@pytest.mark.parametrize("name", ["kv_request", "acquire_pipeline", "timers"])
def test_differential_spec_passes_static_checks(name: str) -> None:
    errors = [f for f in run_checks(CASES[name].spec) if f.severity == "error"]
    assert errors == []


def test_error_cleanup_spec_breaks_only_the_on_error_rule() -> None:
    codes = {f.code for f in run_checks(CASES["error_cleanup"].spec) if f.severity == "error"}
    assert codes == {"KVF109"}


# -- the reference is pinned to DESIGN.md on its own, not only against the Tracker --


def _reference(name: str) -> tuple[Reference, RecordingDriver, Clock]:
    case = CASES[name]
    driver = recording_driver(case.spec)
    clock = Clock()
    return Reference(case.spec, driver, clock=clock, params=case.params), driver, clock


def _calls(driver: RecordingDriver) -> list[tuple[str, Hashable, bool]]:
    return [(c.action, c.key, c.raised) for c in driver.calls]


def test_reference_runs_do_then_acquires_and_releases_after_the_state_changes() -> None:
    ref, driver, _clock = _reference("kv_request")
    ref.begin("k")
    assert ref.fire("k", "enqueue", n=1) == "queued"
    assert ref.fire("k", "start") == "transferring"
    assert ref.fire("k", "complete") == "done"
    assert _calls(driver) == [
        ("enqueue_job", "k", False),
        ("start_transfer", "k", False),
        ("free_gpu_blocks", "k", False),
        ("task_done", "k", False),
    ]
    assert driver.calls[0].payload == (("n", 1),)
    assert ref.held("k") == ()
    assert ref.finished() == [("k", "done")]


def test_reference_fires_on_error_from_the_source_when_do_raises() -> None:
    ref, driver, _clock = _reference("kv_request")
    ref.begin("k")
    ref.fire("k", "enqueue")
    driver.fail_next("start_transfer")
    with pytest.raises(ActionError) as info:
        ref.fire("k", "start")
    (failure,) = info.value.failures
    assert (failure.action, failure.phase, failure.state) == ("start_transfer", "do", "failed")
    assert ref.state("k") == "failed"
    assert _calls(driver)[-2:] == [("free_gpu_blocks", "k", False), ("task_done", "k", False)]


def test_reference_undoes_the_acquires_of_a_failed_begin_and_begins_nothing() -> None:
    ref, driver, _clock = _reference("acquire_pipeline")
    driver.fail_next("alloc_host")
    with pytest.raises(ActionError) as info:
        ref.begin("k")
    assert [f.state for f in info.value.failures] == [NOT_BEGUN]
    assert ref.state("k") is None


def test_reference_commits_the_on_error_edge_without_its_action_when_that_raises() -> None:
    ref, driver, _clock = _reference("error_cleanup")
    ref.begin("k")
    driver.fail_next("post")
    driver.fail_next("report_failure")
    with pytest.raises(ActionError) as info:
        ref.fire("k", "send")
    assert [(f.action, f.state) for f in info.value.failures] == [("post", "failed"), ("report_failure", "failed")]
    assert ref.state("k") == "failed"
    assert _calls(driver)[-1] == ("free_blocks", "k", False)


def test_reference_timeout_rearmed_during_poll_waits_for_the_next_poll() -> None:
    ref, _driver, clock = _reference("timers")
    ref.begin("k")
    clock.now = 1.0
    assert ref.poll() == [("k", "tick", "polling")]
    # the self-loop re-arms at clock() + 1.0 = 2.0, already due at now=10.0: not in this pass
    assert ref.poll(10.0) == [("k", "tick", "polling")]
    assert ref.poll(10.0) == [("k", "tick", "polling")]


# -- Tracker bugs the differential test found (fail until kvfsm/engine/tracker.py is fixed) --


def _undo_fails(engine: Tracker, driver: RecordingDriver) -> ActionError:
    """acquire_pipeline: on enqueue, open_channel raises, and undoing enqueue_job (task_done) raises too."""
    engine.begin("k")
    engine.fire("k", "stage")
    driver.fail_next("open_channel")
    driver.fail_next("task_done")
    with pytest.raises(ActionError) as info:
        engine.fire("k", "enqueue")
    return info.value


def test_tracker_names_the_release_action_that_raised_while_undoing_an_acquire() -> None:
    driver = recording_driver(CASES["acquire_pipeline"].spec)
    error = _undo_fails(Tracker(CASES["acquire_pipeline"].spec, driver, clock=Clock()), driver)
    assert driver.calls[-2] == Call("task_done", "k", (), raised=True)
    assert [(f.action, f.phase) for f in error.failures] == [("open_channel", "acquire"), ("task_done", "release")]


def test_tracker_reports_an_undo_failure_in_the_state_the_instance_ended_in() -> None:
    driver = recording_driver(CASES["acquire_pipeline"].spec)
    tracker = Tracker(CASES["acquire_pipeline"].spec, driver, clock=Clock())
    error = _undo_fails(tracker, driver)
    assert tracker.state("k") == "retrying"  # on_error (fault) fired from staged
    assert [f.state for f in error.failures] == ["retrying", "retrying"]
