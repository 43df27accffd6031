"""``fire_many`` (and ``begin_many``, ``fire_many_by``) against ``fire`` on a twin, with actions that call back and lie.

Two trackers run one random program on one random spec (``specs()``); every
resource has its own acquire and release, so each driver keeps a ledger of
what it really holds. The batch tracker gets ``begin_many``, ``fire_many``
and ``fire_many_by``; the twin gets ``begin``, ``fire`` and ``fire_by``, one
key at a time, in the order ``fire_many`` documents: rounds (a key's n-th
mention in round n), groups by the state each key is in when its round
starts (first appearance first), and at a group's turn its keys still in
that state, then the others.

The drivers' actions, batch ones or not, call back into their tracker
(``fire``, ``fire_many``, ``begin`` on other keys, or their own), fail for
some keys, raise, and return what a batch action must not: failures naming
keys outside the group, errors that are not exception instances, a list, an
exception class. The batch's driver draws all that as it goes, per step
(the n-th call of an action for a key); the twin's driver is handed the
batch's and does, step for step, what it did. A malformed answer fails the
whole group, so the twin's action, called with one key, answers for that key
the same kind of wrong thing.

What is compared after every call: every key's state, its deadline (when
its state's was armed) and the next one due, what each driver
holds (and that it equals what the spec says each state holds: nothing
released twice, nothing leaked, nothing outside a group touched), the
failures raised (as multisets: key, event, action, phase, end state and
error type), the counts, and at each drain, ``finished()`` and the anomalies
(as multisets: the batch reports a group at once, the twin key by key).

Where the two must differ by design, the program does not go (see
:meth:`Driver.may_name`): a call back naming a key of the call from its own
group or an earlier one (the batch stepped that key with its group, the
twin would move it first), or from a key outside the call; two sources
calling back on one key (the batch queues a group's calls together); calls
back during ``poll`` and ``close`` (both run one key at a time, in an order
the batch and the twin reach differently). Half the examples run ``CHAIN``,
a spec where every live state takes the same event with an action of its
own, so that batches span groups that each call the driver.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import kvfsm
from kvfsm import ActionError, DuplicateKey, IllegalTransition, Tracker
from kvfsm.spec import Spec
from kvfsm.testing.clock import VirtualClock
from kvfsm.testing.strategies import as_yaml, specs

KEYS = ("k1", "k2", "k3", "k4", "k5")
"""Keys of more than one character: a release given a bare key instead of a list would iterate its letters."""

OUTCOMES = ("ok",) * 9 + ("empty", "fail", "fail", "raise", "outsider", "not_exception", "list", "class")
"""What an action does for a key: take (ok; a batch action answering ``{}``: empty), fail, raise, or answer wrongly."""

MALFORMED = ("outsider", "not_exception", "list", "class")

Step = tuple[str, Hashable, int]
"""(action, key, n): the n-th call of an action for a key."""

CallBack = tuple[str, str, tuple[str, ...]]
"""(how: fire, fire_many or begin; event; the keys it names)."""


class Boom(RuntimeError):
    """An injected failure."""


def own_actions(spec: Spec) -> Spec:
    resources = {name: replace(r, acquire=f"take_{name}", release=f"give_{name}") for name, r in spec.resources.items()}
    return replace(spec, resources=resources)


@dataclass
class Call:
    """The top-level call both trackers are running: which call backs it allows (see :meth:`Driver.may_name`)."""

    keys: frozenset[Hashable] = frozenset()
    group: Mapping[Hashable, int] | None = field(default_factory=dict)
    """Each key's group (its index in first-appearance order of states); None when a key is named twice."""
    quiet: bool = False
    """poll and close: no call backs at all."""


