"""Phases (``phases:``): one deadline across several states, in the spec, the checks and the engine.

The bug class: a lease that must run from ``request_finished`` to the last read is written as a timeout
on each state, and every state change (an ack, a retry, a self-loop resend) re-arms it, so a peer that
keeps nudging holds the blocks forever; or it is written as a timestamp in a side table that some path
forgets to clear. Each test pins one rule of the construct.
"""

from __future__ import annotations

from typing import Any

import pytest
from drivers import Pins

import kvfsm
from kvfsm import Tracker
from kvfsm.spec import SpecError, run_checks
from kvfsm.spec.loader import read_text
from kvfsm.testing import VirtualClock

LEASE = """
kvfsm: 1
machine: lease
key: request_id
params:
  lease_ttl: 10.0
  retry_after: 1.0
resources:
  blocks: {acquire: pin, release: unpin}
phases:
  lease:
    states: [serving, retrying]
    timeout: {after: lease_ttl, fire: expire}
states:
  serving:  {initial: true, holds: [blocks], waits: local}
  retrying: {holds: [blocks], timeout: {after: retry_after, fire: retry}}
  parked:   {holds: [blocks], timeout: {after: lease_ttl, fire: expire}}
  done:     {final: success}
  expired:  {final: failure}
  aborted:  {final: failure}
transitions:
  - {event: nack,   from: serving, to: retrying}
  - {event: nack,   from: retrying, to: retrying}
  - {event: retry,  from: retrying, to: serving}
  - {event: park,   from: [serving, retrying], to: parked}
  - {event: resume, from: parked, to: serving}
  - {event: read,   from: [serving, retrying], to: done}
  - {event: expire, from: [serving, retrying, parked], to: expired}
  - {event: abort,  from: "*", to: aborted}
"""


def tracker(text: str = LEASE, **kw: Any) -> tuple[Tracker, Pins, VirtualClock]:
    clock = VirtualClock()
    pins = Pins()
    return Tracker(kvfsm.parse(text), pins, clock=clock, **kw), pins, clock


def test_the_deadline_runs_from_entering_the_phase_across_moves_and_self_loops() -> None:
    t, pins, clock = tracker()
    t.begin("r")
    for now, event in ((2.0, "nack"), (2.5, "nack"), (2.9, "retry"), (3.0, "nack"), (9.5, "nack")):
        clock.now = now
        t.fire("r", event)
    clock.now = 9.99
    assert t.poll() == [], "nothing is due before the lease"
    assert t.state("r") == "retrying"
    clock.now = 10.0
    assert t.poll() == [("r", "expire", "expired")], "measured from begin, not from the last move"
    assert pins.held == set()
    assert t.counts["timeouts"] == 1


def test_a_state_timeout_inside_a_phase_keeps_its_own_meaning() -> None:
    t, _, clock = tracker()
    t.begin("r")
    clock.now = 4.0
    t.fire("r", "nack")
    clock.now = 4.5
    t.fire("r", "nack")  # a self-loop re-arms the state's own timeout, never the phase's
    clock.now = 5.2
    assert t.poll() == []
    clock.now = 5.5
    assert t.poll() == [("r", "retry", "serving")]
    assert t.next_deadline() == 10.0


def test_leaving_the_phase_disarms_it_and_coming_back_arms_it_afresh() -> None:
    t, _, clock = tracker()
    t.begin("r")
    clock.now = 8.0
    t.fire("r", "park")  # parked is outside the lease: its own deadline, from now
    clock.now = 12.0
    assert t.poll() == [], "the lease was disarmed on leaving the phase"
    t.fire("r", "resume")
    assert t.next_deadline() == 22.0
    clock.now = 21.9
    assert t.poll() == []
    clock.now = 22.0
    assert t.poll() == [("r", "expire", "expired")]


