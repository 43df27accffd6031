"""The compiled Tracker against DESIGN.md's semantics, checked on a driver that really holds things.

The driver below owns two block pools with reference counts, a bounded queue
and a set of peer leases; ``observe(key)`` reads those, so every assertion about
"released" or "held" is about the driver's real state, not a log of calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfsm
from kvfsm import (
    ActionError,
    Anomaly,
    BindingError,
    DuplicateKey,
    IllegalTransition,
    KvfsmError,
    Tracker,
    TrackerClosed,
)
from kvfsm.spec import read_text
from kvfsm.testing import VirtualClock
from kvfsm.testing.strategies import specs

SPEC_TEXT = """
kvfsm: 1
machine: pooled_send
key: request_id
params:
  transfer_timeout: 5.0
  retry_timeout: 2.0
resources:
  gpu_blocks: {acquire: alloc_gpu_blocks, release: free_gpu_blocks}
  host_buf:   {acquire: alloc_host_buf,   release: free_host_buf}
  queue_slot: {acquire: take_slot,        release: give_slot}
  lease:      {acquire: take_lease,       release: drop_lease}
states:
  pinned:       {initial: true, holds: [gpu_blocks, host_buf], waits: local}
  queued:       {holds: [gpu_blocks, queue_slot, lease], waits: local}
  transferring: {holds: [gpu_blocks, queue_slot, lease], timeout: {after: transfer_timeout, fire: expire}}
  retrying:     {holds: [gpu_blocks], timeout: {after: retry_timeout, fire: give_up}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: enqueue,  from: pinned,       to: queued}
  - {event: start,    from: queued,       to: transferring, do: start_transfer}
  - {event: complete, from: transferring, to: done,         do: finish_transfer}
  - {event: expire,   from: transferring, to: retrying,     payload: [peer]}
  - {event: retry,    from: retrying,     to: transferring, do: reconnect, payload: [peer]}
  - {event: give_up,  from: retrying,     to: expired}
  - {event: fail,     from: [pinned, queued, transferring, retrying], to: failed}
  - {event: abort,    from: "*",          to: aborted}
ignore:
  - {event: [abort, complete, fail, expire, give_up], in: [done, failed, aborted, expired]}
on_error: fail
begin: {payload: [blocks]}
"""

SPEC = kvfsm.parse(SPEC_TEXT, "pooled_send.yaml")

# The on_error transition runs an action of its own. KVF109 rejects such a spec,
# but a Tracker runs any well-formed Spec and must still end in a defined state.
ERROR_DO_SPEC = read_text(
    SPEC_TEXT.replace("to: failed}", "to: failed, do: note_failure}"), "pooled_send_error_do.yaml"
)

# abort does not finish here: it leads to a live state that waits for the peer.
ABORTING_SPEC = read_text(
    """
kvfsm: 1
machine: drain_on_abort
key: request_id
resources:
  gpu_blocks: {acquire: alloc_gpu_blocks, release: free_gpu_blocks}
states:
  live:     {initial: true, holds: [gpu_blocks], waits: local}
  aborting: {holds: [gpu_blocks], timeout: {after: 1.0, fire: drained}}
  done:     {final: success}
  aborted:  {final: failure}
transitions:
  - {event: finish,  from: live,     to: done}
  - {event: abort,   from: "*",      to: aborting}
  - {event: drained, from: aborting, to: aborted}
ignore:
  - {event: [abort], in: [done, aborted]}
""",
    "drain_on_abort.yaml",
)

CANONICAL = Path(__file__).resolve().parents[1] / "specs" / "kv_request.yaml"


def test_test_specs_are_clean() -> None:
    """The specs below must pass the static checks, or a failure here would be the spec's fault."""
    errors = [f for spec in (SPEC, ABORTING_SPEC) for f in kvfsm.spec.run_checks(spec) if f.severity == "error"]
    assert errors == []


# -- a driver that really holds resources ------------------------------------------


class DoubleRelease(AssertionError):
    """The tracker released something the driver did not hold (a bug in the tracker)."""


