"""A phase's deadline runs from entering the phase, whatever moves inside it came since: in the oracle, in
``kvfsm test``, in ``kvfsm replay`` and in trace replay.

The spec is the guide's example (``kvfsm/specs/examples/fanin_lease.yaml``): ``held`` counts its readers'
``read`` notifications and takes ``retry`` self-loops, ``throttled`` is a second state of the same ``lease``
phase. A deadline that restarted on each move inside (what a state's own timeout does) would let a flapping
reader hold the blocks forever; every check below holds the expiry to the entry plus ``lease_ttl``.
"""

from __future__ import annotations

import io
import json
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import pytest
from buggy_drivers import BlockPool

import kvfsm
from kvfsm import Tracker
from kvfsm.explore import Step, Trace, TraceRole, check_trace
from kvfsm.replay import JsonlJournal, check_log, codes
from kvfsm.spec.bundled import SPECS
from kvfsm.spec.system import load_system
from kvfsm.testing import VirtualClock, run
from kvfsm.testing.cover import path_cover
from kvfsm.testing.oracle import Expiry, Outcome, SpecModel
from kvfsm.testing.story import poll_line
from kvfsm.testing.trace_replay import TraceRun

FANIN = SPECS / "examples" / "fanin_lease.yaml"
TTL = 480.0


class Blocks:
    """fanin_lease's driver: the blocks begin hands over are held by the request until the spec releases them."""

    def __init__(self) -> None:
        self.pool = BlockPool(64)
        self.blocks: dict[Hashable, list[int]] = {}
        self._next = 0

    def before_begin(self, key: Hashable, resources: frozenset[str]) -> dict[str, Any]:
        self._next = (self._next + 2) % 60
        return {"block_ids": [self._next, self._next + 1]}

    def hold_blocks(self, key: Hashable, /, block_ids: Sequence[int]) -> None:
        self.pool.touch(key, list(block_ids))
        self.blocks[key] = list(block_ids)

    def free_blocks(self, key: Hashable, /) -> None:
        self.pool.free(key, self.blocks.pop(key))

    def observe(self, key: Hashable) -> set[str]:
        return {"kv_blocks"} if self.pool.held_by(key) else set()


class Both:
    """The Tracker and the oracle through the same calls on one clock; each call must agree."""

    def __init__(self, journal: JsonlJournal | None = None) -> None:
        self.spec = kvfsm.load(FANIN)
        self.clock = VirtualClock()
        self.tracker = Tracker(self.spec, Blocks(), clock=self.clock, observer=journal)
        self.model = SpecModel(self.spec)

    def at(self, now: float) -> None:
        self.clock.now = self.model.now = now

    def begin(self, key: str) -> None:
        self.tracker.begin(key, block_ids=[0, 1])
        self.model.begin(key, {"block_ids": [0, 1]})

    def fire(self, key: str, event: str, **payload: Any) -> None:
        got = self.tracker.fire(key, event, **payload)
        assert got == self.model.fire(key, event, payload).state == self.model.state(key)

    def poll(self, now: float) -> Outcome:
        self.at(now)
        got = self.tracker.poll()
        out = self.model.poll()
        assert got == out.fired
        assert self.tracker.next_deadline() == self.model.next_deadline()
        return out


def acks_and_retries(both: Both) -> None:
    """Enter the lease at t=2, then a retry at 100, one reader's read at 200 and its repeat at 300, a retry at
    400: two moves inside the phase, two arrivals that move nothing."""
    both.at(2.0)
    both.begin("r")
    for now, event, payload in (
        (100.0, "retry", {}),
        (200.0, "read", {"sender": "d0", "readers": 2}),
        (300.0, "read", {"sender": "d0", "readers": 2}),  # a repeat: a duplicate, never counted
        (400.0, "retry", {}),
    ):
        both.at(now)
        both.fire("r", event, **payload)


# -- the oracle (and the Tracker beside it) -----------------------------------------------------------------------


def test_the_oracle_expires_the_lease_at_entry_plus_ttl_across_acks_and_self_loops() -> None:
    both = Both()
    acks_and_retries(both)
    assert both.model.next_deadline() == 2.0 + TTL
    assert both.poll(2.0 + TTL - 0.5).fired == []
    out = both.poll(2.0 + TTL)
    assert out.fired == [("r", "expire", "expired")]
    assert out.expired == [Expiry("r", "lease", 2.0, 2)]
    assert out.moves[0].phase == "lease" and out.moves[0].how == "timeout"
    assert both.model.counts["duplicate"] == both.tracker.counts["duplicate"] == 1
    assert "deadline of phase lease, entered at t=2.0, 2 move(s) inside since" in poll_line(TTL, out)


