"""Calls into the Tracker from inside its own driver actions and observer, on random specs.

A driver author *will* call the tracker from an action: a release that
reports to the scheduler, an observer that drains, a worker callback. The
property below builds random specs (``kvfsm.testing.strategies.specs``),
gives every resource its own acquire and release action so a ledger can
follow the driver's real holdings, and lets every action and the observer
call any public method of the tracker — or raise, now and then even a
``BaseException`` — while a random program of top-level calls runs.

After every top-level call, whatever it returned or raised:

- the driver holds exactly what the spec says each key's state holds (no
  double acquire, no release of something not held, nothing leaked);
- only kvfsm's own errors escaped (or the injected ``BaseException``, with
  the :class:`ActionError` as its cause), and nothing is left queued;
- every instance's journal (the observer's lines) is a chain: each line
  starts where the previous one of that generation ended;

and at the end, after ``close()``: nothing is held, nothing is live, every
instance that reached a final state was reported by ``finished()`` exactly
once, and the tracker refuses new work.
"""

from __future__ import annotations

import io
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvfsm
from kvfsm import ActionError, KvfsmError, ReentrantCall, Tracker, TrackerClosed
from kvfsm.engine.tracker import DRAIN_SLACK
from kvfsm.replay import JsonlJournal, check_log
from kvfsm.spec import Spec, read_text
from kvfsm.testing.clock import VirtualClock
from kvfsm.testing.strategies import specs

KEYS = ("a", "b", "c")
NESTED = (
    "begin",
    "begin",
    "fire",
    "fire",
    "fire",
    "fire",
    "poll",
    "close",
    "finished",
    "anomalies",
    "link",
    "fire_by",
    "queries",
    "unhashable",
)


class Interrupt(BaseException):
    """An injected BaseException that is not an Exception (like KeyboardInterrupt)."""


class Injected(RuntimeError):
    """An injected ordinary failure."""


def own_actions(spec: Spec) -> Spec:
    """``spec`` with an acquire and a release action of its own for every resource, so a ledger can follow each."""
    resources = {name: replace(r, acquire=f"take_{name}", release=f"give_{name}") for name, r in spec.resources.items()}
    return replace(spec, resources=resources)


