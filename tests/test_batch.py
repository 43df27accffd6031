"""``fire_many`` and ``begin_many`` do to every key what ``fire`` and ``begin`` would, with batch actions called once per group.

Two trackers run the same random program on the same random spec: one fires
each key in turn, the other fires the batch. Their drivers keep real ledgers
and fail on the same (action, key, n-th call) schedule; some actions are
marked :func:`kvfsm.batch`. After every step both must agree on every key's
state, on what each driver holds, on the failures reported (as a multiset)
and on what finished.
"""

from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from collections.abc import Hashable, Mapping
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvfsm
from kvfsm import ActionError, IllegalTransition, Tracker
from kvfsm.spec import Spec
from kvfsm.testing.clock import VirtualClock
from kvfsm.testing.strategies import specs

KEYS = ("a", "b", "c", "d")


class Boom(RuntimeError):
    """An injected failure."""


def own_actions(spec: Spec) -> Spec:
    resources = {name: replace(r, acquire=f"take_{name}", release=f"give_{name}") for name, r in spec.resources.items()}
    return replace(spec, resources=resources)


class Ledger:
    """Holds what its acquires take; fails an action for a key on the calls listed in ``faults``."""

    def __init__(self, actions: tuple[str, ...], batched: frozenset[str], faults: frozenset[tuple[str, str, int]]):
        self.held: dict[Hashable, set[str]] = defaultdict(set)
        self.calls: Counter[tuple[str, Hashable]] = Counter()
        self.faults = faults
        self.batch_calls = 0
        for name in actions:
            setattr(self, name, self._batch(name) if name in batched else self._single(name))

    def _act(self, name: str, key: Hashable) -> None:
        self.calls[name, key] += 1
        kind, _, resource = name.partition("_")
        if kind == "give":
            self.held[key].discard(resource)
        if (name, str(key), self.calls[name, key]) in self.faults:
            raise Boom(f"{name}({key!r})")
        if kind == "take":
            self.held[key].add(resource)

    def _single(self, name: str) -> Any:
        def single(key: Hashable, **_payload: Any) -> None:  # random specs may declare payload (linked ids)
            self._act(name, key)

        return single

    def _batch(self, name: str) -> Any:
        @kvfsm.batch
        def many(keys: list[Hashable], **_payload: Any) -> Mapping[Hashable, BaseException]:
            self.batch_calls += 1
            failed: dict[Hashable, BaseException] = {}
            for key in keys:
                try:
                    self._act(name, key)
                except Boom as exc:
                    failed[key] = exc
            return failed

        return many


def failures(exc: ActionError) -> Counter[tuple[Any, ...]]:
    return Counter((f.key, f.event, f.action, f.phase, f.state) for f in exc.failures)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(max_states=4, max_resources=3, max_events=3).map(own_actions), data=st.data())
