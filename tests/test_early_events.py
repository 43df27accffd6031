"""Early events (``early:`` on an event): a message for an id not yet known is kept and applied when it appears.

The bug class: a completion that reaches a connector before it has registered the request (a NIXL
notification before ``request_finished`` is handled, a WRITE-done before the forward pass) is counted
as unknown and dropped, and the blocks wait for the expiry. Each test pins one rule; the last runs
``kvfsm test`` against the oracle.
"""

from __future__ import annotations

import pytest
from drivers import Pins

import kvfsm
from kvfsm import Tracker
from kvfsm.spec import run_checks
from kvfsm.spec.loader import read_text
from kvfsm.testing import VirtualClock, run

HOLD = """
kvfsm: 1
machine: hold
key: request_id
params:
  abort_timeout: 10.0
  early_window: 5.0
resources:
  blocks: {acquire: pin, release: unpin}
states:
  held:    {initial: true, holds: [blocks], timeout: {after: abort_timeout, fire: expire}}
  read:    {final: success}
  expired: {final: failure}
  aborted: {final: failure}
transitions:
  - {event: read,   from: held, to: read, payload: [readers], count: readers}
  - {event: expire, from: held, to: expired}
  - {event: abort,  from: "*",  to: aborted}
events:
  read: {by: request_id, remote: true, early: {keep: 2, within: early_window}}
ignore:
  - {event: [read, expire, abort], in: [read, expired, aborted]}
"""

LINKED = """
kvfsm: 1
machine: load
key: request_id
params:
  transfer_timeout: 10.0
resources:
  dst: {acquire: pin, release: unpin}
states:
  waiting: {initial: true, holds: [dst], timeout: {after: transfer_timeout, fire: expire}}
  loaded:  {final: success}
  expired: {final: failure}
  aborted: {final: failure}
transitions:
  - {event: done,   from: waiting, to: loaded}
  - {event: expire, from: waiting, to: expired}
  - {event: abort,  from: "*", to: aborted}
begin: {payload: [transfer_id]}
spaces:
  transfer_id: {linked_at: begin}
events:
  done: {by: transfer_id, remote: true, early: {keep: 8, within: 3.0}}
ignore:
  - {event: [done, expire, abort], in: [loaded, expired, aborted]}
"""


def make(text: str = HOLD) -> tuple[Tracker, Pins, VirtualClock]:
    clock, pins = VirtualClock(), Pins()
    return Tracker(kvfsm.parse(text), pins, clock=clock), pins, clock


def test_a_message_before_its_request_is_applied_when_the_request_begins() -> None:
    t, pins, _ = make()
    assert t.deliver("read", "r", sender="d0", readers=1) is None
    assert t.counts["kept_early"] == 1 and t.anomalies() == []
    t.begin("r")
    assert t.state("r") == "read", "applied at begin: the blocks never wait for the expiry"
    assert pins.held == set()


def test_kept_messages_keep_their_sender_and_count() -> None:
    t, _, _ = make()
    t.deliver_many("read", ["r"], sender="d0", readers=2)
    t.begin("r")
    assert t.state("r") == "held"
    assert t.deliver("read", "r", sender="d0", readers=2) == "held"  # the same reader again: a duplicate
    assert t.deliver("read", "r", sender="d1", readers=2) == "read"


def test_an_id_linked_later_gets_what_was_kept_for_it() -> None:
    t, pins, _ = make(LINKED)
    t.fire_by("transfer_id", "x-1", "done")
    t.begin("r", transfer_id="x-1")
    assert t.state("r") == "loaded" and pins.held == set()


def test_past_the_window_or_the_bound_it_is_dropped_as_an_early_anomaly() -> None:
    t, _, clock = make()
    t.deliver("read", "a", sender="d0", readers=1)
    t.deliver("read", "b", sender="d0", readers=1)
    t.deliver("read", "c", sender="d0", readers=1)  # keep: 2
    assert [(a.kind, a.id) for a in t.anomalies()] == [("early", "c")]
    clock.now = 5.0
    t.poll()
    assert sorted((a.kind, a.id) for a in t.anomalies()) == [("early", "a"), ("early", "b")]
    t.begin("a")
    assert t.state("a") == "held", "dropped: the expiry frees it now"
    assert (t.counts["kept_early"], t.counts["early"]) == (2, 3)


def test_a_retired_id_is_late_and_close_drops_what_waits() -> None:
    t, _, _ = make()
    t.begin("r")
    t.fire("r", "abort")
    t.finished()
    t.deliver("read", "r", sender="d0", readers=1)
    assert [a.kind for a in t.anomalies()] == ["late"]
    t.deliver("read", "s", sender="d0", readers=1)
    t.close()
    assert [(a.kind, a.id) for a in t.anomalies()] == [("early", "s")]


def test_events_not_declared_early_stay_unknown() -> None:
    t, _, _ = make(HOLD.replace(", early: {keep: 2, within: early_window}", ""))
    t.deliver("read", "r", sender="d0", readers=1)
    assert [a.kind for a in t.anomalies()] == ["unknown"]


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        ("within: early_window", "undeclared param"),
    ],
)
def test_kvf117(edit: str, what: str) -> None:
    spec = read_text(HOLD.replace(edit, "within: nowhere"))
    assert any(f.code == "KVF117" and what in f.message for f in run_checks(spec))


def test_kvfsm_test_keeps_and_applies_early_messages_as_the_tracker_does() -> None:
    report = run(kvfsm.parse(HOLD), Pins, examples=60, seed=2)
    assert report.passed, report