def test_a_phase_over_every_state_is_a_lease_from_begin() -> None:
    text = LEASE.replace("states: [serving, retrying]\n", 'states: "*"\n').replace(
        "parked:   {holds: [blocks], timeout: {after: lease_ttl, fire: expire}}", "parked:   {holds: [blocks]}"
    )
    assert [f.code for f in run_checks(kvfsm.parse(text))] == [], "every live state is covered by the lease"
    t, pins, clock = tracker(text)
    t.begin("r")
    clock.now = 6.0
    t.fire("r", "park")
    t.fire("r", "resume")
    clock.now = 10.0
    assert t.poll() == [("r", "expire", "expired")]
    assert pins.held == set()


def test_batches_arm_and_disarm_phases_as_single_calls_do() -> None:
    t, pins, clock = tracker()
    t.begin_many(["a", "b", "c"])
    clock.now = 5.0
    t.fire_many("park", ["a"])
    t.fire_many("nack", ["b", "c"])
    t.fire_many("read", ["c"])
    clock.now = 10.0
    assert t.poll() == [("b", "retry", "serving"), ("b", "expire", "expired")], "state deadlines first, then phases"
    assert pins.held == {"a"}
    assert t.finished() and t.next_deadline() == 15.0


def test_ending_the_instance_by_abort_or_close_leaves_no_deadline_behind() -> None:
    t, pins, clock = tracker()
    t.begin("a")
    t.begin("b")
    t.fire("a", "abort")
    t.close()
    assert pins.held == set()
    assert t.next_deadline() is None
    clock.now = 100.0
    assert t._phase_deadlines.armed == {}


CHAIN = """
kvfsm: 1
machine: chain
key: request_id
params: {cool: 1.0, lease_ttl: 0.0}
phases:
  lease: {states: [serving], timeout: {after: lease_ttl, fire: expire}}
states:
  cooling: {initial: true, timeout: {after: cool, fire: warm}}
  serving: {}
  expired: {final: failure}
  aborted: {final: failure}
transitions:
  - {event: warm,   from: cooling, to: serving}
  - {event: expire, from: serving, to: expired}
  - {event: abort,  from: "*", to: aborted}
"""


def test_a_phase_armed_by_a_timeout_waits_for_the_next_poll() -> None:
    t, _, clock = tracker(CHAIN)
    t.begin("r")
    clock.now = 1.0
    assert t.poll() == [("r", "warm", "serving")], "the 0 s lease armed by this poll is due, but not in it"
    assert t.poll() == [("r", "expire", "expired")]


def test_a_phase_is_read_with_its_lines_and_a_malformed_one_names_the_fix() -> None:
    spec = kvfsm.parse(LEASE)
    phase = spec.phases["lease"]
    assert (phase.states, phase.timeout.after, phase.timeout.fire, phase.loc.line) == (
        ("serving", "retrying"),
        "lease_ttl",
        "expire",
        11,
    )
    with pytest.raises(SpecError) as raised:
        read_text(LEASE.replace("    timeout: {after: lease_ttl, fire: expire}\n", ""), "p.yaml")
    assert "p.yaml:11" in str(raised.value) and "phase 'lease'" in str(raised.value)
    assert "timeout" in str(raised.value)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (("states: [serving, retrying]", "states: [serving, nowhere]"), "names undeclared state 'nowhere'"),
        (("states: [serving, retrying]", "states: [serving, done]"), "spans final state 'done'"),
        (("after: lease_ttl, fire: expire}", "after: ttl, fire: expire}"), "undeclared param 'ttl'"),
        (("after: lease_ttl, fire: expire}", "after: lease_ttl, fire: nack}"), "inside the phase"),
        (("after: lease_ttl, fire: expire}", "after: lease_ttl, fire: resume}"), "does not accept"),
    ],
)
def test_kvf118_refuses_a_phase_whose_deadline_could_not_end_it(change: tuple[str, str], says: str) -> None:
    spec = read_text(LEASE.replace(*change), "p.yaml")
    found = [f for f in run_checks(spec) if f.code == "KVF118"]
    assert found and any(says in f.message for f in found), [f.message for f in run_checks(spec)]