def test_moving_between_the_phases_states_keeps_its_deadline_and_leaving_ends_it() -> None:
    both = Both()
    both.at(2.0)
    both.begin("r")
    both.at(50.0)
    both.fire("r", "throttle")  # held → throttled: inside the lease
    both.at(60.0)
    both.fire("r", "resume")
    assert both.model.next_deadline() == 2.0 + TTL
    both.at(70.0)
    both.fire("r", "read", sender="d0", readers=1)  # the last reader: out of the phase, nothing left armed
    assert both.model.next_deadline() is None and both.tracker.next_deadline() is None
    assert both.poll(10_000.0).fired == []


def test_a_count_that_never_completes_is_no_reason_to_wait_past_the_lease() -> None:
    both = Both()
    both.at(0.0)
    both.begin("r")
    for i, now in enumerate((100.0, 200.0, 300.0, 470.0)):
        both.at(now)
        both.fire("r", "read", sender="d0" if i % 2 else "d1", readers=3)  # two distinct readers of three
    assert both.poll(TTL).fired == [("r", "expire", "expired")]


# -- kvfsm test ----------------------------------------------------------------------------------------------------


def test_kvfsm_test_plans_an_expiry_after_time_in_the_phase_and_moves_inside_it() -> None:
    spec = kvfsm.load(FANIN)
    plans = {p.goal: p.steps for p in path_cover(spec)}
    steps = plans["deadline of phase lease in held (expire)"]
    waits = [args[0] for name, args in steps if name == "advance"]
    assert sum(waits) == TTL and len(waits) == 2, steps  # time passes in the phase before the self-loop
    assert ("fire", ("req-1", "retry", None)) in steps
    assert any(goal.startswith("count of read in held") for goal in plans)
    assert any(goal.startswith("early read naming req-1") for goal in plans)


def test_kvfsm_test_exercises_phase_expiries_and_counts_them() -> None:
    report = run(FANIN, Blocks, seed=0, examples=40)
    assert report.passed, "\n".join(report.story) or report.error
    [(phase, event, fired, moved)] = report.coverage.phase_timeouts()
    assert (phase, event) == ("lease", "expire") and fired > 0 and moved > 0
    assert report.coverage.summary()["timeouts"] == (1, 1)
    assert {"counted", "duplicate", "kept"} <= set(report.coverage.arrivals)
    assert report.coverage.as_dict()["phases"] == [
        {"phase": "lease", "event": "expire", "fired": fired, "after_moves_inside": moved}
    ]


def test_a_phase_never_expired_is_a_gap_named_as_an_exemption_names_it() -> None:
    report = run(FANIN, Blocks, seed=0, examples=1, cover=False, steps=1)
    names = [g.name for g in report.verdict.gaps] if report.verdict is not None else []
    assert "deadline of phase lease" in names


# -- kvfsm replay --------------------------------------------------------------------------------------------------


def journal_of_acks_and_retries() -> list[bytes]:
    """What a JsonlJournal on a Tracker writes for :func:`acks_and_retries` and the expiry that ends it."""
    buffer = io.BytesIO()
    journal = JsonlJournal(buffer, machine="fanin_lease", buffer_bytes=0)
    both = Both(journal)
    acks_and_retries(both)
    both.poll(2.0 + TTL)
    journal.flush()
    return buffer.getvalue().splitlines(keepends=True)


def with_expiry_at(lines: list[bytes], now: float) -> list[bytes]:
    *head, last = lines
    record = json.loads(last)
    assert record["event"] == "expire"
    record["time"] = now
    return [*head, json.dumps(record).encode() + b"\n"]


def test_replay_accepts_an_expiry_at_entry_plus_ttl() -> None:
    lines = journal_of_acks_and_retries()
    assert [json.loads(x).get("event") for x in lines[1:]] == ["begin", "retry", "retry", "expire"]
    report = check_log(FANIN, lines, name="lease.jsonl")
    assert report.conforms, [str(f) for f in report.findings]


def test_replay_reports_an_expiry_measured_from_the_last_self_loop() -> None:
    lines = with_expiry_at(journal_of_acks_and_retries(), 400.0 + TTL)  # the lease restarted by the last retry
    report = check_log(FANIN, lines, name="lease.jsonl")
    [finding] = report.findings
    assert finding.code == codes.OVERRUN and finding.line == len(lines)
    assert "stayed in phase 'lease' (held, throttled) from t=2.000 (line 2)" in finding.message
    assert "398.000s past its deadline (lease_ttl=480s)" in finding.message
    assert "measured from entering the phase" in finding.message


def test_replay_reports_an_instance_still_in_the_phase_past_its_deadline_at_the_end() -> None:
    lines = journal_of_acks_and_retries()[:-1]
    late = json.loads(lines[-1]) | {"event": "retry", "from": "held", "to": "held", "time": 600.0}
    report = check_log(FANIN, [*lines, json.dumps(late).encode() + b"\n"], allow_live=True)
    assert [f.code for f in report.findings] == [codes.OVERRUN, codes.OVERRUN]  # the late retry, then the end
    assert "is still in it at the end of the log (t=600.000)" in report.findings[1].message


# -- trace replay ------------------------------------------------------------------------------------------------