class Driver:
    """A ledger of what each key holds, whose actions call back and answer as drawn (the batch's) or as told (the twin's).

    The batch's driver draws, at each step (the n-th call of an action for
    a key), what the action answers for that key and whether it calls back;
    the twin's driver is given the batch's driver and does what it recorded
    for the same step. A key is called back on from one source key only
    (``claims``): two sources would reach it in different orders.
    """

    def __init__(
        self, actions: tuple[str, ...], batched: frozenset[str], events: list[str], draws: st.DataObject | Driver
    ) -> None:
        self.tracker: Tracker | None = None
        self.events = events
        self.data = draws if isinstance(draws, st.DataObject) else None
        self.twin_of = draws if isinstance(draws, Driver) else None
        self.said: dict[Step, str] = {}
        """What this driver's action answered for each step (for a batch action: what the group's answer meant)."""
        self.made: dict[Step, CallBack] = {}
        self.claims: dict[Hashable, Hashable] = {}
        self.held: dict[Hashable, set[str]] = defaultdict(set)
        self.calls: Counter[tuple[str, Hashable]] = Counter()
        self.violations: list[str] = []
        self.call = Call()
        for name in actions:
            setattr(self, name, self._batch(name) if name in batched else self._single(name))

    def _single(self, name: str) -> Callable[..., None]:
        def single(key: Hashable, **_payload: Any) -> None:
            step, outcome = self._enter(name, key)
            if outcome in MALFORMED:  # a per-key action has no answer to get wrong
                outcome = "ok"
            self.said[step] = outcome
            if outcome in ("fail", "raise"):
                raise Boom(f"{name}({key!r})")
            self._take(name, key)

        return single

    def _batch(self, name: str) -> Callable[..., object]:
        @kvfsm.batch
        def many(keys: list[Hashable], **_payload: Any) -> Any:  # Any: it answers wrongly on purpose
            entered = [self._enter(name, key) for key in keys]
            outcomes = [outcome for _step, outcome in entered]
            worst = next((o for o in outcomes if o == "raise"), None) or next(
                (o for o in outcomes if o in MALFORMED), None
            )
            for step, outcome in entered:
                self.said[step] = worst or outcome
            if len(keys) > 1 and worst is not None and self.data is not None:
                event(f"a batch action answered {worst} for a group")
            if worst == "raise":
                raise Boom(f"{name}({keys!r})")
            if worst is not None:
                return self._malformed(worst, keys)
            failed = {key: Boom(f"{name}({key!r})") for key, o in zip(keys, outcomes, strict=True) if o == "fail"}
            for key, outcome in zip(keys, outcomes, strict=True):
                if outcome != "fail":
                    self._take(name, key)
            return failed or ({} if "empty" in outcomes else None)

        return many

    @staticmethod
    def _malformed(kind: str, keys: list[Hashable]) -> object:
        if kind == "outsider":  # a live key of another group, if there is one
            return {next((k for k in KEYS if k not in keys), "zz"): Boom("not yours")}
        if kind == "not_exception":
            return {keys[0]: "no"}
        if kind == "class":
            return {keys[0]: Boom}
        return list(keys)

    def _enter(self, name: str, key: Hashable) -> tuple[Step, str]:
        """Count the call, free what a release frees, call back; returns the step and what to answer for the key."""
        self.calls[name, key] += 1
        step = (name, key, self.calls[name, key])
        kind, _, resource = name.partition("_")
        if kind == "give":  # a release frees first: whatever it does next cannot leak what it held
            if resource not in self.held[key]:
                self.violations.append(f"{name}({key!r}): {resource} released but not held")
            self.held[key].discard(resource)
        if self.twin_of is not None:
            plan = self.twin_of.made.get(step)
            outcome = self.twin_of.said.get(step, "ok")
        else:
            assert self.data is not None
            plan = self._draw_call_back(key)
            outcome = self.data.draw(st.sampled_from(OUTCOMES), label=f"{name}({key!r}) answers")
        if plan is not None:
            self.made[step] = plan
            self._call_back(key, plan)
        return step, outcome

    def _draw_call_back(self, source: Hashable) -> CallBack | None:
        assert self.data is not None
        free = [k for k in KEYS if self.claims.get(k, source) == source]
        later = [k for k in free if k != source and self.may_name(source, k) and k in self.call.keys]
        if not free or self.data.draw(st.integers(0, 1 if later else 2), label=f"call back from {source!r}?") != 0:
            return None
        if later and self.data.draw(st.integers(0, 3), label="name a later group's key?") != 0:
            free = later  # what the batch must read again when that group's turn comes
        targets = self.data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=2, unique=True), label="named")
        for target in targets:
            self.claims[target] = source
        how = self.data.draw(st.sampled_from(("fire", "fire", "fire_many", "begin")), label="how")
        return how, self.data.draw(st.sampled_from(self.events), label="event"), tuple(targets)

    def _take(self, name: str, key: Hashable) -> None:
        kind, _, resource = name.partition("_")
        if kind == "take":
            if resource in self.held[key]:
                self.violations.append(f"{name}({key!r}): {resource} acquired twice")
            self.held[key].add(resource)

    def may_name(self, source: Hashable, target: Hashable) -> bool:
        """Whether a call back from ``source``'s action may name ``target`` with the same outcome in both trackers.

        Its own key, always; a key outside the call, yes; a key of the call,
        only from a key of the call, into a later group (which the batch reads
        again when its turn comes, and the twin reaches later too).
        """
        call = self.call
        if call.quiet:
            return False
        if target == source or target not in call.keys:
            return True
        return call.group is not None and source in call.keys and call.group[target] > call.group[source]

    def _call_back(self, source: Hashable, plan: CallBack) -> None:
        how, fired, targets = plan
        named = [t for t in targets if self.may_name(source, t)]
        t = self.tracker
        assert t is not None
        if not named:
            return
        if self.data is not None and any(target in self.call.keys and target != source for target in named):
            event(
                f"a call back from {'a key of' if source in self.call.keys else 'outside'} the call named a later group's key"
            )
        if how == "fire_many":
            t.fire_many(fired, named)
        for target in named if how != "fire_many" else ():
            t.begin(target) if how == "begin" else t.fire(target, fired)