@dataclass
class Rig:
    """A random spec, a ledger driver whose actions call back into the tracker, and what was seen."""

    spec: Spec
    data: st.DataObject
    clock: VirtualClock = field(default_factory=VirtualClock)
    tracker: Tracker | None = None
    held: dict[Hashable, set[str]] = field(default_factory=lambda: defaultdict(set))
    violations: list[str] = field(default_factory=list)
    depth: int = 0
    journal: list[tuple[Hashable, int, str, str, str]] = field(default_factory=list)
    reported: Counter[Hashable] = field(default_factory=Counter)
    interrupts: int = 0
    log: io.BytesIO = field(default_factory=io.BytesIO)
    jsonl: JsonlJournal = field(init=False)

    def __post_init__(self) -> None:
        self.jsonl = JsonlJournal(self.log, machine=self.spec.name, buffer_bytes=0)

    # -- the driver -------------------------------------------------------------

    def action(self, name: str) -> Callable[..., None]:
        kind, _, resource = name.partition("_")

        def act(key: Hashable, **payload: Any) -> None:
            if kind == "give":  # a release frees first, so whatever it does next cannot leak what it held
                if resource not in self.held[key]:
                    self.violations.append(f"{name}({key!r}): {resource} released but not held")
                self.held[key].discard(resource)
            self.maybe_call_back(f"{name}({key!r})")
            self.maybe_raise(name)
            if kind == "take":  # an acquire takes last, so a call back or fault before it takes nothing
                if resource in self.held[key]:
                    self.violations.append(f"{name}({key!r}): {resource} acquired twice")
                self.held[key].add(resource)

        act.__name__ = name
        return act

    def observer(self, key: Hashable, gen: int, event: str, source: str, target: str, now: float) -> None:
        self.journal.append((key, gen, event, source, target))
        self.jsonl(key, gen, event, source, target, now)
        self.maybe_call_back(f"observer({key!r}, {event!r})")
        self.maybe_raise("observer")

    def maybe_raise(self, where: str) -> None:
        roll = self.data.draw(st.integers(0, 39), label=f"raise in {where}?")
        if roll == 0:
            self.interrupts += 1
            raise Interrupt(where)
        if roll < 5:
            raise Injected(where)

    def maybe_call_back(self, where: str) -> None:
        if self.depth >= 2 or self.data.draw(st.integers(0, 1), label=f"call back from {where}?") != 0:
            return
        self.depth += 1
        try:
            call = self.data.draw(st.sampled_from(NESTED), label="nested call")
            propagate = self.data.draw(st.booleans(), label="let its error through")
            try:
                self.call(call, nested=True)
            except KvfsmError:
                if propagate:
                    raise
        finally:
            self.depth -= 1

    # -- calls, top-level or nested -----------------------------------------------

    def call(self, name: str, *, nested: bool) -> None:
        t = self.tracker
        assert t is not None
        key = self.data.draw(st.sampled_from(KEYS), label="key")
        events = [*self.spec.events, "no_such_event"]
        if name == "begin":
            t.begin(key)
        elif name == "fire":
            t.fire(key, self.data.draw(st.sampled_from(events), label="event"))
        elif name == "fire_by":
            t.fire_by("peer", f"peer-{key}", self.data.draw(st.sampled_from(events), label="event"))
        elif name == "poll":
            if not nested:  # a nested poll is refused, so time passes only where the loop polls (the log's deadlines)
                self.clock.advance(self.data.draw(st.sampled_from((0.0, 0.5, 1.0, 3.0)), label="advance"))
            t.poll()
        elif name == "close":
            t.close()
        elif name == "finished":
            self.reported.update(k for k, _state in t.finished())
        elif name == "anomalies":
            t.anomalies()
        elif name == "link":
            if t.state(key) is not None:
                t.link(key, "peer", f"peer-{key}")
        elif name == "queries":
            t.state(key), t.held(key), t.accepts(key, "abort"), t.route("peer", f"peer-{key}")
            t.generation(key), t.census(), t.holding(), t.live(), t.next_deadline()
        elif name == "unhashable":
            t.fire(["not", "hashable"], "abort")  # type: ignore[arg-type]
        else:  # pragma: no cover
            raise AssertionError(name)

    # -- what must hold after each top-level call ------------------------------------------

    def check(self, after: str) -> None:
        t = self.tracker
        assert t is not None
        assert not self.violations, f"after {after}: {self.violations}"
        assert not t._queue and not t._busy, f"after {after}: calls left queued or the tracker left busy"
        for key in {*KEYS, *self.held}:
            assert self.held[key] == set(t.held(key)), (
                f"after {after}: the driver holds {sorted(self.held[key])} for {key!r}, "
                f"but the spec says {t.state(key)!r} holds {sorted(t.held(key))}"
            )
        last: dict[tuple[Hashable, int], str] = {}
        for key, gen, event, source, target in self.journal:
            expected = last.get((key, gen), "")
            assert source == expected, f"journal of {key!r} gen {gen}: {event!r} from {source!r} after {expected!r}"
            last[key, gen] = target


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=specs(max_states=4, max_resources=3, max_events=3).map(own_actions), data=st.data())
def test_calls_from_inside_actions_never_corrupt_the_tracker(spec: Spec, data: st.DataObject) -> None:
    rig = Rig(spec, data)
    driver = type("LedgerDriver", (), {name: staticmethod(rig.action(name)) for name in spec.actions()})()
    rig.tracker = Tracker(spec, driver, clock=rig.clock, observer=rig.observer, spaces=["peer"])
    tops = data.draw(
        st.lists(
            st.sampled_from(("begin", "begin", "fire", "fire", "fire", "poll", "finished", "link", "fire_by")),
            max_size=40,
        ),
        label="top-level calls",
    )
    for i, name in enumerate([*tops, "close", "finished"]):
        interrupts = rig.interrupts
        try:
            rig.call(name, nested=False)
        except Interrupt as exc:
            assert rig.interrupts > interrupts, "an Interrupt escaped a call that injected none"
            assert isinstance(exc.__cause__, ActionError), "an interrupted call must say what else failed"
        except TypeError:
            assert name == "unhashable"  # pragma: no cover - only nested calls use unhashable keys
        except KvfsmError:
            pass
        rig.check(f"call {i}: {name}")
    t = rig.tracker
    assert t.live() == 0 and all(not held for held in rig.held.values()), "close() left something held"
    entered = Counter(key for key, _gen, _event, _source, target in rig.journal if spec.states[target].is_final)
    assert rig.reported == entered, "every instance that finished must be reported by finished() exactly once"
    with pytest.raises(TrackerClosed):
        t.begin("a")
    rig.jsonl.flush()
    report = check_log(
        spec, rig.log.getvalue().splitlines(keepends=True), tolerance=10.0, allow_live=t.counts["forced"] > 0
    )
    assert report.conforms, [str(f) for f in report.findings]