class BlockPool:
    """Fixed-size pool; invariant: ref_cnt[b] == 0 ⇔ b is in the free queue."""

    def __init__(self, size: int) -> None:
        self.ref_cnt = [0] * size
        self.free: deque[int] = deque(range(size))
        self.owned: dict[Hashable, list[int]] = {}

    def alloc(self, owner: Hashable, n: int) -> None:
        if owner in self.owned:
            raise AssertionError(f"{owner!r} allocated twice without a free")
        if n > len(self.free):
            raise MemoryError(f"pool exhausted: {n} wanted, {len(self.free)} free")
        blocks = [self.free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_cnt[b] += 1
        self.owned[owner] = blocks

    def release(self, owner: Hashable) -> None:
        blocks = self.owned.pop(owner, None)
        if blocks is None:
            raise DoubleRelease(f"{owner!r} freed blocks it does not own")
        for b in blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free.append(b)

    def in_use(self) -> int:
        return sum(1 for c in self.ref_cnt if c)


@dataclass
class Call:
    action: str
    key: Hashable
    payload: dict[str, Any]
    state_seen: str | None
    """tracker.state(key) at the moment the action ran."""


@dataclass
class PoolDriver:
    """GPU and host block pools, a bounded transfer queue and peer leases."""

    queue_cap: int = 64
    gpu: BlockPool = field(default_factory=lambda: BlockPool(256))
    host: BlockPool = field(default_factory=lambda: BlockPool(256))
    queue: set[Hashable] = field(default_factory=set)
    leases: set[Hashable] = field(default_factory=set)
    calls: list[Call] = field(default_factory=list)
    faults: dict[str, BaseException] = field(default_factory=dict)
    hooks: dict[str, Callable[[Hashable], None]] = field(default_factory=dict)
    tracker: Tracker | None = None

    def _enter(self, action: str, key: Hashable, payload: dict[str, Any]) -> None:
        seen = self.tracker.state(key) if self.tracker is not None else None
        self.calls.append(Call(action, key, dict(payload), seen))
        hook = self.hooks.get(action)
        if hook is not None:
            hook(key)
        fault = self.faults.get(action)
        if fault is not None:
            raise fault

    # resources
    def alloc_gpu_blocks(self, key: Hashable, **p: Any) -> None:
        self._enter("alloc_gpu_blocks", key, p)
        self.gpu.alloc(key, int(p.get("blocks", 2)))

    def free_gpu_blocks(self, key: Hashable, **p: Any) -> None:
        self._enter("free_gpu_blocks", key, p)
        self.gpu.release(key)

    def alloc_host_buf(self, key: Hashable, **p: Any) -> None:
        self._enter("alloc_host_buf", key, p)
        self.host.alloc(key, 1)

    def free_host_buf(self, key: Hashable, **p: Any) -> None:
        self._enter("free_host_buf", key, p)
        self.host.release(key)

    def take_slot(self, key: Hashable, **p: Any) -> None:
        self._enter("take_slot", key, p)
        if key in self.queue:
            raise AssertionError(f"{key!r} queued twice")
        if len(self.queue) >= self.queue_cap:
            raise OverflowError("transfer queue full")
        self.queue.add(key)

    def give_slot(self, key: Hashable, **p: Any) -> None:
        self._enter("give_slot", key, p)
        if key not in self.queue:
            raise DoubleRelease(f"{key!r} gave back a queue slot it does not hold")
        self.queue.remove(key)

    def take_lease(self, key: Hashable, **p: Any) -> None:
        self._enter("take_lease", key, p)
        if key in self.leases:
            raise AssertionError(f"{key!r} leased twice")
        self.leases.add(key)

    def drop_lease(self, key: Hashable, **p: Any) -> None:
        self._enter("drop_lease", key, p)
        if key not in self.leases:
            raise DoubleRelease(f"{key!r} dropped a lease it does not hold")
        self.leases.remove(key)

    # do actions
    def start_transfer(self, key: Hashable, **p: Any) -> None:
        self._enter("start_transfer", key, p)

    def finish_transfer(self, key: Hashable, **p: Any) -> None:
        self._enter("finish_transfer", key, p)

    def reconnect(self, key: Hashable, **p: Any) -> None:
        self._enter("reconnect", key, p)

    def note_failure(self, key: Hashable, **p: Any) -> None:
        self._enter("note_failure", key, p)

    # reading reality
    def observe(self, key: Hashable) -> set[str]:
        held = set()
        if key in self.gpu.owned:
            held.add("gpu_blocks")
        if key in self.host.owned:
            held.add("host_buf")
        if key in self.queue:
            held.add("queue_slot")
        if key in self.leases:
            held.add("lease")
        return held

    def totals(self) -> dict[str, int]:
        return {
            "gpu_blocks": self.gpu.in_use(),
            "host_buf": self.host.in_use(),
            "queue_slot": len(self.queue),
            "lease": len(self.leases),
        }

    def names(self) -> list[str]:
        return [c.action for c in self.calls]


NOTHING_HELD = {"gpu_blocks": 0, "host_buf": 0, "queue_slot": 0, "lease": 0}
ACQUIRES = {"alloc_gpu_blocks", "alloc_host_buf", "take_slot", "take_lease"}
RELEASES = {"free_gpu_blocks", "free_host_buf", "give_slot", "drop_lease"}


Seen = tuple[Hashable, int, str, str, str, float]


@dataclass
class Rig:
    tracker: Tracker
    driver: PoolDriver
    clock: VirtualClock
    seen: list[Seen]

    def transitions(self) -> list[tuple[str, str, str]]:
        """(event, from, to) of every observed transition that is not a begin."""
        return [(e, s, t) for (_k, _g, e, s, t, _time) in self.seen if e != "begin"]


def make_rig(spec: kvfsm.Spec = SPEC, *, params: dict[str, float] | None = None, spaces: tuple[str, ...] = ()) -> Rig:
    driver = PoolDriver()
    clock = VirtualClock()
    seen: list[Seen] = []

    def observer(key: Hashable, gen: int, event: str, src: str, dst: str, when: float) -> None:
        seen.append((key, gen, event, src, dst, when))

    tracker = Tracker(spec, driver, clock=clock, params=params, spaces=spaces, observer=observer)
    driver.tracker = tracker
    return Rig(tracker, driver, clock, seen)


@pytest.fixture
def rig() -> Rig:
    return make_rig()


def walk(rig: Rig, key: Hashable, *events: str) -> None:
    rig.tracker.begin(key)
    for event in events:
        rig.tracker.fire(key, event)


PATHS: dict[str, tuple[str, ...]] = {
    "pinned": (),
    "queued": ("enqueue",),
    "transferring": ("enqueue", "start"),
    "retrying": ("enqueue", "start", "expire"),
    "done": ("enqueue", "start", "complete"),
}


def walk_to(rig: Rig, key: Hashable, state: str) -> None:
    walk(rig, key, *PATHS[state])
    assert rig.tracker.state(key) == state


# -- begin ---------------------------------------------------------------------------


def test_begin_runs_the_initial_states_acquire_actions(rig: Rig) -> None:
    rig.tracker.begin("r1")
    assert rig.driver.observe("r1") == {"gpu_blocks", "host_buf"}


def test_begin_enters_the_initial_state_holding_what_it_declares(rig: Rig) -> None:
    rig.tracker.begin("r1")
    assert rig.tracker.state("r1") == "pinned"
    assert set(rig.tracker.held("r1")) == {"gpu_blocks", "host_buf"}


def test_begin_passes_its_payload_to_acquire_actions(rig: Rig) -> None:
    rig.tracker.begin("r1", blocks=5)
    assert len(rig.driver.gpu.owned["r1"]) == 5


def test_a_begun_instance_has_an_int_generation(rig: Rig) -> None:
    rig.tracker.begin("r1")
    assert isinstance(rig.tracker.generation("r1"), int)


def test_an_unknown_key_has_no_generation(rig: Rig) -> None:
    assert rig.tracker.generation("nobody") is None


def test_begin_on_a_live_key_raises_duplicate_key(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    with pytest.raises(DuplicateKey):
        rig.tracker.begin("r1")


def test_begin_on_a_live_key_changes_neither_state_nor_driver(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    calls, totals = len(rig.driver.calls), rig.driver.totals()
    with pytest.raises(DuplicateKey):
        rig.tracker.begin("r1")
    assert (rig.tracker.state("r1"), len(rig.driver.calls), rig.driver.totals()) == ("queued", calls, totals)


def test_begin_on_a_finished_key_starts_a_new_generation(rig: Rig) -> None:
    rig.tracker.begin("r1")
    first = rig.tracker.generation("r1")
    rig.tracker.fire("r1", "abort")
    rig.tracker.begin("r1")
    second = rig.tracker.generation("r1")
    assert second != first
    assert rig.tracker.state("r1") == "pinned"
    assert rig.driver.observe("r1") == {"gpu_blocks", "host_buf"}


def test_key_reused_after_its_instance_was_drained_starts_a_new_generation(rig: Rig) -> None:
    rig.tracker.begin("r1")
    first = rig.tracker.generation("r1")
    rig.tracker.fire("r1", "abort")
    rig.tracker.finished()
    rig.tracker.begin("r1")
    second = rig.tracker.generation("r1")
    assert second != first, "two instances of one key must not share a generation (observer logs, replay)"


def test_finished_still_reports_an_earlier_generation_after_its_key_was_reused(rig: Rig) -> None:
    walk(rig, "r1", "abort")
    rig.tracker.begin("r1")
    assert rig.tracker.finished() == [("r1", "aborted")]
    assert rig.tracker.state("r1") == "pinned", "draining the old generation must not retire the new one"


def test_begin_whose_second_acquire_raises_undoes_the_first(rig: Rig) -> None:
    rig.driver.faults["alloc_host_buf"] = RuntimeError("host pool down")
    with pytest.raises(ActionError):
        rig.tracker.begin("r1")
    assert "alloc_gpu_blocks" in rig.driver.names()
    assert rig.driver.totals() == NOTHING_HELD


def test_failed_begin_creates_no_instance(rig: Rig) -> None:
    rig.driver.faults["alloc_host_buf"] = RuntimeError("host pool down")
    with pytest.raises(ActionError):
        rig.tracker.begin("r1")
    assert rig.tracker.state("r1") is None
    assert rig.tracker.live() == 0
    assert not any(rig.tracker.census().values())


def test_failed_begin_reports_the_acquire_that_raised(rig: Rig) -> None:
    boom = RuntimeError("host pool down")
    rig.driver.faults["alloc_host_buf"] = boom
    with pytest.raises(ActionError) as caught:
        rig.tracker.begin("r1")
    [failure] = caught.value.failures
    assert (failure.key, failure.action, failure.phase, failure.error) == ("r1", "alloc_host_buf", "acquire", boom)


def test_key_can_be_begun_after_a_failed_begin(rig: Rig) -> None:
    rig.driver.faults["alloc_host_buf"] = RuntimeError("host pool down")
    with pytest.raises(ActionError):
        rig.tracker.begin("r1")
    del rig.driver.faults["alloc_host_buf"]
    rig.tracker.begin("r1")
    assert rig.driver.observe("r1") == {"gpu_blocks", "host_buf"}


class _Quiet:
    """Every action of any spec, doing nothing: what is left to compare is the engine's own bookkeeping."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("__"):
            raise AttributeError(name)
        return _nothing


def _nothing(key: Hashable, /, **payload: Any) -> None:
    return None


@settings(max_examples=60, deadline=None)
@given(spec=specs(max_states=4, max_resources=2, max_events=3), data=st.data())
def test_a_plain_begin_leaves_what_a_begin_through_the_general_path_leaves(
    spec: kvfsm.Spec, data: st.DataObject
) -> None:
    """Begin has a fast path (nothing runs that could call back) beside the general one; a journal (an observer)
    sends every begin the general way, so the two trackers must agree on states, deadlines and what poll fires."""
    clocks = VirtualClock(), VirtualClock()
    plain = Tracker(spec, _Quiet(), clock=clocks[0])
    general = Tracker(spec, _Quiet(), clock=clocks[1], observer=lambda *line: None)
    keys = data.draw(st.lists(st.sampled_from(("a", "b", "c")), min_size=1, max_size=4), label="keys")
    for key in keys:
        results: list[type[KvfsmError] | None] = []
        for tracker, clock in zip((plain, general), clocks, strict=True):
            clock.advance(0.25)
            try:
                tracker.begin(key)
                results.append(None)
            except KvfsmError as exc:
                results.append(type(exc))
        assert results[0] == results[1]
        assert [plain.entered(k) for k in keys] == [general.entered(k) for k in keys]
        assert plain.next_deadline() == general.next_deadline()
        assert plain.census() == general.census()
    for clock in clocks:
        clock.advance(1_000.0)
    fired = [sorted(map(str, tracker.poll())) for tracker in (plain, general)]
    assert fired[0] == fired[1]
    assert sorted(plain.finished()) == sorted(general.finished())


# -- derived releases and acquires ---------------------------------------------------

DERIVED = [
    # source, event, acquire actions, release actions (holds(T)-holds(S), holds(S)-holds(T))
    ("pinned", "enqueue", {"take_slot", "take_lease"}, {"free_host_buf"}),
    ("queued", "start", set(), set()),
    ("transferring", "expire", set(), {"give_slot", "drop_lease"}),
    ("retrying", "retry", {"take_slot", "take_lease"}, set()),
    ("transferring", "complete", set(), {"free_gpu_blocks", "give_slot", "drop_lease"}),
    ("pinned", "abort", set(), {"free_gpu_blocks", "free_host_buf"}),
    ("retrying", "give_up", set(), {"free_gpu_blocks"}),
]


@pytest.mark.parametrize(("source", "event", "acquires", "releases"), DERIVED)
def test_transition_acquires_exactly_holds_target_minus_holds_source(
    rig: Rig, source: str, event: str, acquires: set[str], releases: set[str]
) -> None:
    walk_to(rig, "r1", source)
    before = len(rig.driver.calls)
    rig.tracker.fire("r1", event)
    ran = [c.action for c in rig.driver.calls[before:] if c.action in ACQUIRES]
    assert sorted(ran) == sorted(acquires)


@pytest.mark.parametrize(("source", "event", "acquires", "releases"), DERIVED)
def test_transition_releases_exactly_holds_source_minus_holds_target(
    rig: Rig, source: str, event: str, acquires: set[str], releases: set[str]
) -> None:
    walk_to(rig, "r1", source)
    before = len(rig.driver.calls)
    rig.tracker.fire("r1", event)
    ran = [c.action for c in rig.driver.calls[before:] if c.action in RELEASES]
    assert sorted(ran) == sorted(releases)


def test_driver_really_holds_what_held_reports_after_every_step(rig: Rig) -> None:
    rig.tracker.begin("r1")
    assert rig.driver.observe("r1") == set(rig.tracker.held("r1"))
    for event in ("enqueue", "start", "expire", "retry", "complete"):
        rig.tracker.fire("r1", event)
        assert rig.driver.observe("r1") == set(rig.tracker.held("r1")), event
    assert rig.driver.totals() == NOTHING_HELD


def test_fire_returns_the_new_states_name(rig: Rig) -> None:
    rig.tracker.begin("r1")
    assert rig.tracker.fire("r1", "enqueue") == "queued"


def test_do_runs_before_the_acquires(rig: Rig) -> None:
    walk_to(rig, "r1", "retrying")
    before = len(rig.driver.calls)
    rig.tracker.fire("r1", "retry")
    assert [c.action for c in rig.driver.calls[before:]] == ["reconnect", "take_slot", "take_lease"]


def test_do_and_acquires_run_before_the_state_changes(rig: Rig) -> None:
    walk_to(rig, "r1", "retrying")
    before = len(rig.driver.calls)
    rig.tracker.fire("r1", "retry")
    assert {c.state_seen for c in rig.driver.calls[before:]} == {"retrying"}


def test_release_actions_run_after_the_state_changed(rig: Rig) -> None:
    walk_to(rig, "r1", "transferring")
    before = len(rig.driver.calls)
    rig.tracker.fire("r1", "complete")
    seen = {c.state_seen for c in rig.driver.calls[before:] if c.action in RELEASES}
    assert seen == {"done"}


def test_do_and_acquire_actions_receive_the_events_payload_and_releases_the_key_alone(rig: Rig) -> None:
    walk_to(rig, "r1", "retrying")
    before = len(rig.driver.calls)
    rig.tracker.fire("r1", "retry", peer="decode-3")
    rig.tracker.fire("r1", "expire", peer="decode-4")
    payloads = {(c.action, tuple(c.payload.items())) for c in rig.driver.calls[before:]}
    assert payloads == {
        ("reconnect", (("peer", "decode-3"),)),
        ("take_slot", (("peer", "decode-3"),)),
        ("take_lease", (("peer", "decode-3"),)),
        ("give_slot", ()),
        ("drop_lease", ()),
    }


# -- raising actions ---------------------------------------------------------------


def test_raising_do_leaves_its_edge_untaken_and_fires_on_error_from_the_source(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    rig.driver.faults["start_transfer"] = RuntimeError("peer refused")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "start")
    assert rig.tracker.state("r1") == "failed"
    assert rig.transitions()[-1] == ("fail", "queued", "failed")
    assert ("start", "queued", "transferring") not in rig.transitions()


def test_raising_do_releases_what_the_on_error_path_releases(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    rig.driver.faults["start_transfer"] = RuntimeError("peer refused")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "start")
    assert rig.driver.totals() == NOTHING_HELD


def test_raising_do_reports_the_action_and_the_state_it_ended_in(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    boom = RuntimeError("peer refused")
    rig.driver.faults["start_transfer"] = boom
    with pytest.raises(ActionError) as caught:
        rig.tracker.fire("r1", "start")
    [failure] = caught.value.failures
    assert (failure.key, failure.event, failure.action, failure.phase) == ("r1", "start", "start_transfer", "do")
    assert failure.error is boom
    assert failure.state == "failed"


def test_raising_do_arms_no_deadline_of_the_untaken_target(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    rig.driver.faults["start_transfer"] = RuntimeError("peer refused")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "start")
    assert rig.tracker.poll(now=1e9) == []


def test_instance_ended_by_on_error_is_reported_finished(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    rig.driver.faults["start_transfer"] = RuntimeError("peer refused")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "start")
    assert rig.tracker.finished() == [("r1", "failed")]


def test_raising_acquire_undoes_the_acquires_already_done_in_that_step(rig: Rig) -> None:
    rig.tracker.begin("r1")
    rig.driver.faults["take_lease"] = RuntimeError("peer has no lease to give")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "enqueue")
    names = rig.driver.names()
    assert "take_slot" in names, "acquires run in holds order: the slot is taken before the lease"
    assert "give_slot" in names[names.index("take_slot") :]
    assert rig.driver.queue == set()


def test_raising_acquire_fires_on_error_from_the_source(rig: Rig) -> None:
    rig.tracker.begin("r1")
    rig.driver.faults["take_lease"] = RuntimeError("peer has no lease to give")
    with pytest.raises(ActionError) as caught:
        rig.tracker.fire("r1", "enqueue")
    assert rig.transitions() == [("fail", "pinned", "failed")]
    assert rig.driver.totals() == NOTHING_HELD
    [failure] = caught.value.failures
    assert (failure.action, failure.phase, failure.state) == ("take_lease", "acquire", "failed")


def test_one_callable_as_do_and_acquire_is_blamed_for_the_call_that_raised() -> None:
    """The step tells which of its actions raised by identity: one object bound twice is made two."""
    spec = kvfsm.parse(
        """
kvfsm: 1
machine: twice
key: id
resources:
  slot: {acquire: grab, release: drop}
states:
  a: {initial: true, waits: local}
  b: {holds: [slot], waits: local}
  failed: {final: failure}
transitions:
  - {event: go, from: a, to: b, do: grab}
  - {event: fail, from: [a, b], to: failed}
  - {event: abort, from: [a, b], to: failed}
ignore:
  - {event: [fail, abort], in: [failed]}
on_error: fail
""",
        "twice.yaml",
    )
    calls: list[str] = []

    def grab(key: Hashable) -> None:  # one function object: every lookup on the driver returns it
        calls.append("grab")
        if len(calls) == 2:
            raise RuntimeError("no slot")

    class Driver:
        def __init__(self) -> None:
            self.grab = grab
            self.drop = lambda key: calls.append("drop")

    tracker = Tracker(spec, Driver())
    tracker.begin("r1")
    with pytest.raises(ActionError) as caught:
        tracker.fire("r1", "go")
    [failure] = caught.value.failures
    assert (failure.action, failure.phase) == ("grab", "acquire"), "the second call, the acquire, raised"
    assert calls == ["grab", "grab"], "the do ran; the acquire raised, so nothing is held and nothing to drop"
    assert tracker.state("r1") == "failed"


def test_raising_release_does_not_skip_the_other_releases(rig: Rig) -> None:
    walk_to(rig, "r1", "transferring")
    rig.driver.faults["free_gpu_blocks"] = RuntimeError("driver lost the block table")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "complete")
    assert rig.driver.observe("r1") == {"gpu_blocks"}, "only the raising release may leave something held"


def test_raising_releases_are_aggregated_in_one_action_error(rig: Rig) -> None:
    walk_to(rig, "r1", "transferring")
    rig.driver.faults["free_gpu_blocks"] = RuntimeError("block table")
    rig.driver.faults["drop_lease"] = RuntimeError("lease server")
    with pytest.raises(ActionError) as caught:
        rig.tracker.fire("r1", "complete")
    failures = caught.value.failures
    assert sorted((f.action, f.phase, f.state) for f in failures) == [
        ("drop_lease", "release", "done"),
        ("free_gpu_blocks", "release", "done"),
    ]


def test_raising_release_does_not_undo_the_transition(rig: Rig) -> None:
    walk_to(rig, "r1", "transferring")
    rig.driver.faults["give_slot"] = RuntimeError("queue gone")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "complete")
    assert rig.tracker.state("r1") == "done"
    assert rig.tracker.finished() == [("r1", "done")]


def test_on_error_transition_whose_own_action_raises_is_still_taken() -> None:
    rig = make_rig(ERROR_DO_SPEC)
    walk_to(rig, "r1", "queued")
    rig.driver.faults["start_transfer"] = RuntimeError("peer refused")
    rig.driver.faults["note_failure"] = RuntimeError("metrics down")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "start")
    assert rig.tracker.state("r1") == "failed"
    assert rig.driver.totals() == NOTHING_HELD


def test_error_in_the_on_error_action_is_reported_with_the_original() -> None:
    rig = make_rig(ERROR_DO_SPEC)
    walk_to(rig, "r1", "queued")
    rig.driver.faults["start_transfer"] = RuntimeError("peer refused")
    rig.driver.faults["note_failure"] = RuntimeError("metrics down")
    with pytest.raises(ActionError) as caught:
        rig.tracker.fire("r1", "start")
    assert sorted(f.action for f in caught.value.failures) == ["note_failure", "start_transfer"]
    assert {f.state for f in caught.value.failures} == {"failed"}


def test_on_error_event_fired_directly_is_taken_even_if_its_action_raises() -> None:
    rig = make_rig(ERROR_DO_SPEC)
    walk_to(rig, "r1", "transferring")
    rig.driver.faults["note_failure"] = RuntimeError("metrics down")
    with pytest.raises(ActionError):
        rig.tracker.fire("r1", "fail")
    assert rig.tracker.state("r1") == "failed"
    assert rig.driver.totals() == NOTHING_HELD


# -- illegal and ignored events -----------------------------------------------------


def test_illegal_event_raises_and_leaves_state_and_driver_untouched(rig: Rig) -> None:
    walk_to(rig, "r1", "pinned")
    calls, seen = len(rig.driver.calls), len(rig.seen)
    with pytest.raises(IllegalTransition):
        rig.tracker.fire("r1", "complete")
    assert rig.tracker.state("r1") == "pinned"
    assert (len(rig.driver.calls), len(rig.seen)) == (calls, seen)
    assert rig.driver.observe("r1") == {"gpu_blocks", "host_buf"}


def test_illegal_transition_names_the_events_the_state_accepts(rig: Rig) -> None:
    walk_to(rig, "r1", "pinned")
    with pytest.raises(IllegalTransition) as caught:
        rig.tracker.fire("r1", "complete")
    assert set(caught.value.accepted) == {"enqueue", "fail", "abort"}
    for event in ("enqueue", "fail", "abort"):
        assert event in str(caught.value)


def test_undeclared_event_name_is_an_illegal_transition(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    with pytest.raises(IllegalTransition):
        rig.tracker.fire("r1", "teleport")
    assert rig.tracker.state("r1") == "queued"


def test_ignored_event_runs_nothing_and_returns_the_state(rig: Rig) -> None:
    walk(rig, "r1", "abort")
    calls, seen = len(rig.driver.calls), len(rig.seen)
    assert rig.tracker.fire("r1", "complete") == "aborted"
    assert (len(rig.driver.calls), len(rig.seen)) == (calls, seen)


def test_ignored_event_does_not_finish_an_instance_twice(rig: Rig) -> None:
    walk(rig, "r1", "abort")
    rig.tracker.fire("r1", "abort")
    assert rig.tracker.finished() == [("r1", "aborted")]


# -- unknown keys, stale generations, id spaces --------------------------------------


def test_event_for_an_unknown_key_is_counted_not_raised(rig: Rig) -> None:
    assert rig.tracker.fire("ghost", "abort") is None
    assert rig.tracker.counts["unknown"] == 1


def test_event_for_an_unknown_key_is_reported_once_by_anomalies(rig: Rig) -> None:
    rig.tracker.fire("ghost", "abort")
    assert rig.tracker.anomalies() == [Anomaly("unknown", "request_id", "ghost", "abort")]
    assert rig.tracker.anomalies() == []


def test_linked_id_of_an_earlier_generation_is_stale_and_not_applied() -> None:
    rig = make_rig(spaces=("transfer_id",))
    rig.tracker.begin("r1")
    rig.tracker.link("r1", "transfer_id", "t-1")
    rig.tracker.fire("r1", "abort")
    rig.tracker.begin("r1")  # reuse before the old one is drained
    assert rig.tracker.fire_by("transfer_id", "t-1", "enqueue") is None
    assert rig.tracker.state("r1") == "pinned"
    assert rig.tracker.counts["stale"] == 1
    assert rig.tracker.anomalies() == [Anomaly("stale", "transfer_id", "t-1", "enqueue")]


def test_linked_id_of_a_drained_and_reused_key_is_reported_not_applied() -> None:
    rig = make_rig(spaces=("transfer_id",))
    rig.tracker.begin("r1")
    rig.tracker.link("r1", "transfer_id", "t-1")
    rig.tracker.fire("r1", "abort")
    rig.tracker.finished()
    rig.tracker.begin("r1")
    assert rig.tracker.fire_by("transfer_id", "t-1", "enqueue") is None
    assert rig.tracker.state("r1") == "pinned"
    [anomaly] = rig.tracker.anomalies()
    assert (anomaly.kind, anomaly.space, anomaly.id) == ("late", "transfer_id", "t-1")


def test_fire_by_routes_a_linked_id_to_its_instance() -> None:
    rig = make_rig(spaces=("transfer_id",))
    rig.tracker.begin("r1")
    rig.tracker.begin("r2")
    rig.tracker.link("r2", "transfer_id", "t-9")
    assert rig.tracker.fire_by("transfer_id", "t-9", "enqueue") == "queued"
    assert (rig.tracker.state("r1"), rig.tracker.state("r2")) == ("pinned", "queued")


def test_fire_by_in_the_key_space_routes_directly_by_key() -> None:
    rig = make_rig(spaces=("transfer_id",))
    rig.tracker.begin("r1")
    assert rig.tracker.fire_by("request_id", "r1", "enqueue") == "queued"


def test_route_names_the_key_behind_a_linked_id() -> None:
    rig = make_rig(spaces=("transfer_id",))
    rig.tracker.begin("r1")
    rig.tracker.link("r1", "transfer_id", "t-1")
    assert rig.tracker.route("transfer_id", "t-1") == "r1"
    assert rig.tracker.route("transfer_id", "t-2") is None


def test_fire_by_an_undeclared_space_is_a_clear_error() -> None:
    rig = make_rig(spaces=("transfer_id",))
    rig.tracker.begin("r1")
    with pytest.raises(KvfsmError, match="room"):
        rig.tracker.fire_by("room", "r1", "enqueue")
    assert rig.tracker.state("r1") == "pinned"


def test_link_in_an_undeclared_space_is_a_clear_error() -> None:
    rig = make_rig(spaces=("transfer_id",))
    rig.tracker.begin("r1")
    with pytest.raises(KvfsmError, match="room"):
        rig.tracker.link("r1", "room", 7)


def test_local_id_in_the_remote_space_never_reaches_the_instance() -> None:
    """Seed 004: a notification carrying our own request id where the peer's belongs."""
    rig = make_rig(spaces=("remote_request_id",))
    rig.tracker.begin("local-1")
    rig.tracker.link("local-1", "remote_request_id", "remote-7")
    assert rig.tracker.fire_by("remote_request_id", "local-1", "abort") is None
    assert rig.tracker.state("local-1") == "pinned"
    assert rig.tracker.anomalies() == [Anomaly("unknown", "remote_request_id", "local-1", "abort")]


def test_remote_id_in_the_remote_space_reaches_the_instance() -> None:
    rig = make_rig(spaces=("remote_request_id",))
    rig.tracker.begin("local-1")
    rig.tracker.link("local-1", "remote_request_id", "remote-7")
    assert rig.tracker.fire_by("remote_request_id", "remote-7", "abort") == "aborted"


def test_crossed_local_and_remote_ids_each_reach_their_own_instance() -> None:
    """Each side's local id equals the other's remote id: the space alone decides."""
    rig = make_rig(spaces=("remote_request_id",))
    rig.tracker.begin("A")
    rig.tracker.begin("B")
    rig.tracker.link("A", "remote_request_id", "B")
    rig.tracker.link("B", "remote_request_id", "A")
    rig.tracker.fire_by("remote_request_id", "B", "enqueue")  # names local A
    assert (rig.tracker.state("A"), rig.tracker.state("B")) == ("queued", "pinned")


# -- deadlines ----------------------------------------------------------------------


def enter_transferring(rig: Rig, key: Hashable, at: float) -> None:
    rig.clock.now = at
    walk_to(rig, key, "transferring")


def poll_at(rig: Rig, now: float) -> list[tuple[Hashable, str, str]]:
    """Move the clock to ``now`` and poll there, as a real poll loop does."""
    rig.clock.now = now
    return rig.tracker.poll(now=now)


def test_timeout_does_not_fire_before_its_deadline(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    assert poll_at(rig, 104.9) == []
    assert rig.tracker.state("r1") == "transferring"


def test_timeout_fires_once_its_deadline_has_passed(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    assert poll_at(rig, 105.1) == [("r1", "expire", "retrying")]
    assert rig.tracker.state("r1") == "retrying"


def test_timeout_transition_releases_what_its_path_releases(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    poll_at(rig, 105.1)
    assert rig.driver.observe("r1") == {"gpu_blocks"}


def test_timeout_fires_only_once(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    poll_at(rig, 105.1)
    assert poll_at(rig, 105.2) == []


def test_state_left_early_never_times_out_later(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    rig.tracker.fire("r1", "complete")
    seen = len(rig.seen)
    assert poll_at(rig, 200.0) == []
    assert len(rig.seen) == seen


def test_deadline_of_an_earlier_visit_does_not_fire_after_reentry(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)  # first deadline 105
    rig.clock.now = 101.0
    rig.tracker.fire("r1", "expire")
    rig.clock.now = 102.0
    rig.tracker.fire("r1", "retry")  # second deadline 107
    assert poll_at(rig, 106.0) == []
    assert poll_at(rig, 107.5) == [("r1", "expire", "retrying")]


def test_poll_fires_exactly_the_due_timeouts(rig: Rig) -> None:
    for i, key in enumerate(("a", "b", "c")):
        enter_transferring(rig, key, at=100.0 + i)  # deadlines 105, 106, 107
    fired = poll_at(rig, 106.5)
    assert sorted(fired) == [("a", "expire", "retrying"), ("b", "expire", "retrying")]
    assert rig.tracker.state("c") == "transferring"


def test_timeout_into_a_timed_state_arms_that_states_deadline(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    poll_at(rig, 105.1)  # -> retrying, retry_timeout 2.0 -> 107.1
    assert poll_at(rig, 107.0) == []
    assert poll_at(rig, 107.2) == [("r1", "give_up", "expired")]


def test_poll_with_nothing_due_does_nothing(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    calls, seen = len(rig.driver.calls), len(rig.seen)
    assert poll_at(rig, 100.5) == []
    assert (len(rig.driver.calls), len(rig.seen), rig.tracker.state("r1")) == (calls, seen, "transferring")


def test_poll_without_now_reads_the_injected_clock(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    rig.clock.now = 105.1
    assert rig.tracker.poll() == [("r1", "expire", "retrying")]


def test_params_override_a_spec_timeout() -> None:
    rig = make_rig(params={"transfer_timeout": 1.0})
    enter_transferring(rig, "r1", at=100.0)
    assert poll_at(rig, 101.1) == [("r1", "expire", "retrying")]


# -- run to completion --------------------------------------------------------------


def test_event_fired_from_a_do_action_runs_after_the_current_transition(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")
    rig.driver.hooks["start_transfer"] = lambda key: rig.tracker.fire(key, "complete")
    rig.tracker.fire("r1", "start")
    assert rig.transitions()[-2:] == [("start", "queued", "transferring"), ("complete", "transferring", "done")]
    assert rig.tracker.state("r1") == "done"


def test_event_fired_from_an_action_is_not_applied_inside_that_action(rig: Rig) -> None:
    rig.tracker.begin("r1")
    inside: list[str | None] = []

    def fire_start(key: Hashable) -> None:
        rig.tracker.fire(key, "start")
        inside.append(rig.tracker.state(key))

    rig.driver.hooks["free_host_buf"] = fire_start  # a release of pinned -> queued
    rig.tracker.fire("r1", "enqueue")
    assert inside == ["queued"], "the queued event must wait until the current transition is finished"
    assert rig.tracker.state("r1") == "transferring"


def test_event_fired_from_a_begin_acquire_runs_when_begin_finishes(rig: Rig) -> None:
    rig.driver.hooks["alloc_host_buf"] = lambda key: rig.tracker.fire(key, "enqueue")
    rig.tracker.begin("r1")
    assert rig.tracker.state("r1") == "queued"


def test_begin_inside_an_action_keeps_that_actions_later_events_queued(rig: Rig) -> None:
    walk_to(rig, "r1", "queued")

    def spawn_then_complete(key: Hashable) -> None:
        rig.tracker.begin("child")  # e.g. a prefetch job started by the transfer
        rig.tracker.fire(key, "complete")  # legal only once start has moved r1 to transferring

    rig.driver.hooks["start_transfer"] = spawn_then_complete
    rig.tracker.fire("r1", "start")
    assert rig.tracker.state("r1") == "done"


# -- observer ---------------------------------------------------------------------


def test_observer_receives_key_generation_event_source_target_and_time(rig: Rig) -> None:
    rig.clock.now = 10.0
    rig.tracker.begin("r1")
    gen = rig.tracker.generation("r1")
    rig.seen.clear()
    rig.clock.now = 11.0
    rig.tracker.fire("r1", "enqueue")
    rig.clock.now = 12.5
    rig.tracker.fire("r1", "start")
    assert rig.seen == [
        ("r1", gen, "enqueue", "pinned", "queued", 11.0),
        ("r1", gen, "start", "queued", "transferring", 12.5),
    ]


def test_observer_receives_timeout_transitions(rig: Rig) -> None:
    enter_transferring(rig, "r1", at=100.0)
    rig.clock.now = 105.1
    rig.tracker.poll()
    assert rig.transitions()[-1] == ("expire", "transferring", "retrying")


def test_observer_tells_generations_of_a_reused_key_apart(rig: Rig) -> None:
    rig.tracker.begin("r1")
    first = rig.tracker.generation("r1")
    rig.tracker.fire("r1", "abort")
    rig.tracker.begin("r1")
    second = rig.tracker.generation("r1")
    rig.tracker.fire("r1", "abort")
    aborts = [g for (_k, g, e, *_rest) in rig.seen if e == "abort"]
    assert aborts == [first, second]


# -- finished, census, holding --------------------------------------------------------


def test_finished_drains_each_finished_instance_once_in_finish_order(rig: Rig) -> None:
    for key in ("a", "b", "c"):
        walk_to(rig, key, "queued")
    rig.tracker.fire("b", "abort")
    rig.tracker.fire("a", "fail")
    rig.tracker.fire("c", "abort")
    assert rig.tracker.finished() == [("b", "aborted"), ("a", "failed"), ("c", "aborted")]
    assert rig.tracker.finished() == []


def test_finished_but_undrained_instance_keeps_its_final_state(rig: Rig) -> None:
    walk_to(rig, "r1", "done")
    assert rig.tracker.state("r1") == "done"
    assert rig.tracker.held("r1") == ()


def test_a_drained_key_is_late_and_a_key_never_seen_is_unknown(rig: Rig) -> None:
    walk_to(rig, "r1", "done")
    rig.tracker.finished()
    assert rig.tracker.state("r1") is None
    assert rig.tracker.fire("r1", "abort") is None
    assert rig.tracker.fire("never", "abort") is None
    assert (rig.tracker.counts["late"], rig.tracker.counts["unknown"]) == (1, 1)


def test_census_counts_instances_per_state(rig: Rig) -> None:
    walk_to(rig, "a", "pinned")
    walk_to(rig, "b", "pinned")
    walk_to(rig, "c", "queued")
    walk_to(rig, "d", "done")
    census = {s: n for s, n in rig.tracker.census().items() if n}
    assert census == {"pinned": 2, "queued": 1, "done": 1}
    rig.tracker.finished()
    assert {s: n for s, n in rig.tracker.census().items() if n} == {"pinned": 2, "queued": 1}


def test_live_counts_instances_not_yet_final(rig: Rig) -> None:
    walk_to(rig, "a", "pinned")
    walk_to(rig, "b", "transferring")
    walk_to(rig, "c", "done")
    assert rig.tracker.live() == 2


def test_holding_matches_the_drivers_real_holdings(rig: Rig) -> None:
    walk_to(rig, "a", "pinned")
    walk_to(rig, "b", "pinned")
    walk_to(rig, "c", "queued")
    walk_to(rig, "d", "retrying")
    holding = rig.tracker.holding()
    real = {
        "gpu_blocks": len(rig.driver.gpu.owned),
        "host_buf": len(rig.driver.host.owned),
        "queue_slot": len(rig.driver.queue),
        "lease": len(rig.driver.leases),
    }
    assert holding == real == {"gpu_blocks": 4, "host_buf": 2, "queue_slot": 1, "lease": 1}


# -- close --------------------------------------------------------------------------


def test_close_aborts_every_live_instance_and_the_driver_holds_nothing(rig: Rig) -> None:
    for state in ("pinned", "queued", "transferring", "retrying"):
        walk_to(rig, state, state)
    rig.tracker.close()
    assert rig.driver.totals() == NOTHING_HELD
    assert sorted(rig.tracker.finished()) == sorted(
        (s, "aborted") for s in ("pinned", "queued", "transferring", "retrying")
    )


def test_close_leaves_already_finished_instances_alone(rig: Rig) -> None:
    walk_to(rig, "r1", "done")
    calls = len(rig.driver.calls)
    rig.tracker.close()
    assert len(rig.driver.calls) == calls
    assert rig.tracker.finished() == [("r1", "done")]


def test_begin_after_close_raises_tracker_closed(rig: Rig) -> None:
    rig.tracker.close()
    with pytest.raises(TrackerClosed):
        rig.tracker.begin("r1")


def test_fire_after_close_raises_tracker_closed(rig: Rig) -> None:
    """errors.TrackerClosed: 'The tracker was closed; it accepts no more events.'"""
    walk_to(rig, "r1", "pinned")
    rig.tracker.close()
    with pytest.raises(TrackerClosed):
        rig.tracker.fire("r1", "abort")


def test_close_force_releases_an_instance_whose_abort_does_not_finish() -> None:
    rig = make_rig(ABORTING_SPEC)
    rig.tracker.begin("r1")
    rig.tracker.close()
    assert rig.driver.totals() == NOTHING_HELD
    assert [(a.kind, a.id) for a in rig.tracker.anomalies()] == [("forced", "r1")]


# -- binding ------------------------------------------------------------------------


class HalfDriver:
    """Has the resource actions but none of the do actions."""

    def alloc_gpu_blocks(self, key: Hashable) -> None: ...
    def free_gpu_blocks(self, key: Hashable) -> None: ...
    def alloc_host_buf(self, key: Hashable) -> None: ...
    def free_host_buf(self, key: Hashable) -> None: ...
    def take_slot(self, key: Hashable) -> None: ...
    def give_slot(self, key: Hashable) -> None: ...
    def take_lease(self, key: Hashable) -> None: ...
    def drop_lease(self, key: Hashable) -> None: ...


def test_binding_error_names_every_missing_method() -> None:
    with pytest.raises(BindingError) as caught:
        Tracker(SPEC, HalfDriver())
    for name in ("start_transfer", "finish_transfer", "reconnect"):
        assert name in str(caught.value)


def test_binding_error_does_not_name_methods_the_driver_has() -> None:
    with pytest.raises(BindingError) as caught:
        Tracker(SPEC, HalfDriver())
    assert "take_slot" not in str(caught.value)


def test_unknown_param_is_a_binding_error_naming_it() -> None:
    with pytest.raises(BindingError, match="transfer_timout"):
        Tracker(SPEC, PoolDriver(), params={"transfer_timout": 1.0})


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf"), "5", True], ids=repr)
def test_a_param_that_is_no_deadline_is_a_binding_error(value: object) -> None:
    """The loader refuses these in a spec; an override must not slip them in (NaN would fire at once)."""
    with pytest.raises(BindingError, match=r"transfer_timeout.*finite, non-negative number of seconds"):
        Tracker(SPEC, PoolDriver(), params={"transfer_timeout": value})  # type: ignore[dict-item]


def test_tracker_accepts_a_spec_file_path() -> None:
    class Canonical:
        def __init__(self) -> None:
            self.log: list[str] = []

        def __getattr__(self, name: str) -> Callable[..., None]:
            return lambda key, **p: self.log.append(name)

    driver = Canonical()
    tracker = Tracker(CANONICAL, driver)
    tracker.begin("r1")
    assert tracker.fire("r1", "enqueue") == "queued"
    assert driver.log == ["enqueue_job"]


def test_a_raising_observer_is_reported_and_queued_events_still_run() -> None:
    """An observer that raises must not strand events queued by the transition's actions."""
    spec = kvfsm.load(Path(__file__).resolve().parent.parent / "specs" / "kv_request.yaml")

    class Chaining:
        tracker: Tracker

        def enqueue_job(self, key: str, **payload: object) -> None:
            if key == "a":
                self.tracker.fire("b", "enqueue")

        def start_transfer(self, key: str, **payload: object) -> None: ...
        def free_gpu_blocks(self, key: str, **payload: object) -> None: ...
        def task_done(self, key: str, **payload: object) -> None: ...

    def observer(key: object, gen: int, event: str, source: str, target: str, now: float) -> None:
        if key == "a" and event == "enqueue":
            raise RuntimeError("log disk full")

    driver = Chaining()
    tracker = driver.tracker = Tracker(spec, driver, observer=observer)
    tracker.begin("a")
    tracker.begin("b")
    with pytest.raises(ActionError) as info:
        tracker.fire("a", "enqueue")
    assert [f.phase for f in info.value.failures] == ["observer"]
    assert (tracker.state("a"), tracker.state("b")) == ("queued", "queued")
    assert tracker.counts["observer_errors"] == 1


def test_several_observers_each_see_every_transition_and_one_raising_stops_none() -> None:
    """A metrics exporter and a journal on one tracker: both are told, in order, and a raising one is reported."""
    seen: list[tuple[str, str]] = []

    def first(key: Hashable, gen: int, event: str, source: str, target: str, at: float) -> None:
        seen.append(("first", event))
        raise RuntimeError("exporter down")

    def second(key: Hashable, gen: int, event: str, source: str, target: str, at: float) -> None:
        seen.append(("second", event))

    spec = read_text(
        "kvfsm: 1\nmachine: m\nkey: k\nstates:\n  a: {initial: true}\n  b: {final: success}\n"
        "transitions:\n  - {event: go, from: a, to: b}\n"
    )
    tracker = Tracker(spec, object(), observer=[first, second])
    with pytest.raises(ActionError) as raised:
        tracker.begin("r")
    assert [f.action for f in raised.value.failures] == ["first"]
    with pytest.raises(ActionError):
        tracker.fire("r", "go")
    assert seen == [("first", "begin"), ("second", "begin"), ("first", "go"), ("second", "go")]
    assert tracker.counts["observer_errors"] == 2
    with pytest.raises(TypeError, match="not callable"):
        Tracker(spec, object(), observer=[second, "journal.log"])  # type: ignore[list-item]
