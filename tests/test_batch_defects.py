"""What the batch path used to get wrong, one case per class of defect.

Each test here but ``test_valid_failures_fail_only_the_keys_they_name`` (which
pins down what must not change) failed on the engine before the fix it names:

- ``fire_many`` stepped a key from the state it had when the keys were
  grouped, though a call queued by an earlier group's action had moved it
  since (or begun it, or relinked the id that named it);
- ``close()`` called a ``@kvfsm.batch`` release with a bare key;
- what a batch action returned was trusted: a failure naming a key outside
  the group moved that instance, an error that is not an exception or a
  list instead of a mapping escaped as a raw ``TypeError``/``AttributeError``;
- ``fire_many``/``deliver_many`` with one key named many times took time
  quadratic in the number of copies.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import pytest

import kvfsm
from kvfsm import ActionError, Tracker
from kvfsm.engine import BatchResultError
from kvfsm.testing.clock import VirtualClock

STEPS = """
kvfsm: 1
machine: steps
key: request_id
spaces:
  peer_id: {linked_at: begin}
events:
  complete: {by: peer_id, remote: true}
begin: {payload: [peer_id]}
resources:
  slot: {acquire: take, release: give}
states:
  idle:    {initial: true, waits: local}
  busy:    {holds: [slot], timeout: {after: 1.0, fire: expire}}
  sending: {holds: [slot], timeout: {after: 1.0, fire: expire}}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: start,    from: idle,    to: busy}
  - {event: send,     from: busy,    to: sending}
  - {event: finish,   from: [busy, sending], to: done, do: confirm}
  - {event: complete, from: [busy, sending], to: done}
  - {event: fail,     from: [idle, busy, sending], to: failed}
  - {event: abort,    from: "*",     to: aborted}
  - {event: expire,   from: [busy, sending], to: expired}
ignore:
  - {event: [start, send, finish, complete, abort, expire, fail], in: [done, failed, aborted, expired]}
  - {event: [complete], in: [idle]}