# -- each kind of re-entrant call, pinned down on a small spec ------------------------------------

SLOTS = """
kvfsm: 1
machine: slots
key: request_id
resources:
  slot: {acquire: take, release: give}
states:
  idle:    {initial: true, waits: local}
  busy:    {holds: [slot], timeout: {after: 1.0, fire: expire}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: start,  from: idle, to: busy}
  - {event: finish, from: busy, to: done}
  - {event: fail,   from: [idle, busy], to: failed}
  - {event: abort,  from: "*", to: aborted}
  - {event: expire, from: busy, to: expired}
ignore:
  - {event: [start, finish, abort, expire, fail], in: [done, failed, aborted, expired]}
on_error: fail
"""


class Slots:
    """Holds a slot per key; ``hooks[action]`` runs inside that action, before its effect."""

    def __init__(self) -> None:
        self.slots: Counter[Hashable] = Counter()
        self.hooks: dict[str, Callable[[Hashable], None]] = {}
        self.calls: list[tuple[str, Hashable]] = []

    def take(self, key: Hashable) -> None:
        self.calls.append(("take", key))
        if "take" in self.hooks:
            self.hooks["take"](key)
        self.slots[key] += 1

    def give(self, key: Hashable) -> None:
        self.calls.append(("give", key))
        if "give" in self.hooks:
            self.hooks["give"](key)
        self.slots[key] -= 1


def slots(**kwargs: Any) -> tuple[Tracker, Slots]:
    driver = Slots()
    kwargs.setdefault("clock", VirtualClock())
    return Tracker(kvfsm.parse(SLOTS, "slots.yaml"), driver, **kwargs), driver


def test_close_aborts_each_instance_from_the_state_it_is_in_when_its_turn_comes() -> None:
    t, d = slots()
    t.begin("a")
    t.begin("b")
    t.fire("a", "start")
    d.hooks["give"] = lambda key: t.fire("b", "start") if key == "a" else None  # a's release moves b
    t.close()
    assert t.state("b") == "aborted" and +d.slots == Counter(), f"slots still held: {+d.slots}"
    assert sorted(k for k, _ in t.finished()) == ["a", "b"]


def test_finished_from_inside_a_release_retires_nothing_mid_transition() -> None:
    t, d = slots()
    drained: list[tuple[Hashable, str]] = []
    d.hooks["give"] = lambda key: drained.extend(t.finished())
    t.begin("a")
    t.fire("a", "start")
    assert t.fire("a", "finish") == "done"
    assert drained == [("a", "done")] and t.state("a") is None  # reported once, retired after the step
    t.begin("b")
    t.fire("b", "start")
    t.poll(5.0)
    t.close()
    assert drained[-1] == ("b", "expired") and t.finished() == []


def test_poll_and_close_from_inside_an_action_are_refused_and_the_action_fails() -> None:
    for call in (lambda t: t.poll(), lambda t: t.close()):
        t, d = slots()
        d.hooks["take"] = lambda _key, call=call, t=t: call(t)
        t.begin("a")
        with pytest.raises(ActionError) as caught:
            t.fire("a", "start")
        assert isinstance(caught.value.failures[0].error, ReentrantCall)
        assert t.state("a") == "failed" and +d.slots == Counter()


def test_a_begin_from_inside_the_same_keys_acquire_is_queued_and_refused_as_a_duplicate() -> None:
    spec = SLOTS.replace(
        "idle:    {initial: true, waits: local}", "idle:    {initial: true, holds: [slot], waits: local}"
    )
    spec = spec.replace("busy:    {holds: [slot]", "busy:    {holds: [slot]")
    d = Slots()
    t = Tracker(kvfsm.parse(spec, "slots_held.yaml"), d)
    d.hooks["take"] = lambda key: t.begin(key) if d.slots[key] == 0 else None
    with pytest.raises(ActionError) as caught:
        t.begin("a")
    (failure,) = caught.value.failures
    assert failure.phase == "queued" and isinstance(failure.error, kvfsm.DuplicateKey)
    assert d.slots["a"] == 1, "acquired once"


