"""Counted events (``count: K`` on a transition): K distinct senders during one stay in a state, in the engine.

The bug class: a connector that counts raw messages by hand frees on a duplicate from one sender while
another is still reading (NIXL with decode TP > prefill TP), restarts a deadline on every ack, or keeps
a count that outlives the state it belongs to. Each test pins one rule of the construct; the property
at the end runs random arrivals against the oracle that ``kvfsm test`` uses.
"""

from __future__ import annotations

from typing import Any

import pytest
from drivers import Pins
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfsm
from kvfsm import Tracker
from kvfsm.errors import BindingError, IllegalTransition, PayloadError
from kvfsm.spec import run_checks
from kvfsm.spec.loader import read_text
from kvfsm.testing import VirtualClock, run
from kvfsm.testing.oracle import SpecModel

ACKS = """
kvfsm: 1
machine: acks
key: request_id
params:
  ack_timeout: 10.0
  quorum: 2
resources:
  blocks: {acquire: pin, release: unpin}
states:
  waiting:  {initial: true, holds: [blocks], timeout: {after: ack_timeout, fire: expire}}
  stalled:  {holds: [blocks], timeout: {after: ack_timeout, fire: expire}}
  acked:    {final: success}
  expired:  {final: failure}
  aborted:  {final: failure}
transitions:
  - {event: ack,    from: waiting, to: acked, payload: [readers], count: readers}
  - {event: nudge,  from: waiting, to: waiting}
  - {event: stall,  from: waiting, to: stalled}
  - {event: resume, from: stalled, to: waiting}
  - {event: expire, from: [waiting, stalled], to: expired}
  - {event: abort,  from: "*", to: aborted}
ignore:
  - {event: [ack], in: [stalled, acked, expired, aborted]}
  - {event: [nudge, stall, resume, expire, abort], in: [acked, expired, aborted]}
"""


def spec_with(count: str, begin: str = "") -> kvfsm.Spec:
    text = ACKS.replace("payload: [readers], count: readers", count)
    return kvfsm.parse(text + begin)


def tracker(spec: kvfsm.Spec | None = None, **kw: Any) -> tuple[Tracker, Pins, VirtualClock]:
    clock = VirtualClock()
    pins = Pins()
    return Tracker(spec or kvfsm.parse(ACKS), pins, clock=clock, **kw), pins, clock


def test_the_kth_distinct_sender_fires_it_and_a_repeat_never_counts() -> None:
    t, pins, _ = tracker()
    t.begin("r")
    assert t.fire("r", "ack", sender="d0", readers=2) == "waiting"
    assert t.fire("r", "ack", sender="d0", readers=2) == "waiting", "a duplicate from d0 must not complete the count"
    assert pins.held == {"r"}
    assert [(a.kind, a.id, a.event) for a in t.anomalies()] == [("duplicate", "r", "ack")]
    assert t.fire("r", "ack", sender="d1", readers=2) == "acked"
    assert pins.held == set()
    assert (t.counts["counted"], t.counts["duplicate"]) == (1, 1)


def test_arrivals_do_not_rearm_the_deadline() -> None:
    t, pins, clock = tracker()
    t.begin("r")
    clock.now = 9.0
    t.fire("r", "ack", sender="d0", readers=3)
    t.fire("r", "ack", sender="d1", readers=3)
    clock.now = 10.0
    assert t.poll() == [("r", "expire", "expired")], "the deadline runs from entering the state, not the last ack"
    assert pins.held == set()


def test_a_self_loop_keeps_the_count_and_leaving_the_state_forgets_it() -> None:
    t, _, _ = tracker()
    t.begin("r")
    t.fire("r", "ack", sender="d0", readers=2)
    t.fire("r", "nudge")
    assert t.fire("r", "ack", sender="d0", readers=2) == "waiting"  # still heard: a duplicate
    t.fire("r", "stall")
    t.fire("r", "resume")
    assert t.fire("r", "ack", sender="d1", readers=2) == "waiting", "d0 was heard in an earlier stay: count again"
    assert t.fire("r", "ack", sender="d0", readers=2) == "acked"


def test_k_zero_from_the_event_fires_on_its_arrival() -> None:
    t, _, _ = tracker()
    t.begin("r")
    assert t.fire("r", "ack", sender="anyone", readers=0) == "acked"


@pytest.mark.parametrize(
    ("count", "begin", "params"),
    [("count: 0", "", {}), ("count: quorum", "", {"quorum": 0}), ("count: readers", "begin: {payload: [readers]}", {})],
)
def test_k_zero_known_on_entry_fires_at_once(count: str, begin: str, params: dict[str, float]) -> None:
    t, pins, _ = tracker(spec_with(count, begin), params=params)
    t.begin("r", **({"readers": 0} if begin else {}))
    assert t.state("r") == "acked", "nobody to wait for: the count is complete as the instance enters the state"
    assert pins.held == set()
    t.begin("s", **({"readers": 1} if begin else {})) if begin else None
    if begin:
        t.fire("s", "stall")
        t.fire("s", "resume")
        assert t.state("s") == "waiting"