def test_fire_many_and_begin_many_do_to_each_key_what_fire_and_begin_do(spec: Spec, data: st.DataObject) -> None:
    actions = spec.actions()
    batched = frozenset(data.draw(st.sets(st.sampled_from(actions)) if actions else st.just(set()), label="batched"))
    faults = frozenset(
        data.draw(
            st.sets(st.tuples(st.sampled_from(actions), st.sampled_from(KEYS), st.integers(1, 3)), max_size=6)
            if actions
            else st.just(set()),
            label="faults",
        )
    )
    one, many = Ledger(actions, frozenset(), faults), Ledger(actions, batched, faults)
    clocks = VirtualClock(), VirtualClock()
    t1, t2 = Tracker(spec, one, clock=clocks[0]), Tracker(spec, many, clock=clocks[1])
    events = [*spec.events, "no_such_event"]
    for _ in range(data.draw(st.integers(1, 12), label="steps")):
        keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=6), label="keys")
        kind = data.draw(st.sampled_from(("begin", "fire", "fire", "poll")), label="step")
        if kind == "poll":
            advance = data.draw(st.sampled_from((0.5, 1.0, 3.0)), label="advance")
            outcomes = []
            for t, clock in zip((t1, t2), clocks, strict=True):
                clock.advance(advance)
                try:
                    outcomes.append(sorted(map(str, t.poll())))
                except ActionError as exc:
                    outcomes.append(sorted(map(str, exc.result)))
            assert outcomes[0] == outcomes[1]
            continue
        if kind == "begin":
            expected: Counter[tuple[Any, ...]] = Counter()
            for key in keys:
                try:
                    t1.begin(key)
                except ActionError as exc:
                    expected += failures(exc)
                except kvfsm.DuplicateKey:
                    expected[key, "begin", "<none>", "refused", t1.state(key)] += 1
            got: Counter[tuple[Any, ...]] = Counter()
            try:
                t2.begin_many(keys)
            except ActionError as exc:
                got = failures(exc)
            assert got == expected
            assert {k: t1.state(k) for k in KEYS} == {k: t2.state(k) for k in KEYS}
            assert {k: set(one.held[k]) for k in KEYS} == {k: set(many.held[k]) for k in KEYS}
            continue
        event = data.draw(st.sampled_from(events), label="event")
        expected = Counter()
        for key in keys:
            try:
                t1.fire(key, event)
            except ActionError as exc:
                expected += failures(exc)
            except IllegalTransition as exc:
                expected[key, event, "<none>", "refused", exc.state] += 1
        got = Counter()
        try:
            t2.fire_many(event, keys)
        except ActionError as exc:
            got = failures(exc)
        assert got == expected
        assert {k: t1.state(k) for k in KEYS} == {k: t2.state(k) for k in KEYS}
        assert {k: set(one.held[k]) for k in KEYS} == {k: set(many.held[k]) for k in KEYS}
        assert {k: set(t2.held(k)) for k in KEYS} == {k: set(many.held[k]) for k in KEYS}
        assert t1.counts == t2.counts
        assert sorted(map(str, t1.finished())) == sorted(map(str, t2.finished()))


SPEC = """
kvfsm: 1
machine: sends
key: request_id
params: {transfer_timeout: 5.0}
resources:
  slot: {acquire: take_slot, release: give_slot}
states:
  queued:  {initial: true, waits: local}
  sending: {holds: [slot], timeout: {after: transfer_timeout, fire: expire}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
transitions:
  - {event: start,    from: queued,  to: sending, do: submit, payload: [peer]}
  - {event: complete, from: sending, to: done}
  - {event: expire,   from: sending, to: failed}
  - {event: fail,     from: [queued, sending], to: failed}
  - {event: abort,    from: "*",     to: aborted}
ignore:
  - {event: [complete, expire, abort, fail], in: [done, failed, aborted]}
on_error: fail
"""


class Sender:
    def __init__(self) -> None:
        self.submitted: list[tuple[list[Hashable], str]] = []
        self.slots: set[Hashable] = set()

    @kvfsm.batch
    def submit(self, keys: list[Hashable], peer: str = "") -> Mapping[Hashable, BaseException]:
        self.submitted.append((list(keys), peer))
        return {k: Boom("peer refused") for k in keys if k == "bad"}

    @kvfsm.batch
    def take_slot(self, keys: list[Hashable], peer: str = "") -> None:
        self.slots.update(keys)

    @kvfsm.batch
    def give_slot(self, keys: list[Hashable]) -> None:
        self.slots.difference_update(keys)


def test_a_batch_action_is_called_once_for_the_group_with_the_payload() -> None:
    sender = Sender()
    t = Tracker(kvfsm.parse(SPEC, "sends.yaml"), sender, clock=VirtualClock())
    for key in ("r1", "r2", "r3"):
        t.begin(key)
    t.fire_many("start", ["r1", "r2", "r3"], peer="decode-1")
    assert sender.submitted == [(["r1", "r2", "r3"], "decode-1")]
    assert sender.slots == {"r1", "r2", "r3"} and t.state("r2") == "sending"
    t.fire_many("complete", ["r1", "r2", "r3"])
    assert sender.slots == set() and sorted(k for k, _ in t.finished()) == ["r1", "r2", "r3"]


def test_a_key_a_batch_action_failed_for_takes_on_error_and_the_rest_move_on() -> None:
    sender = Sender()
    t = Tracker(kvfsm.parse(SPEC, "sends.yaml"), sender, clock=VirtualClock())
    for key in ("ok", "bad"):
        t.begin(key)
    with pytest.raises(ActionError) as caught:
        t.fire_many("start", ["ok", "bad"], peer="d")
    (failure,) = caught.value.failures
    assert (failure.key, failure.action, failure.phase, failure.state) == ("bad", "submit", "do", "failed")
    assert t.state("ok") == "sending" and sender.slots == {"ok"}