on_error: fail
"""


class Slots:
    """Holds a slot per key, counting takes and gives; ``hook(action, keys)`` runs inside each action first.

    Every action is a batch action; ``answer[action]`` (if set) is what that action returns.
    """

    def __init__(self) -> None:
        self.held: Counter[Hashable] = Counter()
        self.gives: Counter[Hashable] = Counter()
        self.hook: Callable[[str, list[Hashable]], object] = lambda _action, _keys: None
        self.answer: dict[str, Callable[[list[Hashable]], object]] = {}

    def _run(self, action: str, keys: list[Hashable]) -> Any:
        self.hook(action, keys)
        return self.answer[action](keys) if action in self.answer else None

    @kvfsm.batch
    def take(self, keys: list[Hashable], peer_id: str = "") -> Any:
        answer = self._run("take", keys)
        if answer is None:
            self.held.update(keys)
        return answer

    @kvfsm.batch
    def give(self, keys: list[Hashable]) -> Any:
        self.held.subtract(keys)
        self.gives.update(keys)
        return self._run("give", keys)

    @kvfsm.batch
    def confirm(self, keys: list[Hashable]) -> Any:
        return self._run("confirm", keys)


def steps(driver: Slots | None = None) -> tuple[Tracker, Slots]:
    driver = driver or Slots()
    return Tracker(kvfsm.parse(STEPS, "steps.yaml"), driver, clock=VirtualClock()), driver


def walk(t: Tracker, key: str, *events: str, peer_id: str | None = None) -> None:
    t.begin(key, peer_id=peer_id or f"p-{key}")
    for event in events:
        t.fire(key, event)


def failed_keys(exc: ActionError) -> Counter[tuple[Hashable, str, str]]:
    return Counter((f.key, f.phase, f.state) for f in exc.failures)


# -- 1. a key moved, begun or relinked by an earlier group's queued call is stepped from where it is ----------


def run_both(
    setup: Callable[[Tracker, Slots], None], call: Callable[[Tracker], object], per_key: Callable[[Tracker], object]
) -> tuple[tuple[Tracker, Slots], tuple[Tracker, Slots]]:
    """The same setup on two trackers; ``call`` (the batch) on one, ``per_key`` (one fire at a time) on the other."""
    out = []
    for run in (call, per_key):
        t, d = steps()
        setup(t, d)
        with contextlib.suppress(ActionError):
            run(t)
        out.append((t, d))
    return out[0], out[1]


def test_a_key_an_earlier_groups_queued_call_moved_is_stepped_from_its_new_state() -> None:
    def setup(t: Tracker, d: Slots) -> None:
        walk(t, "x", "start")  # busy
        walk(t, "y", "start", "send")  # sending: a later group
        d.hook = lambda action, keys: t.fire("y", "abort") if action == "confirm" and "x" in keys else None

    (t, d), (twin, twin_d) = run_both(
        setup, lambda t: t.fire_many("finish", ["x", "y"]), lambda t: [t.fire(k, "finish") for k in ("x", "y")]
    )
    assert t.state("y") == "aborted", "y was aborted by x's confirm before its own turn: finish is ignored there"
    assert d.gives["y"] == 1 and +d.held == Counter(), f"gives {dict(d.gives)}, still held {dict(+d.held)}"
    assert sorted(t.finished()) == [("x", "done"), ("y", "aborted")]
    assert {k: twin.state(k) for k in "xy"} == {"x": "done", "y": "aborted"} and twin_d.gives == d.gives


def test_a_key_an_earlier_groups_queued_call_began_is_stepped_not_reported_unknown() -> None:
    def setup(t: Tracker, d: Slots) -> None:
        walk(t, "x", "start")
        d.hook = lambda action, keys: t.begin("new", peer_id="p-new") if action == "give" and "x" in keys else None

    (t, _d), (twin, _twin_d) = run_both(
        setup, lambda t: t.fire_many("abort", ["x", "new"]), lambda t: [t.fire(k, "abort") for k in ("x", "new")]
    )
    assert twin.state("new") == "aborted" and twin.counts["unknown"] == 0
    assert t.state("new") == "aborted" and t.counts["unknown"] == 0


def test_an_id_relinked_by_an_earlier_groups_queued_call_names_its_new_instance() -> None:
    def setup(t: Tracker, d: Slots) -> None:
        walk(t, "x", "start", peer_id="p-x")  # busy
        walk(t, "y", "start", "send", peer_id="p-y")  # sending
        t.fire("y", "abort")  # aborted: final, not drained, p-y still names it

        def hook(action: str, keys: list[Hashable]) -> None:
            if action == "give" and "x" in keys:  # x's release drains y, and p-y goes to a new instance z
                t.finished()
                t.begin("z", peer_id="p-y")
                t.fire("z", "start")

        d.hook = hook

    (t, _d), (twin, _twin_d) = run_both(
        setup,
        lambda t: t.deliver_many("complete", ["p-x", "p-y"]),
        lambda t: [t.deliver("complete", i) for i in ("p-x", "p-y")],
    )
    assert twin.state("z") == "done" and twin.counts["ignored"] == 0
    assert t.state("z") == "done", "p-y named z by its turn: the complete is z's"
    assert t.counts == twin.counts


def test_an_id_named_twice_whose_instance_was_drained_meanwhile_is_late_in_its_own_space() -> None:
    def setup(t: Tracker, d: Slots) -> None:
        walk(t, "y", "start", peer_id="p-y")
        d.hook = lambda action, keys: t.finished() if action == "give" else None  # y's release drains it

    (t, _d), (twin, _twin_d) = run_both(
        setup,
        lambda t: t.deliver_many("complete", ["p-y", "p-y"]),
        lambda t: [t.deliver("complete", i) for i in ("p-y", "p-y")],
    )
    assert [(a.kind, a.space, a.id) for a in twin.anomalies()] == [("late", "peer_id", "p-y")]
    assert [(a.kind, a.space, a.id) for a in t.anomalies()] == [("late", "peer_id", "p-y")]


# -- 2. close() and every other forced release call a batch release with a list ----------------------------

DRAIN_ON_ABORT = """
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
"""


class Blocks:
    def __init__(self) -> None:
        self.held: set[Hashable] = set()
        self.freed: list[Hashable] = []

    @kvfsm.batch
    def alloc_gpu_blocks(self, keys: list[Hashable]) -> None:
        self.held.update(keys)

    @kvfsm.batch
    def free_gpu_blocks(self, keys: list[Hashable]) -> None:
        for key in keys:
            self.freed.append(key)
            self.held.discard(key)


def test_close_calls_a_batch_release_it_forces_with_a_list_of_keys() -> None:
    blocks = Blocks()
    t = Tracker(kvfsm.parse(DRAIN_ON_ABORT, "drain_on_abort.yaml"), blocks)
    t.begin("req-1")
    t.close()  # abort only reaches 'aborting' (live): the blocks are released by force
    assert blocks.freed == ["req-1"] and blocks.held == set()
    assert [(a.kind, a.id) for a in t.anomalies()] == [("forced", "req-1")]


# -- 3. what a batch action returns is checked against the group it was called with -------------------------

MALFORMED: dict[str, Callable[[list[Hashable]], object]] = {
    "a key outside the group": lambda keys: {"outsider": RuntimeError("not yours")},
    "an error that is not an exception": lambda keys: {keys[0]: "no slot"},
    "a list, not a mapping": lambda keys: list(keys),
    "an exception class, not one raised": lambda keys: {keys[0]: RuntimeError},
}


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_do_returning_something_malformed_fails_the_group_and_touches_nothing_else(what: str) -> None:
    t, d = steps()
    for key in ("a", "b", "outsider"):
        walk(t, key, "start")
    d.answer["confirm"] = MALFORMED[what]
    with pytest.raises(ActionError) as caught:
        t.fire_many("finish", ["a", "b"])
    assert failed_keys(caught.value) == Counter({("a", "do", "failed"): 1, ("b", "do", "failed"): 1})
    for failure in caught.value.failures:
        assert failure.action == "confirm" and isinstance(failure.error, BatchResultError)
        assert "confirm()" in str(failure.error) and "returned" in str(failure.error)
    assert t.state("outsider") == "busy" and d.held["outsider"] == 1, "a key outside the group is untouched"
    assert +d.held == Counter({"outsider": 1}) and d.gives == Counter({"a": 1, "b": 1})
    assert sorted(t.finished()) == [("a", "failed"), ("b", "failed")]


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_fire_holds_a_batch_action_to_the_same_rule_with_a_one_key_list(what: str) -> None:
    t, d = steps()
    walk(t, "a", "start")
    walk(t, "outsider", "start")
    d.answer["confirm"] = MALFORMED[what]
    with pytest.raises(ActionError) as caught:
        t.fire("a", "finish")
    (failure,) = caught.value.failures
    assert (failure.key, failure.phase, failure.state) == ("a", "do", "failed")
    assert isinstance(failure.error, BatchResultError) and "confirm()" in str(failure.error)
    assert t.state("outsider") == "busy"


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_a_release_returning_something_malformed_is_a_release_failure_of_each_key(what: str) -> None:
    t, d = steps()
    for key in ("a", "b", "outsider"):
        walk(t, key, "start")
    d.answer["give"] = MALFORMED[what]
    with pytest.raises(ActionError) as caught:
        t.fire_many("abort", ["a", "b"])
    assert failed_keys(caught.value) == Counter({("a", "release", "aborted"): 1, ("b", "release", "aborted"): 1})
    assert all(isinstance(f.error, BatchResultError) and f.action == "give" for f in caught.value.failures)
    assert d.gives == Counter({"a": 1, "b": 1}) and t.state("outsider") == "busy"


@pytest.mark.parametrize("what", sorted(MALFORMED))
def test_an_acquire_returning_something_malformed_undoes_the_group(what: str) -> None:
    t, d = steps()
    for key in ("a", "b", "outsider"):
        walk(t, key)
    walk(t, "busy", "start")
    d.answer["take"] = MALFORMED[what]
    with pytest.raises(ActionError) as caught:
        t.fire_many("start", ["a", "b"])
    assert failed_keys(caught.value) == Counter({("a", "acquire", "failed"): 1, ("b", "acquire", "failed"): 1})
    assert t.state("outsider") == "idle" and t.state("busy") == "busy"
    assert +d.held == Counter({"busy": 1}) and d.gives == Counter()


def test_valid_failures_fail_only_the_keys_they_name() -> None:
    t, d = steps()
    for key in ("a", "b"):
        walk(t, key, "start")
    d.answer["confirm"] = lambda keys: {"b": RuntimeError("peer refused")}
    with pytest.raises(ActionError) as caught:
        t.fire_many("finish", ["a", "b"])
    assert failed_keys(caught.value) == Counter({("b", "do", "failed"): 1})
    assert str(caught.value.failures[0].error) == "peer refused"
    assert (t.state("a"), t.state("b")) == ("done", "failed") and +d.held == Counter()


# -- 4. one key named many times costs what as many fire() calls cost, not their square ---------------------------

COPIES = 16_000


def test_fire_many_and_deliver_many_with_one_id_named_many_times_take_linear_time() -> None:
    """Before: 5–16 s each (quadratic); now a few hundredths. Timed in this process's CPU seconds, which other
    processes on a shared machine do not inflate as they do the wall clock."""
    t, _d = steps()
    walk(t, "r", "start", peer_id="p")
    walk(t, "q", "start", peer_id="q")
    t.fire("q", "send")
    began = time.process_time()
    t.fire_many("abort", ["r"] * COPIES)
    t.deliver_many("complete", ["q"] * COPIES)
    took = time.process_time() - began
    assert (t.state("r"), t.state("q")) == ("aborted", "done")
    assert t.counts["ignored"] == 2 * (COPIES - 1)
    assert took < 2.0, f"{2 * COPIES} copies took {took:.2f} s"