Failures = Counter[tuple[Any, ...]]


def failures(exc: ActionError) -> Failures:
    return Counter((f.key, f.event, f.action, f.phase, f.state, type(f.error).__name__) for f in exc.failures)


def per_key(t: Tracker, run: Callable[[], object], key: Hashable, event: str) -> Failures:
    """Run one per-key call of ``t``; what it raised, as the batch reports it."""
    try:
        run()
    except ActionError as exc:
        return failures(exc)
    except IllegalTransition as exc:
        return Counter({(exc.key, event, "<none>", "refused", exc.state, "IllegalTransition"): 1})
    except DuplicateKey:
        return Counter({(key, event, "<none>", "refused", t.state(key), "DuplicateKey"): 1})
    return Counter()


def rounds(items: list[Any], key: Callable[[Any], Hashable]) -> list[list[Any]]:
    """Items by mention: the n-th item naming a key goes to round n."""
    out: list[list[Any]] = []
    seen: Counter[Hashable] = Counter()
    for item in items:
        n = seen[key(item)]
        seen[key(item)] += 1
        if n == len(out):
            out.append([])
        out[n].append(item)
    return out


def grouped(items: list[Any], state: Callable[[Any], str | None]) -> list[tuple[str | None, list[Any]]]:
    groups: dict[str | None, list[Any]] = {}
    for item in items:
        groups.setdefault(state(item), []).append(item)
    return list(groups.items())


def twin_fire_many(t: Tracker, event: str, keys: Sequence[Hashable]) -> Failures:
    """``fire_many`` as the documented sequence of ``fire`` calls."""
    got: Failures = Counter()
    for batch in rounds(list(keys), lambda k: k):
        for state, group in grouped(batch, t.state):
            if state is not None:
                group = [k for k in group if t.state(k) == state] + [k for k in group if t.state(k) != state]
            for key in group:
                got += per_key(t, partial(t.fire, key, event), key, event)
    return got


def twin_fire_many_by(t: Tracker, event: str, ids: list[str]) -> Failures:
    """``fire_many_by`` as the documented sequence of ``fire_by`` calls: ids looked up at the start, again at their turn."""
    got: Failures = Counter()
    found = [(ident, t.route("peer", ident) or ("unresolved", n)) for n, ident in enumerate(ids)]
    for batch in rounds(found, lambda item: item[1]):
        for state, group in grouped(batch, lambda item: t.state(item[1])):
            if state is not None:
                still = [(i, k) for i, k in group if t.state(k) == state and t.route("peer", i) == k]
                group = still + [item for item in group if item not in still]
            for ident, key in group:
                got += per_key(t, partial(t.fire_by, "peer", ident, event), key, event)
    return got