def test_a_state_in_a_phase_needs_no_timeout_of_its_own() -> None:
    assert [f.code for f in run_checks(kvfsm.parse(LEASE))] == []
    unphased = LEASE.replace("states: [serving, retrying]", "states: [retrying]").replace(
        "serving:  {initial: true, holds: [blocks], waits: local}", "serving:  {initial: true, holds: [blocks]}"
    )
    assert "KVF107" in [f.code for f in run_checks(read_text(unphased))]


FANIN = """
kvfsm: 1
machine: fanin
key: request_id
params: {lease_ttl: 10.0}
begin: {payload: [readers]}
resources:
  blocks: {acquire: pin, release: unpin}
phases:
  lease: {states: [reading, resent], timeout: {after: lease_ttl, fire: expire}}
states:
  reading: {initial: true, holds: [blocks]}
  resent:  {holds: [blocks]}
  read:    {final: success}
  expired: {final: failure}
  aborted: {final: failure}
transitions:
  - {event: ack,    from: reading, to: read, count: readers}
  - {event: nudge,  from: reading, to: reading}
  - {event: resend, from: reading, to: resent}
  - {event: resume, from: resent, to: reading}
  - {event: expire, from: [reading, resent], to: expired}
  - {event: abort,  from: "*", to: aborted}
"""


def test_an_ack_counting_state_with_a_self_loop_expires_at_the_phase_deadline_from_entry() -> None:
    t, pins, clock = tracker(FANIN)
    t.begin("r", readers=3)
    for now, event, sender in ((1.0, "ack", "d0"), (2.0, "nudge", None), (3.0, "ack", "d1"), (4.0, "ack", "d1")):
        clock.now = now
        t.fire("r", event, sender=sender) if sender else t.fire("r", event)
    clock.now = 5.0
    t.fire("r", "resend")
    t.fire("r", "resume")  # leaves the counting state (the count is forgotten), not the phase
    clock.now = 9.9
    assert t.poll() == [] and pins.held == {"r"}
    clock.now = 10.0
    assert t.poll() == [("r", "expire", "expired")]
    assert (t.counts["counted"], t.counts["duplicate"], pins.held) == (2, 1, set())


ASKS = """
kvfsm: 1
machine: asks
key: request_id
params: {cool: 1.0, grace: 0.0}
states:
  cooling: {initial: true, timeout: {after: cool, fire: warm}}
  serving: {timeout: {after: grace, fire: end}}
  parked:  {waits: local}
  ended:   {final: success}
  aborted: {final: failure}
transitions:
  - {event: warm,  from: cooling, to: serving, do: look_ahead}
  - {event: park,  from: serving, to: parked}
  - {event: end,   from: [serving, parked], to: ended}
  - {event: abort, from: "*", to: aborted}
"""


class LooksAhead:
    """Asks the tracker when it must next poll from inside a timeout's action, as a scheduler loop might."""

    tracker: Tracker

    def look_ahead(self, key: object) -> None:
        self.tracker.next_deadline()


def test_asking_for_the_next_deadline_mid_poll_does_not_let_a_deadline_armed_in_that_poll_fire_in_it() -> None:
    clock, driver = VirtualClock(), LooksAhead()
    t = driver.tracker = Tracker(read_text(ASKS), driver, clock=clock)  # no on_error: the action never raises
    t.begin("gone")
    clock.now = 1.0
    t.poll()
    t.fire("gone", "park")  # leaves a dead entry at the front of serving's deadlines
    t.begin("r")
    clock.now = 2.0
    assert t.poll() == [("r", "warm", "serving")], "the 0 s grace armed by this poll waits for the next one"
    assert t.poll() == [("r", "end", "ended")]