def test_a_failed_nested_begin_is_reported_by_the_outer_call() -> None:
    t, d = slots()

    def take(key: Hashable) -> None:
        if key == "a":
            t.begin("b")
        else:
            raise Injected("no slot for b")

    d.hooks["take"] = take
    spec_b = t  # b begins in idle (no acquire), so make it take one: start it from inside a's take
    d.hooks["take"] = lambda key: (t.begin("b"), t.fire("b", "start")) if key == "a" else take(key)
    t.begin("a")
    with pytest.raises(ActionError) as caught:
        spec_b.fire("a", "start")
    assert [(f.key, f.phase) for f in caught.value.failures] == [("b", "acquire")]
    assert t.state("b") == "failed" and +d.slots == Counter({"a": 1})


def test_events_an_action_queued_never_run_inside_a_later_unrelated_call() -> None:
    t, d = slots()
    t.begin("x")
    t.begin("a")

    def take(key: Hashable) -> None:
        t.fire("x", "start")
        raise Injected("no slot")

    d.hooks["take"] = take
    with pytest.raises(ActionError):
        t.fire("a", "start")
    during = list(d.calls)
    d.hooks.clear()
    t.begin("y")
    assert d.calls == during, "nothing queued earlier may run inside begin('y')"


def test_an_unhashable_key_from_an_action_fails_that_action_not_a_later_call() -> None:
    t, d = slots()
    d.hooks["take"] = lambda key: t.fire(["unhashable"], "abort")  # type: ignore[arg-type]
    t.begin("a")
    with pytest.raises(ActionError) as caught:
        t.fire("a", "start")
    assert isinstance(caught.value.failures[0].error, TypeError)
    d.hooks.clear()
    t.begin("b")
    assert t.fire("b", "start") == "busy"


def test_a_begin_asked_for_while_closing_is_refused_and_nothing_outlives_close() -> None:
    t, d = slots()
    t.begin("a")
    t.fire("a", "start")
    d.hooks["give"] = lambda key: t.begin("late")
    with pytest.raises(ActionError) as caught:
        t.close()
    assert isinstance(caught.value.failures[0].error, TrackerClosed)
    assert t.state("late") is None and t.live() == 0


def test_a_key_reused_from_a_release_keeps_the_journal_in_order() -> None:
    lines: list[tuple[Hashable, int, str, str, str]] = []
    t, d = slots(observer=lambda k, g, e, s, to, _now: lines.append((k, g, e, s, to)))
    t.begin("a")
    t.fire("a", "start")
    d.hooks["give"] = lambda key: (t.finished(), t.begin(key))
    t.fire("a", "finish")
    gens = [g for k, g, e, s, to in lines if e == "begin"]
    assert len(set(gens)) == 2
    assert lines[-2][2:] == ("finish", "busy", "done") and lines[-1][2:] == ("begin", "", "idle")


def test_poll_refuses_a_time_that_is_not_a_finite_number() -> None:
    t, _d = slots()
    t.begin("a")
    t.fire("a", "start")
    for bad in (math.nan, math.inf, "5"):
        with pytest.raises(ValueError, match="finite number"):
            t.poll(bad)  # type: ignore[arg-type]
    assert t.state("a") == "busy"


def test_a_clock_that_runs_backwards_is_held_and_deadlines_still_fire_in_order() -> None:
    clock = VirtualClock(100.0)
    t, _d = slots(clock=clock)
    t.begin("a")
    t.fire("a", "start")  # due at 101
    clock.now = 0.0  # backwards: held at 100, so b is due at 101 too, not at 1
    t.begin("b")
    t.fire("b", "start")
    assert t.counts["clock_backwards"] >= 1
    assert t.poll(50.0) == []
    assert [k for k, _e, _s in t.poll(101.0)] == ["a", "b"]