def test_unknown_keys_and_illegal_events_do_not_stop_the_batch() -> None:
    t = Tracker(kvfsm.parse(SPEC, "sends.yaml"), Sender(), clock=VirtualClock())
    t.begin("q")
    t.begin("s")
    t.fire("s", "start")
    with pytest.raises(ActionError) as caught:
        t.fire_many("complete", ["ghost", "q", "s"])
    (refused,) = caught.value.failures
    assert refused.key == "q" and refused.phase == "refused" and isinstance(refused.error, IllegalTransition)
    assert t.state("s") == "done" and t.counts["unknown"] == 1


def test_a_batch_with_undeclared_payload_is_refused_before_anything_runs() -> None:
    sender = Sender()
    t = Tracker(kvfsm.parse(SPEC, "sends.yaml"), sender, clock=VirtualClock())
    t.begin("r1")
    with pytest.raises(kvfsm.PayloadError, match="'peers' → 'peer'"):
        t.fire_many("start", ["r1"], peers="d")
    assert sender.submitted == [] and t.state("r1") == "queued"


def test_fire_calls_a_batch_action_with_a_one_key_list() -> None:
    sender = Sender()
    t = Tracker(kvfsm.parse(SPEC, "sends.yaml"), sender, clock=VirtualClock())
    t.begin("bad")
    with pytest.raises(ActionError):
        t.fire("bad", "start", peer="d")
    assert sender.submitted == [(["bad"], "d")] and t.state("bad") == "failed"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(max_states=4, max_resources=2, max_events=3).map(own_actions), data=st.data())
def test_fire_many_by_does_to_each_id_what_fire_by_does(spec: Spec, data: st.DataObject) -> None:
    """Ids of the current, an earlier and no generation, in a batch: the same states, anomalies and failures."""
    actions = spec.actions()
    faults = frozenset(
        data.draw(
            st.sets(st.tuples(st.sampled_from(actions), st.sampled_from(KEYS), st.integers(1, 3)), max_size=4)
            if actions
            else st.just(set()),
            label="faults",
        )
    )
    one, many = Ledger(actions, frozenset(), faults), Ledger(actions, frozenset(actions), faults)
    t1, t2 = (Tracker(spec, driver, clock=VirtualClock(), spaces=["peer"]) for driver in (one, many))
    serial = 0
    ids = ["never-linked"]
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        kind = data.draw(st.sampled_from(("begin", "fire", "fire", "drain")), label="step")
        if kind == "begin":
            key = data.draw(st.sampled_from(KEYS), label="key")
            if t1.state(key) in spec.live:
                continue
            serial += 1
            for t in (t1, t2):
                with contextlib.suppress(ActionError):
                    t.begin(key)
                if t.state(key) in spec.live:
                    t.link(key, "peer", f"p{serial}")
            ids.append(f"p{serial}")
            continue
        if kind == "drain":
            assert t1.finished() == t2.finished()
            continue
        event = data.draw(st.sampled_from(spec.events), label="event")
        batch = data.draw(st.lists(st.sampled_from(ids), max_size=5), label="ids")
        expected: Counter[tuple[Any, ...]] = Counter()
        for ident in batch:
            try:
                t1.fire_by("peer", ident, event)
            except ActionError as exc:
                expected += failures(exc)
            except IllegalTransition as exc:
                expected[exc.key, event, "<none>", "refused", exc.state] += 1
        got: Counter[tuple[Any, ...]] = Counter()
        try:
            t2.fire_many_by("peer", event, batch)
        except ActionError as exc:
            got = failures(exc)
        assert got == expected
        assert {k: t1.state(k) for k in KEYS} == {k: t2.state(k) for k in KEYS}
        assert {k: set(one.held[k]) for k in KEYS} == {k: set(many.held[k]) for k in KEYS}
        assert t1.counts == t2.counts
        assert Counter(t1.anomalies()) == Counter(t2.anomalies())