def call_of(keys: Sequence[Hashable], state: Callable[[Hashable], str | None]) -> Call:
    if len(set(keys)) != len(keys):
        return Call(frozenset(keys), None)
    order: dict[str | None, int] = {}
    group = {key: order.setdefault(state(key), len(order)) for key in keys}
    return Call(frozenset(keys), group)


def run_program(spec: Spec, data: st.DataObject) -> None:
    note(as_yaml(spec))
    actions = spec.actions()
    events = [*spec.events, "no_such_event"]
    batched = frozenset(data.draw(st.sets(st.sampled_from(actions)) if actions else st.just(set()), label="batched"))
    one = Driver(actions, batched, events, data)
    twin_driver = Driver(actions, batched, events, one)
    clocks = VirtualClock(), VirtualClock()
    batch = Tracker(spec, one, clock=clocks[0], spaces=["peer"])
    twin = Tracker(spec, twin_driver, clock=clocks[1], spaces=["peer"])
    one.tracker, twin_driver.tracker = batch, twin
    ids = ["never-linked"]

    def link_new(keys: Sequence[Hashable]) -> None:
        for key in keys:
            if batch.state(key) in spec.live and not batch.ids(key):
                ident = f"p{len(ids)}"
                ids.append(ident)
                for t in (batch, twin):
                    t.link(key, "peer", ident)

    def both(call: Call, run_batch: Callable[[], Failures], run_twin: Callable[[], Failures], what: str) -> None:
        one.call = twin_driver.call = call
        got, expected = run_batch(), run_twin()
        one.call = twin_driver.call = Call()
        assert got == expected, f"{what}: failures differ"
        check(what)

    def check(what: str) -> None:
        assert not one.violations and not twin_driver.violations, (what, one.violations, twin_driver.violations)
        states = {k: batch.state(k) for k in KEYS}
        assert states == {k: twin.state(k) for k in KEYS}, f"{what}: states differ"
        for key in KEYS:
            assert one.held[key] == set(batch.held(key)), f"{what}: the batch driver holds {one.held[key]} for {key}"
            assert twin_driver.held[key] == set(twin.held(key)), (
                f"{what}: the twin driver holds {twin_driver.held[key]}"
            )
        assert batch.counts == twin.counts, f"{what}: counts differ"
        armed = {k: batch.entered(k) for k in KEYS}
        assert armed == {k: twin.entered(k) for k in KEYS}, f"{what}: deadlines differ"
        assert batch.next_deadline() == twin.next_deadline(), f"{what}: next deadlines differ"
        assert not batch._queue and not batch._busy

    def batch_failures(run: Callable[[], object]) -> Failures:
        try:
            run()
        except ActionError as exc:
            return failures(exc)
        return Counter()

    def take_step(i: int) -> None:
        kind = data.draw(st.sampled_from(("begin", "begin_many", "fire_many", "fire_many", "by", "poll", "drain")))
        what = f"step {i}: {kind}"
        if kind == "poll":
            advance = data.draw(st.sampled_from((0.5, 1.0, 3.0)), label="advance")
            fired = []
            one.call = twin_driver.call = Call(quiet=True)
            got: list[Failures] = []
            for t, clock in zip((batch, twin), clocks, strict=True):
                clock.advance(advance)
                try:
                    fired.append(sorted(map(str, t.poll())))
                    got.append(Counter())
                except ActionError as exc:
                    fired.append(sorted(map(str, exc.result)))
                    got.append(failures(exc))
            one.call = twin_driver.call = Call()
            assert fired[0] == fired[1] and got[0] == got[1], what
            check(what)
        elif kind == "drain":
            assert Counter(batch.finished()) == Counter(twin.finished()), what
            assert Counter(batch.anomalies()) == Counter(twin.anomalies()), what
        elif kind == "begin":
            key = data.draw(st.sampled_from(KEYS), label="key")
            both(
                Call(),
                lambda: per_key(batch, lambda: batch.begin(key), key, "begin"),
                lambda: per_key(twin, lambda: twin.begin(key), key, "begin"),
                what,
            )
            link_new([key])
        elif kind == "begin_many":
            keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=6), label="keys")
            call = Call(frozenset(keys), dict.fromkeys(keys, 0) if len(set(keys)) == len(keys) else None)
            both(
                call,
                lambda: batch_failures(lambda: batch.begin_many(keys)),
                lambda: sum((per_key(twin, partial(twin.begin, k), k, "begin") for k in keys), Counter()),
                what,
            )
            link_new(keys)
        elif kind == "fire_many":
            unique = data.draw(st.integers(0, 3), label="distinct keys?") != 0
            keys = data.draw(st.lists(st.sampled_from((*KEYS, "ghost")), max_size=6, unique=unique), label="keys")
            event = data.draw(st.sampled_from(events), label="event")
            both(
                call_of(keys, batch.state),
                lambda: batch_failures(lambda: batch.fire_many(event, keys)),
                lambda: twin_fire_many(twin, event, keys),
                what,
            )
        else:
            picked = data.draw(st.lists(st.sampled_from(ids), max_size=5), label="ids")
            event = data.draw(st.sampled_from(events), label="event")
            linked = [k for k in (batch.route("peer", i) for i in picked) if k is not None]
            both(
                call_of(linked, batch.state),
                lambda: batch_failures(lambda: batch.fire_many_by("peer", event, picked)),
                lambda: twin_fire_many_by(twin, event, picked),
                what,
            )

    for key in KEYS:  # every key live, so that most batches span several states
        both(
            Call(),
            partial(per_key, batch, partial(batch.begin, key), key, "begin"),
            partial(per_key, twin, partial(twin.begin, key), key, "begin"),
            "begin",
        )
    link_new(KEYS)
    for i in range(data.draw(st.integers(1, 20), label="steps")):
        take_step(i)
    one.call = twin_driver.call = Call(quiet=True)
    closed = batch_failures(batch.close), batch_failures(twin.close)
    assert closed[0] == closed[1], "close: failures differ"
    check("close")
    assert all(not held for held in one.held.values()), f"close left {dict(one.held)} held"
    assert Counter(batch.finished()) == Counter(twin.finished())
    assert Counter(batch.anomalies()) == Counter(twin.anomalies())