def test_a_base_exception_in_one_release_runs_the_others_and_escapes_the_same_call() -> None:
    spec = SLOTS.replace(
        "slot: {acquire: take, release: give}", "slot: {acquire: take, release: give}\n  lease: {release: drop}"
    )
    spec = spec.replace("busy:    {holds: [slot]", "busy:    {holds: [slot, lease]")
    dropped: list[Hashable] = []

    class Driver(Slots):
        def drop(self, key: Hashable) -> None:
            dropped.append(key)

    d = Driver()
    t = Tracker(kvfsm.parse(spec, "two.yaml"), d)
    t.begin("a")
    t.fire("a", "start")

    def give(key: Hashable) -> None:
        raise Interrupt("stop")

    d.hooks["give"] = give
    with pytest.raises(Interrupt) as caught:
        t.fire("a", "finish")
    assert isinstance(caught.value.__cause__, ActionError)
    assert dropped == ["a"] and t.state("a") == "done"
    d.hooks.clear()
    t.begin("b")  # nothing of a's failure is raised again by an unrelated call
    assert t.fire("b", "start") == "busy"


def test_a_poll_whose_actions_raise_still_says_what_fired() -> None:
    t, d = slots()
    for key in "ab":
        t.begin(key)
        t.fire(key, "start")
    d.hooks["give"] = lambda key: (_ for _ in ()).throw(Injected("give failed"))
    with pytest.raises(ActionError) as caught:
        t.poll(2.0)
    assert caught.value.result == [("a", "expire", "expired"), ("b", "expire", "expired")]


def test_cancelled_deadlines_are_reclaimed_by_draining_without_any_poll() -> None:
    t, _d = slots()
    for i in range(100_000):
        t.begin(i)
        t.fire(i, "start")
        t.fire(i, "finish")
        if i % 100 == 0:
            t.finished()
    t.finished()
    queued = sum(len(q) for q in t._deadlines.queues)
    assert queued <= DRAIN_SLACK + 2 * len(t._deadlines.armed), f"{queued} dead deadline entries kept"


def test_anomaly_records_keep_a_bounded_copy_of_huge_ids() -> None:
    t, _d = slots()
    for _ in range(50):
        t.fire("x" * 1_000_000, "abort")
    anomalies = t.anomalies()
    assert len(anomalies) == 50 and all(len(a.id) <= 300 for a in anomalies)
    assert t.counts["unknown"] == 50


def test_linking_the_same_id_again_changes_nothing() -> None:
    t, _d = slots(spaces=["peer"])
    t.begin("a")
    for _ in range(1000):
        t.link("a", "peer", "p-1")
    assert t._linked["a"] == [("peer", "p-1")]
    assert t.fire_by("peer", "p-1", "start") == "busy"


def test_a_spec_with_errors_is_refused_by_parse_and_a_malformed_one_by_the_tracker() -> None:
    broken = SLOTS.replace("timeout: {after: 1.0, fire: expire}", "timeout: {after: 1.0, fire: expire_typo}")
    with pytest.raises(kvfsm.SpecError, match="KVF106"):
        kvfsm.parse(broken, "broken.yaml")
    with pytest.raises(kvfsm.SpecError, match="KVF106"):
        Tracker(read_text(broken, "broken.yaml"), Slots())


def test_undeclared_payload_is_refused_with_a_did_you_mean_and_changes_nothing() -> None:
    spec = SLOTS.replace(
        "- {event: start,  from: idle, to: busy}", "- {event: start,  from: idle, to: busy, payload: [gpu_blocks]}"
    )

    class Driver(Slots):
        def take(self, key: Hashable, gpu_blocks: list[int] | None = None) -> None:
            super().take(key)

    t = Tracker(kvfsm.parse(spec, "p.yaml"), Driver())
    t.begin("a")
    with pytest.raises(kvfsm.PayloadError, match="'gpu_block' → 'gpu_blocks'"):
        t.fire("a", "start", gpu_block=[1])
    assert t.state("a") == "idle"
    assert t.fire("a", "start", gpu_blocks=[1]) == "busy"


def test_binding_names_actions_whose_signature_does_not_fit_the_declared_payload() -> None:
    spec = SLOTS.replace(
        "- {event: start,  from: idle, to: busy}", "- {event: start,  from: idle, to: busy, payload: [gpu_blocks]}"
    )

    class Driver(Slots):
        def give(self, key: Hashable, blocks: list[int]) -> None:  # type: ignore[override]
            super().give(key)

    with pytest.raises(kvfsm.BindingError) as caught:
        Tracker(kvfsm.parse(spec, "p.yaml"), Driver())
    message = str(caught.value)
    assert "take() is called on 'start' with payload gpu_blocks, which it does not take" in message
    assert "give() requires blocks, but is called as a release, with the key alone" in message