def test_k_from_a_param_and_from_begin() -> None:
    t, _, _ = tracker(spec_with("count: quorum"), params={"quorum": 3})
    t.begin("r")
    for sender, state in (("a", "waiting"), ("b", "waiting"), ("c", "acked")):
        assert t.fire("r", "ack", sender=sender) == state
    t, _, _ = tracker(spec_with("count: readers", "begin: {payload: [readers]}"))
    t.begin_many(["x", "y"], readers=2)
    t.fire_many("ack", ["x", "y"], sender="a")
    t.fire_many("ack", ["x", "y"], sender="b")
    assert (t.state("x"), t.state("y")) == ("acked", "acked")


def test_bad_counts_are_refused_with_nothing_changed() -> None:
    t, pins, _ = tracker()
    t.begin("r")
    with pytest.raises(PayloadError, match="sender="):
        t.fire("r", "ack", readers=2)
    for bad in (-1, 1.5, "2", True, None):
        with pytest.raises(PayloadError, match="whole number"):
            t.fire("r", "ack", sender="a", readers=bad)
    with pytest.raises(PayloadError, match="hashable"):
        t.fire("r", "ack", sender=["a"], readers=2)
    assert t.state("r") == "waiting" and pins.held == {"r"} and t.counts["counted"] == 0
    with pytest.raises(BindingError, match="whole number"):
        tracker(spec_with("count: quorum"), params={"quorum": 1.5})
    t, _, _ = tracker(spec_with("count: readers", "begin: {payload: [readers]}"))
    with pytest.raises(PayloadError, match="readers"):
        t.begin("r")
    assert t.live() == 0


def test_a_sender_is_for_counted_events_only() -> None:
    t, _, _ = tracker()
    t.begin("r")
    t.fire("r", "stall")
    assert t.fire("r", "ack", sender="a", readers=1) == "stalled"  # counted elsewhere, ignored here
    with pytest.raises(PayloadError, match="'sender'"):
        t.fire("r", "abort", sender="a")  # counted nowhere: who sent it means nothing
    assert t.state("r") == "stalled"


def test_deliver_many_counts_each_id_and_close_forgets_everything() -> None:
    t, pins, _ = tracker()
    t.begin_many(["a", "b", "c"])
    t.deliver_many("ack", ["a", "b", "a"], sender="d0", readers=2)  # a twice from d0: one duplicate
    assert t.counts["duplicate"] == 1
    t.deliver_many("ack", ["a", "b"], sender="d1", readers=2)
    assert (t.state("a"), t.state("b"), t.state("c")) == ("acked", "acked", "waiting")
    t.fire("c", "ack", sender="d0", readers=2)
    t.close()
    assert pins.held == set() and t._heard == {} and t._need == {}


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("payload: [readers], count: nobody", "neither a param"),
        ("payload: [readers], count: readers}\n  - {event: abort, from: waiting, to: aborted, count: 2", "way out"),
        ("payload: [sender]", "sender"),
    ],
)
def test_kvf116_says_what_is_wrong(line: str, what: str) -> None:
    spec = read_text(ACKS.replace("payload: [readers], count: readers", line))
    found = [f for f in run_checks(spec) if f.code == "KVF116"]
    assert found and what in found[0].message, [f.message for f in run_checks(spec)]


def test_a_counted_self_loop_is_kvf116() -> None:
    spec = read_text(
        ACKS.replace(
            "{event: nudge,  from: waiting, to: waiting}", "{event: nudge, from: waiting, to: waiting, count: 2}"
        )
    )
    assert any(f.code == "KVF116" and "loops back" in f.message for f in run_checks(spec))


def test_kvfsm_test_exercises_counts_and_passes_a_driver_that_keeps_to_the_spec() -> None:
    for spec, params in (
        (kvfsm.parse(ACKS), None),
        (spec_with("count: quorum"), {"quorum": 2}),
        (spec_with("count: readers", "begin: {payload: [readers]}"), None),
    ):
        report = run(spec, Pins, examples=60, seed=1, params=params)
        assert report.passed, report


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("ack"), st.integers(0, 3), st.integers(0, 3)),
            st.tuples(st.sampled_from(["nudge", "stall", "resume"]), st.just(0), st.just(0)),
            st.tuples(st.just("tick"), st.just(0), st.just(0)),
        ),
        max_size=30,
    )
)
def test_the_engine_counts_as_the_oracle_does(steps: list[tuple[str, int, int]]) -> None:
    """Random arrivals (senders 0–3, K 0–3), self-loops, leaving and re-entering, time: same states, same counts."""
    spec = kvfsm.parse(ACKS)
    t, pins, clock = tracker(spec)
    model = SpecModel(spec)
    t.begin("r")
    model.begin("r")
    for event, sender, need in steps:
        if event == "tick":
            clock.now += 4.0
            model.now = clock.now
            t.poll()
            model.poll()
        else:
            payload = {"sender": f"s{sender}", "readers": need} if event == "ack" else {}
            want = model.fire("r", event, payload)
            if want.refused == "illegal":
                with pytest.raises(IllegalTransition):
                    t.fire("r", event, **payload)
            else:
                assert t.fire("r", event, **payload) == want.state
        assert t.state("r") == model.state("r")
        assert {k: t.counts[k] for k in ("counted", "duplicate")} == {
            k: model.counts[k] for k in ("counted", "duplicate")
        }
        assert (pins.held == {"r"}) == bool(model.held("r"))