# Every live state takes `step` with an action of its own, so a batch of `step` spans several groups that
# each call the driver; `back` and `abort` (with a do) are what a call back moves a later group's key with.
CHAIN = kvfsm.parse(
    """
kvfsm: 1
machine: chain
key: request_id
resources:
  blocks: {acquire: take_blocks, release: give_blocks}
  slot:   {acquire: take_slot, release: give_slot}
  chan:   {acquire: take_chan, release: give_chan}
states:
  pinned:  {initial: true, holds: [blocks], waits: local}
  queued:  {holds: [blocks, slot], waits: local}
  sending: {holds: [blocks, slot, chan], timeout: {after: 2.0, fire: expire}}
  parked:  {holds: [chan], waits: local}
  done:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
  expired: {final: failure}
transitions:
  - {event: step,   from: pinned,  to: queued,  do: do_queue}
  - {event: step,   from: queued,  to: sending, do: do_send}
  - {event: step,   from: sending, to: parked,  do: do_park}
  - {event: step,   from: parked,  to: done,    do: do_ack}
  - {event: back,   from: [queued, sending], to: pinned, do: do_back}
  - {event: back,   from: parked,  to: queued}
  - {event: fail,   from: [pinned, queued, sending, parked], to: failed}
  - {event: abort,  from: "*",     to: aborted, do: do_cancel}
  - {event: expire, from: sending, to: expired}
ignore:
  - {event: [step, back, abort, expire, fail], in: [done, failed, aborted, expired]}
  - {event: [back], in: [pinned]}
on_error: fail
""",
    "chain.yaml",
)

SPECS = st.one_of(st.just(CHAIN), specs(max_states=4, max_resources=3, max_events=3).map(own_actions))
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@settings(max_examples=200, **SETTINGS)  # type: ignore[arg-type]
@given(spec=SPECS, data=st.data())
def test_fire_many_does_what_fire_does_key_by_key_whatever_actions_call_back_or_answer(
    spec: Spec, data: st.DataObject
) -> None:
    run_program(spec, data)


@pytest.mark.slow
@settings(max_examples=3000, **SETTINGS)  # type: ignore[arg-type]
@given(spec=SPECS, data=st.data())
def test_fire_many_does_what_fire_does_key_by_key_long_campaign(spec: Spec, data: st.DataObject) -> None:
    run_program(spec, data)