HOLDER = """\
kvfsm: 1
machine: holder
key: request_id
params: {lease_ttl: 10.0, retry_after: 1.0}
resources:
  blocks: {release: free_blocks}
phases:
  lease: {states: [serving, retrying], timeout: {after: lease_ttl, fire: expire}}
states:
  serving:  {initial: true, holds: [blocks]}
  retrying: {holds: [blocks], timeout: {after: retry_after, fire: retry}}
  done:     {final: success}
  expired:  {final: failure}
  aborted:  {final: failure}
transitions:
  - {event: nack,   from: [serving, retrying], to: retrying}
  - {event: retry,  from: retrying, to: serving}
  - {event: read,   from: [serving, retrying], to: done}
  - {event: expire, from: [serving, retrying], to: expired}
  - {event: abort,  from: "*", to: aborted}
ignore:
  - {event: [read, expire, abort], in: [done, expired, aborted]}
"""

READER = """\
kvfsm: 1
machine: reader
key: request_id
states:
  reading: {initial: true, waits: local}
  done:    {final: success}
  aborted: {final: failure}
transitions:
  - {event: finish, from: reading, to: done, send: {to: holder, message: read}}
  - {event: abort,  from: "*", to: aborted}
"""

SYSTEM = """\
kvfsm: 1
system: lease_pair
roles:
  holder: {spec: holder.yaml}
  reader: {spec: reader.yaml}
messages:
  read: {from: reader, to: holder}
channel: {loss: false, duplicate: false, reorder: false, capacity: 1}
requests: 1
properties:
  never: []
"""


@pytest.fixture
def lease_pair(tmp_path: Path) -> Path:
    (tmp_path / "holder.yaml").write_text(HOLDER)
    (tmp_path / "reader.yaml").write_text(READER)
    system = tmp_path / "system.yaml"
    system.write_text(SYSTEM)
    return system


def test_trace_replay_polls_a_phase_deadline_at_its_entry_plus_ttl(lease_pair: Path) -> None:
    """Retries move the clock (each ``retry`` is retrying's own deadline) and re-enter ``serving`` inside the
    lease: its deadline stays at t=10, so the poll there fires it."""
    system = load_system(lease_pair)
    spec = system.roles["holder"].spec
    reader = system.roles["reader"].spec

    def fire(cause: str, event: str, source: str, target: str) -> Step:
        return Step("r0", "holder", "fire", cause, event, source, target, holds=spec.states[target].holds)

    steps = (
        Step("r0", "holder", "begin", "begin", None, None, "serving", holds=spec.initial.holds),
        Step("r0", "reader", "begin", "begin", None, None, "reading", holds=reader.initial.holds),
        fire("local", "nack", "serving", "retrying"),
        fire("timeout", "retry", "retrying", "serving"),  # t=1
        fire("local", "nack", "serving", "retrying"),
        fire("local", "nack", "retrying", "retrying"),  # a self-loop: retrying's own deadline again, the lease not
        fire("timeout", "retry", "retrying", "serving"),  # t=2
        fire("timeout", "expire", "serving", "expired"),  # t=10: the lease, from begin
    )
    roles = tuple(TraceRole(n, r.path, r.spec.name, r.spec.key) for n, r in system.roles.items())
    trace = Trace(system.name, system.path, system.names[0], "", "r0", roles, steps)
    check_trace(trace, system)
    replay = TraceRun(system, trace)
    done = list(replay)
    assert [d.mismatch for d in done] == [None] * len(steps)
    assert [d.call for d in done if d.step.cause == "timeout"] == ["poll at t=1", "poll at t=2", "poll at t=10"]
    assert replay.trackers["holder"].state("r0") == "expired"


def test_trace_replay_fires_a_phase_event_directly_when_another_deadline_falls_due_first(lease_pair: Path) -> None:
    system = load_system(lease_pair)
    spec = system.roles["holder"].spec
    steps = (
        Step("r0", "holder", "begin", "begin", None, None, "serving", holds=spec.initial.holds),
        Step("r0", "reader", "begin", "begin", None, None, "reading"),
        Step("r0", "holder", "fire", "local", "nack", "serving", "retrying", holds=("blocks",)),
        Step("r0", "holder", "fire", "timeout", "expire", "retrying", "expired"),  # retry (t=1) comes before t=10
    )
    roles = tuple(TraceRole(n, r.path, r.spec.name, r.spec.key) for n, r in system.roles.items())
    trace = Trace(system.name, system.path, system.names[0], "", "r0", roles, steps)
    check_trace(trace, system)
    done = list(TraceRun(system, trace))
    assert done[-1].mismatch is None
    assert done[-1].call == "fire (r0's own deadline would fall due first)"


def test_the_trace_set_walks_phase_deadlines_as_timeouts_and_replays_them(lease_pair: Path) -> None:
    from kvfsm.testing.trace_set import cover_system

    result = cover_system(lease_pair)
    assert result.passed, result.summary()
    timeouts = {(s.role, s.event) for r in result.runs for s in r.trace.moves if s.cause == "timeout"}
    assert ("holder", "expire") in timeouts
