"""Hypothesis state machines generated from a spec: a Tracker and a real driver, held to the spec's model.

:func:`spec_machine` builds a :class:`~hypothesis.stateful.RuleBasedStateMachine`
whose rules begin keys (new, finished ones again, live ones for DuplicateKey),
fire every event at every key (legal, ignored, illegal, unknown), deliver
the events ``events:`` declares naming ids of every space (live, of an
earlier generation, retired, from another space, never seen), take the
transitions the spec handles (some with a do or acquire action made to raise),
move a virtual clock and ``poll()`` (some timeouts with a raising action),
drain ``finished()`` and, in a fraction of the examples, ``close()`` mid-example,
after which every begin and fire must raise ``TrackerClosed``; every example
ends with ``close()``. After every step it checks that the Tracker agrees with
:class:`~kvfsm.testing.oracle.SpecModel` and that the driver's ``observe(key)``
(its real resources) equals what the spec says each key holds, that the ids
linked to each key are the ones begin and the events carried (fresh ones
when the driver gives none), and, for a driver with an ``outbox``, that every
message it sent carried the id of the space ``outgoing:`` declares. A
disagreement raises :class:`SpecViolation` with the story of the example.

Each example may start from a planned prefix (a shortest path to a live
state, from :mod:`kvfsm.testing.cover`), so random steps begin deep in the
machine as often as at its start.

The driver contract beyond the spec's actions is in :mod:`kvfsm.testing.contract`:
``observe(key)`` (required), ``before_begin(key, resources)`` (required when
the initial state holds a resource no acquire action takes), ``before_fire(key,
event, resources)`` (optional: takes what a transition enters with no action,
and may return the event's payload) and ``inject_fault(action)`` (optional;
drivers without it are tested without faults).
"""

from __future__ import annotations

import math
import re
import unittest
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, NoReturn, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..engine import Tracker
from ..engine.outbox import Outbox
from ..errors import ActionError, BindingError, DuplicateKey, Failure, IllegalTransition, TrackerClosed
from ..spec import Spec, load
from ..spec.model import BEGIN
from .calls import CallTimeout, CallTimer, DriverError, DriverFault, Factory
from .clock import VirtualClock
from .contract import DriverFactory, ObservableDriver, OwnedFactory, can_inject_faults
from .cover import Pair, blocked_edges, caller_taken, routes
from .coverage import Coverage
from .oracle import Move, Outcome, SpecModel
from .story import SpecViolation, begin_line, clock, close_line, deliver_line, drain_line, fire_line, poll_line

KEYS = 3
"""Distinct keys one example uses: enough for instances to interfere through shared resources."""

CLOSE_MID_EXAMPLE = 4
"""At most one example in this many closes the tracker mid-example: enough to test what follows a
close, few enough that most examples spend their steps on live instances."""

T = TypeVar("T")


def fault_targets(spec: Spec) -> tuple[str, ...]:
    """Actions an injected fault may hit: those that run before a state changes (do, acquire).

    Releases are left out: what a failed release leaves behind in the real
    system is the driver's to define, so no spec can say what ``observe``
    must show after one.
    """
    releases = {r.release for r in spec.resources.values()}
    before = {t.do for t in spec.transitions if t.do} | {r.acquire for r in spec.resources.values() if r.acquire}
    return tuple(sorted(before - releases))


def begin_resources(spec: Spec) -> frozenset[str]:
    """What the initial state holds that no acquire action takes: the caller holds it before ``begin``."""
    return caller_taken(spec, None, spec.initial.name)


def check_driver(spec: Spec, driver: object) -> None:
    """Raise :class:`BindingError` if ``driver`` cannot be model-tested against ``spec``."""
    name = type(driver).__name__
    if not callable(getattr(driver, "observe", None)):
        raise BindingError(
            f"driver {name} has no observe(key) method; model-based tests compare what the driver really holds "
            f"with what spec {spec.name!r} says, so add observe(key) returning the names of the resources held "
            f"for key ({', '.join(spec.resources) or 'none declared'}), read from the real system"
        )
    outbox = getattr(driver, "outbox", None)
    if isinstance(outbox, Outbox) and outbox.spec.name != spec.name:
        raise BindingError(
            f"driver {name}'s outbox checks messages of machine {outbox.spec.name!r}, not {spec.name!r}; make it "
            "with the spec under test (Outbox(spec)), so the ids it sends are held to that spec's 'outgoing:'"
        )
    given = begin_resources(spec)
    if given and not callable(getattr(driver, "before_begin", None)):
        raise BindingError(
            f"spec {spec.name!r}: initial state {spec.initial.name!r} holds {', '.join(sorted(given))} with no "
            f"acquire action, so your code takes it before calling begin(); give driver {name} a "
            "before_begin(key, resources) method that does the same, so observe() can see it"
        )


def _failure(f: Failure) -> str:
    return f"{f.action}() raised {type(f.error).__name__}: {f.error} ({f.phase} on {f.event} {f.key})"


class BudgetSpent(unittest.SkipTest):
    """Raised by the teardown of the last example :attr:`SpecMachine.limit` allows; ends Hypothesis' run there.

    A ``SkipTest``: the one kind of exception Hypothesis neither takes for a failing example nor replays; it
    passes it straight up, to the runner, which catches it.
    """


class SpecMachine(RuleBasedStateMachine):
    """Base of the machines :func:`spec_machine` builds: state, checks and the invariant.

    Subclass a built machine to add rules or invariants of your own; ``self.tracker``,
    ``self.driver``, ``self.model`` and ``self.clock`` are there to use.
    """

    spec: ClassVar[Spec]
    driver_factory: ClassVar[DriverFactory | Factory]
    params: ClassVar[Mapping[str, float] | None] = None
    keys: ClassVar[tuple[str, ...]]
    coverage: ClassVar[Coverage]
    """Summed over every example this class runs."""
    blocked: ClassVar[dict[Pair, str] | None] = None
    """``(source, event) → why`` for edges the test cannot take with this driver (see
    :func:`~kvfsm.testing.cover.blocked_edges`); found from the first driver made."""
    routes: ClassVar[dict[str, tuple[Pair, ...]] | None] = None
    """State → a shortest path to it around the blocked edges, for :meth:`walk`."""
    call_timer: ClassVar[CallTimer | None] = None
    """Times every call into the driver (the runner sets it from ``call_timeout``); ``None``: calls are not timed."""
    limit: ClassVar[int | None] = None
    """Examples this class may run in all (the runner sets it from ``examples`` while Hypothesis runs): the
    example that reaches it ends the run by raising :class:`BudgetSpent` from its teardown, unless an example
    has failed (Hypothesis runs the failing one again to report it). Hypothesis' own ``max_examples`` counts
    valid examples only, and a stateful run has overrun and invalid ones too (100 asked, 143 ran). ``None``:
    no limit."""
    failed: ClassVar[bool] = False
    """Whether an example diverged or its driver failed; lifts :attr:`limit`."""
    on_example: ClassVar[Callable[[int], None] | None] = None
    """Called with each example's number as it starts (the CLI's progress)."""

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        self.clock = VirtualClock()
        self.story: list[str] = []
        self.moved: list[tuple[Move, ...]] = []
        """The transitions each story line made, line by line (``kvfsm inspect --story`` draws them)."""
        self.trace: list[tuple[str, tuple[object, ...]]] = []
        """Each step as (method, arguments): replaying it on a fresh machine repeats the example."""
        if cls.on_example is not None:
            cls.on_example(cls.coverage.examples + 1)
        factory = cls.driver_factory
        self.driver: ObservableDriver
        if isinstance(factory, Factory):  # counted and timed: a failure is the driver's, named, not a crash
            try:
                self.driver = factory.make(f"for example {cls.coverage.examples + 1}")
            except DriverError as exc:
                raise DriverFault(str(exc)) from None
        else:
            self.driver = factory()
        check_driver(cls.spec, self.driver)
        self.tracker = Tracker(cls.spec, self.driver, clock=self.clock, params=cls.params, threadsafe=False)
        self.model = self.new_model()
        self.given = begin_resources(cls.spec)
        self.can_fault = can_inject_faults(self.driver)
        if cls.blocked is None:
            cls.blocked = blocked_edges(cls.spec, self.driver)
        self.gives = callable(getattr(self.driver, "before_fire", None))
        self.faultable = frozenset(fault_targets(cls.spec))
        self._busy = False
        """Set while a step runs: a step that never finished leaves it set, and teardown then stays away."""
        self._diverged = False
        self.close_after: int | None = None
        """Steps after which the close rule is enabled in this example (None: it closes only at the end)."""
        outbox = getattr(self.driver, "outbox", None)
        self.outbox = outbox if isinstance(outbox, Outbox) else None
        """The driver's record of what it sends (:class:`~kvfsm.testing.contract.ReportsSends`), checked each step."""
        if self.outbox is not None:
            self.outbox.bind(self.tracker)
        self._ids: Counter[str] = Counter()
        """Fresh ids made so far, per space: the next one of space S is ``f"{S}-{n + 1}"``, so a message can name
        an id before the begin or event that links it (early)."""
        self._sender = "s0"
        """Who sends the next counted event (the ``hear`` rule draws it; other steps repeat the last)."""
        self._need = 1
        """The K a count gets where its payload gives it and the driver did not (drawn by the ``hear`` rule)."""
        self.messages = frozenset(cls.spec.event_decls) | {event for _state, event in cls.spec.counted()}
        """Events that are a peer's messages (declared under ``events:``, or counted): each arrival goes through
        the driver's ``receive``, if it has one."""
        cls.coverage.examples += 1

    def new_model(self) -> SpecModel:
        """The oracle this machine holds the Tracker to (a family's, for a spec that owns another machine)."""
        cls = type(self)
        return SpecModel(cls.spec, cls.params)

    # -- the steps -------------------------------------------------------------------

    def begin(self, key: str, fault: int | None = None, need: int | None = None) -> None:
        """``begin(key)``; ``fault``: make the fault-th action begin runs raise (see :meth:`arm`); ``need``: the K
        a count its payload gives gets, where the driver gives none (None: the last one drawn)."""
        if need is not None:
            self._need = need
        with self._step("begin", key, fault, self._need):
            # A caller takes what the initial state holds only for a begin that can succeed.
            live = self.model.state(key) is not None and not self.model.is_final(key)
            payload: Mapping[str, Any] = {}
            asks = self.given or (self.spec.begin_payload and hasattr(self.driver, "before_begin"))
            if asks and not live and not self.model.closed:
                payload = self._hook(f"begin {key}", "before_begin", key, self.given)
            if not live and not self.model.closed:
                payload = self._with_ids(BEGIN, self.spec.begin_payload, payload)
                payload = self._with_counts(payload, [w for k, w in self.model.count_sources() if k == "begin"])
            self.arm(self.model.begin_actions(key), fault)
            outcome = self.model.begin(key, payload)
            self._tell(begin_line(key, outcome), outcome)
            self._call(outcome, lambda: self.tracker.begin(key, **payload))

    def fire(self, key: str, event: str, fault: int | None = None) -> None:
        """``fire(key, event)``; ``fault``: make the fault-th action the transition runs raise.

        An edge the driver cannot take (:attr:`blocked`) is left alone: the step does nothing. Where the
        event is counted, every sender it waits for sends it (distinct senders, one step each), so that
        walks and random steps take the edge; the ``hear`` rule sends them one at a time, repeats included.
        """
        inst = None if self.model.closed else self.model.live.get(key)
        drawn = self.model.count_payload(inst.state, event, "", self._need) if inst is not None else {}
        need = self.model.need(inst, event, drawn) if inst is not None else None
        if need is None:
            self.hear(key, event, fault)
            return
        state = inst.state if inst is not None else None
        for i in range(max(need, 1)):
            self.hear(key, event, fault, f"q{i}")
            if self.model.state(key) != state:
                return

    def hear(
        self, key: str, event: str, fault: int | None = None, sender: str | None = None, need: int | None = None
    ) -> None:
        """One ``fire(key, event)`` step (one arrival, where the event is counted): from ``sender``, with K
        ``need`` where the arrival gives K (None: the last ones drawn). The trace records both, so a replay
        sends exactly what this step sent."""
        if sender is not None:
            self._sender = sender
        if need is not None:
            self._need = need
        state = None if self.model.closed else self.model.state(key)
        if state is not None and (state, event) in (self.blocked or {}):
            return
        with self._step("hear", key, event, fault, self._sender, self._need):
            payload, fault = self._fire_payload(key, state, event, fault)
            sender = self._from(state, event, payload)
            head = f"{event} {key}" + (f" from {sender}" if sender else "")
            if not self._receive(head, event, key, payload, lambda model: model.fire(key, event, payload)):
                return
            self.arm(self.model.fire_actions(key, event), fault)
            outcome = self.model.fire(key, event, payload)
            self._tell(fire_line(key, event, outcome, sender), outcome)
            self._apply("fire", outcome, lambda: self.tracker.fire(key, event, **payload))

    def deliver(self, event: str, ident: Hashable, sender: str | None = None, need: int | None = None) -> None:
        """A peer's message: ``deliver(event, ident)``, routed by the space the spec declares for ``event``.

        ``ident`` may be from that space or another, live, of an earlier
        generation, retired or never seen: the Tracker must apply it to the
        instance it names, or count it exactly as the model says. ``sender``
        and ``need`` are as for :meth:`hear`.
        """
        if sender is not None:
            self._sender = sender
        if need is not None:
            self._need = need
        space = self.spec.routed_by(event)
        key, _kind = self.model.resolve(space, ident)
        state = None if self.model.closed or key is None else self.model.state(key)
        if state is not None and (state, event) in (self.blocked or {}):
            return
        with self._step("deliver", event, ident, self._sender, self._need):
            named = str(ident) if key is None and space == self.spec.key else str(key)  # a key not begun yet: itself
            payload, _ = self._fire_payload(named, state, event, None)
            sender = self._from(state, event, payload)
            head = f"deliver {event} {ident!r} ({space})" + (f" from {sender}" if sender else "")
            if not self._receive(head, event, ident, payload, lambda model: model.deliver(event, ident, payload)):
                return
            outcome = self.model.deliver(event, ident, payload)
            self._tell(deliver_line(event, ident, space, outcome, sender), outcome)
            self._apply("deliver", outcome, lambda: self.tracker.deliver(event, ident, **payload))

    def _from(self, state: str | None, event: str, payload: Mapping[str, Any]) -> str:
        """Who sent an arrival of ``event``, where the spec counts it (``state`` None: a message kept for later)."""
        if "sender" not in payload:
            return ""
        counted = state is None or (state, event) in self.model.counted
        return str(payload["sender"]) if counted else ""

    def _receive(
        self,
        head: str,
        event: str,
        ident: Hashable,
        payload: Mapping[str, Any],
        spec: Callable[[SpecModel], Outcome],
    ) -> bool:
        """Hand a peer's message to the driver's ``receive`` (:class:`~kvfsm.testing.contract.ReceivesMessages`),
        if it has one and the event is a message; whether the message then goes on to the Tracker.

        A driver may keep from the Tracker only what the spec refuses anyway
        (an unknown, late or stale id, an ignored or illegal event, a repeat
        from a sender already heard); ``spec`` says, on a copy of the model,
        what the message would do. Dropping one the spec applies, counts or
        keeps for an id not yet known is a divergence.
        """
        hook = getattr(self.driver, "receive", None)
        if not callable(hook) or event not in self.messages:
            return True
        what = f"{type(self.driver).__name__}.receive({event!r}, {ident!r}, {dict(payload)!r})"
        try:
            handed = self._guarded(what, lambda: hook(event, ident, dict(payload)))
        except Exception as exc:
            self._tell(f"{head}: receive() raised", Outcome())
            self._diverge([f"receive({event!r}, {ident!r}, …) raised {type(exc).__name__}: {exc}"])
        if handed is not False:
            return True
        would = spec(self.model.clone())
        fate = _fate(would)
        self._tell(f"{head}: the driver's receive() dropped it", Outcome())
        if would.moves or (would.refused in ("counted", "kept") and would.anomaly != "duplicate"):
            self._diverge([f"the spec {fate}: a message must reach the Tracker"])
        return False

    def _fire_payload(
        self, key: str, state: str | None, event: str, fault: int | None
    ) -> tuple[Mapping[str, Any], int | None]:
        """The payload ``event`` carries from ``state`` (the driver's ``before_fire``, fresh ids for the spaces it
        links) and the fault still to arm (none when the caller took what the target holds)."""
        payload: Mapping[str, Any] = {}
        if state is None and event in self.model.early:  # kept for an id not yet known: as the initial state takes it
            state = self.spec.initial.name
        edge = self.spec.table.get((state, event)) if state is not None else None
        if edge is None:
            return payload, fault
        taken = caller_taken(self.spec, state, edge.target)
        if self.gives and (edge.transition.payload or taken):
            payload = self._hook(f"fire {key} {event}", "before_fire", key, event, taken)
            if taken:
                fault = None  # what the caller took for the target would outlive a transition that fails
        payload = self._with_ids(event, edge.transition.payload, payload)
        return {**self.model.count_payload(state, event, self._sender, self._need), **payload}, fault

    def _with_counts(self, payload: Mapping[str, Any], names: Sequence[int | str]) -> Mapping[str, Any]:
        """``payload`` with the drawn K under each count key ``names`` lists that the driver left out."""
        missing = [str(n) for n in names if str(n) not in payload]
        return {**payload, **dict.fromkeys(missing, self._need)} if missing else payload

    def _with_ids(self, at: str, carried: Sequence[str], payload: Mapping[str, Any]) -> Mapping[str, Any]:
        """``payload`` with a fresh id for each space linked at ``at`` that it may carry and the driver left out."""
        missing = [s for s in self.spec.linked_at(at) if s in carried and s not in payload]
        if not missing:
            return payload
        out = dict(payload)
        for space in missing:
            out[space] = self.next_id(space)
            self._ids[space] += 1
        return out

    def next_id(self, space: str) -> str:
        """The id the machine will give the next instance it links in ``space`` (when the driver gives none)."""
        return f"{space}-{self._ids[space] + 1}"

    def _apply(self, name: str, outcome: Outcome, call: Callable[[], str | None]) -> None:
        """Run an event's Tracker call: it returns the state the spec says, and a refused one changes nothing real."""
        before = self._observe_all() if outcome.refused else None
        got = self._call(outcome, call)
        if outcome.refused not in ("illegal", "closed") and not outcome.failures and got != outcome.state:
            self._diverge([f"{name}() returned {got!r}, the spec says {outcome.state!r}"])
        if before is not None:
            after = self._observe_all()
            changed = [f"{k}: {sorted(before[k])} → {sorted(after[k])}" for k in before if before[k] != after[k]]
            if changed:
                self._diverge([f"a refused event changed what observe says ({'; '.join(changed)})"])

    def advance(self, dt: float, fault: int | None = None) -> None:
        """Move the clock by ``dt`` and ``poll()``; ``fault``: make the fault-th action of a due timeout raise."""
        with self._step("advance", dt, fault):
            self.model.now = self.clock.advance(dt)
            self.arm(self.model.poll_actions(), fault)
            self._poll(dt, self.model.poll, self.tracker.poll)

    def _poll(self, dt: float, model: Callable[[], Outcome], tracker: Callable[[], object], name: str = "") -> None:
        """One ``poll()``: what the spec says (``model``), told as ``name``'s, then the Tracker's own (``tracker``)."""
        outcome = model()
        self._tell(f"{name}{poll_line(dt, outcome)}", outcome)
        got = self._call(outcome, tracker)
        if not outcome.failures and got != outcome.fired:
            self._diverge([f"poll() fired {got}, the spec says {outcome.fired}"])

    def step_to(self, dt: float | None, which: int) -> float:
        """``dt``, or (None) the clock step to the ``which``-th armed deadline (the first tick if none is armed)."""
        if dt is not None:
            return dt
        dues = sorted({due for _key, due, _phase, _event in self.model.deadlines()})
        if not dues:
            return _ticks(self.spec, type(self).params)[0]
        return _to(self.clock.now, dues[which % len(dues)])

    def arm(self, actions: Sequence[str], fault: int | None) -> None:
        """Tell the driver to make ``actions[fault]`` raise (the step about to run calls it).

        A fault is armed only for the step that consumes it, so a rarely
        called action is not left failing for the rest of the example.
        """
        if self.can_fault:
            self._arm_on(self.driver, self.model, [a for a in actions if a in self.faultable], fault)

    def _arm_on(self, driver: object, model: SpecModel, candidates: Sequence[str], fault: int | None) -> None:
        """:meth:`arm` for ``driver`` (one that injects faults) and its model: ``candidates`` are the actions
        the step runs that may be made to raise."""
        if fault is None or not candidates:
            return
        action = candidates[fault % len(candidates)]
        try:
            armed = self._guarded(
                f"{type(driver).__name__}.inject_fault({action!r})",
                lambda: driver.inject_fault(action),  # type: ignore[attr-defined]
            )
        except Exception as exc:
            self._tell(f"inject_fault({action!r})", Outcome())
            self._diverge([f"inject_fault({action!r}) raised {type(exc).__name__}: {exc}"])
        if armed is not False:  # False: this driver cannot make that action raise, so no failure is expected
            model.inject(action)

    def walk(self, key: str, state: str) -> None:
        """Begin ``key`` and fire the events of a shortest path to ``state`` (around edges the driver cannot take)."""
        cls = type(self)
        if cls.routes is None:
            cls.routes = routes(cls.spec, cls.blocked or {})
        path = cls.routes.get(state)
        if path is None:
            return
        self.begin(key)
        for _source, event in path:
            self.fire(key, event)

    def _hook(self, where: str, name: str, *args: object) -> Mapping[str, Any]:
        """Call the driver's ``before_begin``/``before_fire``; what it returns, if a mapping, is the payload."""
        hook = getattr(self.driver, name)
        try:
            got = self._guarded(f"{type(self.driver).__name__}.{name}{args!r}", lambda: hook(*args))
        except Exception as exc:
            self._tell(where, Outcome())
            shown = ", ".join(map(repr, args[:-1]))
            self._diverge([f"{name}({shown}, …) raised {type(exc).__name__}: {exc}"])
        return got if isinstance(got, Mapping) else {}

    def drain(self) -> None:
        with self._step("drain"):
            outcome = self.model.drain()
            self._tell(drain_line(outcome), outcome)
            got = self._call(outcome, self.tracker.finished)
            if not _same_drain(got, outcome):
                self._diverge([f"finished() returned {got}, the spec says {outcome.drained}"])

    def close(self, name: str = "close") -> None:
        """``close()``: abort what is live, release by force what abort cannot finish, leave nothing held.

        Closing an already closed tracker must do nothing; after close the
        invariant holds ``observe`` to nothing held for every key.
        """
        with self._step(name):
            again = self.model.closed
            outcome = self.model.close()
            if not again:
                self.coverage.closes += 1
                if name == "close":
                    self.coverage.mid_example_closes += 1
            self._tell(close_line(outcome, again), outcome)
            self._call(outcome, self.tracker.close)

    def teardown(self) -> None:
        """Every example ends with ``close()`` (again, if a rule closed already: it must be a no-op)."""
        if self._diverged:
            return  # a failure: leave its story as it is
        if not self._busy:  # else a step was cut short (Hypothesis stopping it): nothing to close cleanly
            self.close("teardown")
            self.agrees_with_spec()
        cls = type(self)
        if cls.limit is not None and cls.coverage.examples >= cls.limit and not cls.failed:
            # at the end of an example, after all its draws: Hypothesis sees nothing amiss
            raise BudgetSpent("every example asked for has run")

    @contextmanager
    def _step(self, name: str, *args: object) -> Iterator[None]:
        """Records the step (for replay) and marks it in progress; an exception leaves the mark."""
        self.trace.append((name, args))
        self._busy = True
        yield
        self._busy = False

    # -- the checks --------------------------------------------------------------------

    @invariant()
    def agrees_with_spec(self) -> None:
        """The Tracker's view equals the model's; every key's real resources equal what the spec says it holds."""
        problems: list[str] = [str(m) for m in self.outbox.misaddressed()] if self.outbox is not None else []
        model, tracker = self.model, self.tracker
        for key in self.keys:
            state, got = model.state(key), tracker.state(key)
            if got != state:
                problems.append(f"Tracker says {key} is in {got!r}, the spec says {state!r}")
            if tracker.held(key) != model.held(key):
                problems.append(
                    f"Tracker says {key} holds {list(tracker.held(key))}, the spec says {list(model.held(key))}"
                )
            if tracker.ids(key) != model.ids(key):
                problems.append(f"Tracker links {key} to {tracker.ids(key)}, the spec says {model.ids(key)}")
            problems += self._reality(key, state)
        diff = {k: (tracker.counts.get(k), v) for k, v in model.counts.items() if tracker.counts.get(k) != v}
        if diff:
            problems.append(f"Tracker counts (got, spec) differ: {diff}")
        anomalies = [  # a misaddressed send is the driver's doing, told above from the outbox's own record
            (a.kind, a.space, a.id, a.event) for a in tracker.anomalies() if a.kind != "misaddressed"
        ]
        expected, model.anomalies = model.anomalies, []
        if Counter(anomalies) != Counter(expected):  # close() visits keys in an order the spec leaves open
            problems.append(f"Tracker reported anomalies {anomalies}, the spec says {expected}")
        if tracker.live() != model.live_count():
            problems.append(f"Tracker says {tracker.live()} live, the spec says {model.live_count()}")
        if tracker.next_deadline() != model.next_deadline():
            problems.append(f"next deadline is {tracker.next_deadline()}, the spec says {model.next_deadline()}")
        if problems:
            self._diverge(problems)

    def _reality(
        self, key: str, state: str | None, driver: ObservableDriver | None = None, model: SpecModel | None = None
    ) -> list[str]:
        """What observe(key) says against what the spec says ``key`` holds in ``state``.

        A driver whose ``observe`` returns names is compared by name; one that returns counts
        (``{"block_pin": 2}``) is compared unit by unit, so a pin taken twice but counted once is caught.
        ``driver`` and ``model``: another machine's (an owned one), instead of this machine's.
        """
        driver = driver if driver is not None else self.driver
        model = model if model is not None else self.model
        try:
            raw: Iterable[str] | Mapping[str, int] = self._guarded(
                f"{type(driver).__name__}.observe({key!r})", lambda: driver.observe(key)
            )
            counted = isinstance(raw, Mapping)
            seen = Counter({r: int(n) for r, n in raw.items() if n}) if isinstance(raw, Mapping) else Counter(set(raw))
        except Exception as exc:
            return [f"observe({key!r}) raised {type(exc).__name__}: {exc}"]
        want = Counter(model.held(key))
        if not counted:
            want = Counter(set(want))
        where = f"{key} is {state}" if state is not None else f"{key} has no instance"
        says = f"{where}, which holds {_units(want)}" if want else f"{where}, which holds nothing"
        if seen == want:
            return []
        if counted:
            return [f"observe says {key} holds {_units(seen) or 'nothing'} ({says})"]
        out = []
        extra, missing = sorted(seen - want), sorted(want - seen)
        if extra:
            out.append(f"observe says {', '.join(extra)} still held by {key} ({says})")
        if missing:
            out.append(f"observe says {', '.join(missing)} not held by {key} ({says})")
        return out

    def _observe_all(self) -> dict[str, frozenset[str]]:
        try:
            return {k: frozenset(self._observe(k)) for k in self.keys}
        except Exception:
            return {}  # the invariant reports observe() raising

    def _tell(self, line: str, outcome: Outcome) -> None:
        self.story.append(f"{clock(self.clock.now)} {line}")
        self.moved.append(tuple(outcome.moves))
        self.coverage.record(outcome)
        self.coverage.steps += 1

    def _observe(self, key: str) -> Iterable[str]:
        """``driver.observe(key)``, timed."""
        return self._guarded(f"{type(self.driver).__name__}.observe({key!r})", lambda: self.driver.observe(key))

    def _guarded(self, what: str, call: Callable[[], T]) -> T:
        """Make one call that runs driver code under the call timer; a hang ends the run as the driver's fault."""
        timer = type(self).call_timer
        if timer is None:
            return call()
        try:
            with timer.call(what, self.driver):
                return call()
        except CallTimeout as exc:
            self._driver_failed(str(exc))

    def _driver_failed(self, problem: str) -> NoReturn:
        """End the run on a driver failure (not a divergence: nothing to shrink), with the story so far."""
        self._diverged = True  # teardown must not call into the driver again
        type(self).failed = True
        story = list(self.story) or ["(before any step)"]
        story[-1] = f"{story[-1]}; {problem}"
        raise DriverFault(problem, story, self.trace, self.moved)

    def _call(self, outcome: Outcome, call: Callable[[], T]) -> T | None:
        """Run one Tracker call; only what the spec predicts may come out of it."""
        try:
            result = self._guarded("a Tracker call of this step (it runs the driver's actions)", call)
        except TrackerClosed as exc:
            if outcome.refused != "closed":
                self._diverge([f"TrackerClosed escaped though the tracker was not closed: {exc}"])
            return None
        except DuplicateKey as exc:
            if outcome.refused != "duplicate":
                self._diverge([f"DuplicateKey escaped: {exc}"])
            return None
        except IllegalTransition as exc:
            if outcome.refused != "illegal":
                self._diverge([f"IllegalTransition escaped: {exc}"])
            if (exc.state, set(exc.accepted)) != (outcome.state, self.accepted(exc.state)):
                self._diverge([f"IllegalTransition names state {exc.state!r} accepting {sorted(exc.accepted)}"])
            return None
        except ActionError as exc:
            want = [f.as_tuple() for f in outcome.failures]
            if not want:
                told = "; ".join(map(_failure, exc.failures))
                self._diverge([f"ActionError escaped though no fault was injected: {told}"])
            got = [(str(f.key), f.event, f.action, f.phase, f.state) for f in exc.failures]
            if got != want:
                unexplained = [_failure(f) for f, g in zip(exc.failures, got, strict=True) if g not in want]
                missing = [w for w in want if w not in got]
                problem = "ActionError carried " + (
                    f"what no injected fault explains: {'; '.join(unexplained)}"
                    if unexplained
                    else "; ".join(map(_failure, exc.failures))
                )
                self._diverge([problem + (f"; the spec expects {missing}" if missing else "")])
            return None
        except SpecViolation:
            raise
        except Exception as exc:
            self._diverge([f"{type(exc).__name__} escaped: {exc}"])
        if outcome.failures:
            faults = ", ".join(f"{f.action}() on {f.event} {f.key}" for f in outcome.failures)
            self._diverge([f"no ActionError, but the injected fault should have made {faults} raise"])
        if outcome.refused == "illegal":
            self._diverge(["no IllegalTransition, but the spec neither handles nor ignores this event here"])
        if outcome.refused == "duplicate":
            self._diverge(["no DuplicateKey, but the key's instance is live"])
        if outcome.refused == "closed":
            self._diverge([f"no TrackerClosed, but the tracker is closed (the call returned {result!r})"])
        return result

    def accepted(self, state: str) -> set[str]:
        """The events ``state`` handles or ignores, of the machine whose step is running."""
        return self.model.accepted(state)

    def _diverge(self, problems: list[str]) -> NoReturn:
        self._diverged = True
        type(self).failed = True
        story = list(self.story) or ["(before any step)"]
        story[-1] = f"{story[-1]}; " + "; ".join(problems)
        raise SpecViolation(self.spec.name, story, problems, self.trace, self.moved)


def _same_drain(got: list[tuple[Hashable, str]] | None, outcome: Outcome) -> bool:
    """``finished()`` as the spec says: in order, except those close() finished, in any order at the end."""
    if got is None:
        return False
    cut = len(outcome.drained) - outcome.unordered
    return got[:cut] == outcome.drained[:cut] and Counter(got[cut:]) == Counter(outcome.drained[cut:])


def _events(spec: Spec) -> tuple[str, ...]:
    """Every event the spec names, in transitions and in ignore rules."""
    return tuple(dict.fromkeys([*spec.events, *(e for rule in spec.ignore for e in rule.events)]))


def _fate(would: Outcome) -> str:
    """What the spec does with a message, in words: ``applies it (read req-1: held → read)``, ``keeps it …``."""
    if would.moves:
        m = would.moves[0]
        return f"applies it ({m.event} {m.key}: {m.source} → {m.target})"
    if would.refused == "kept":
        return "keeps it until its id appears (early)"
    if would.refused == "counted":
        if would.anomaly == "duplicate":
            return "counts it as a repeat from a sender already heard"
        return "counts it towards the transition's K senders"
    if would.refused == "unknown":
        return f"counts it as {would.anomaly or 'unknown'} and applies nothing"
    return f"refuses it ({would.refused or 'nothing to do'})"


def _to(now: float, due: float) -> float:
    """The clock step from ``now`` that lands on ``due`` (or just past it: never an ulp short of it)."""
    step = max(due - now, 0.0)
    while now + step < due:
        step = math.nextafter(step, math.inf)
    return step


def _ticks(spec: Spec, params: Mapping[str, float] | None) -> tuple[float, ...]:
    """Clock steps that land on deadlines (a state's or a phase's), halfway to them and past them."""
    afters = {spec.param(s.timeout.after, params) for s in spec.states.values() if s.timeout is not None}
    afters |= {spec.param(p.timeout.after, params) for p in spec.phases.values()}
    if not afters:
        return (1.0,)
    return tuple(sorted(afters | {a / 2 for a in afters}))


def _pick(movable: list[tuple[Hashable, list[str]]], which: int, choice: int) -> tuple[str, str]:
    key, events = movable[which % len(movable)]
    return str(key), events[choice % len(events)]  # the machine's keys are its names, strings


def spec_machine(
    spec: Spec | str | Path,
    driver_factory: DriverFactory | Factory,
    *,
    params: Mapping[str, float] | None = None,
    keys: int = KEYS,
    steer: bool = True,
    owned: tuple[Spec | str | Path, OwnedFactory | Factory] | None = None,
) -> type[SpecMachine]:
    """A Hypothesis state machine testing the drivers ``driver_factory`` makes against ``spec``.

    >>> TestMyDriver = spec_machine("specs/kv_request.yaml", MyDriver).TestCase

    ``spec`` is a :class:`Spec` or a path (loaded and checked); ``params``
    override the spec's (the clock is virtual, so the spec's own are fine);
    ``keys`` is how many distinct keys one example uses; ``steer=False``
    drops the planned prefixes, leaving a plain random walk from ``begin``.

    ``owned``: the spec and driver factory of the machine ``spec`` owns
    (``owns:``); the machine is then a
    :class:`~kvfsm.testing.family.FamilyMachine`, testing both drivers and
    the family rules together.
    """
    if not isinstance(spec, Spec):
        spec = load(spec)
    child_spec = None
    if owned is not None:
        child_spec = owned[0] if isinstance(owned[0], Spec) else load(owned[0])
        if not any(o.machine == child_spec.name for o in spec.owns.values()):
            raise BindingError(
                f"machine {spec.name!r} does not own instances of {child_spec.name!r} "
                f"(it owns: {', '.join(o.machine for o in spec.owns.values()) or 'nothing'})"
            )
    events = _events(spec)
    faults = fault_targets(spec)
    ticks = _ticks(spec, params)
    unknown = sorted(set(params or ()) - set(spec.params))
    if unknown:
        raise BindingError(
            f"params {', '.join(map(repr, unknown))} are not declared by machine {spec.name!r} "
            f"(declared: {', '.join(spec.params) or 'none'})"
        )

    names = tuple(f"req-{i}" for i in range(1, keys + 1))
    key = st.sampled_from(names)

    model = SpecModel(spec, params)
    begin_faults = bool(model.begin_acquires) and bool(faults)
    timeout_faults = any(
        a in faults
        for state in spec.live
        for t in spec.timeouts(state)
        if (state, t.fire) in model.edges
        for a in model.edges[state, t.fire].prepare_actions
    )

    declared = tuple(spec.event_decls)
    counting = bool(spec.counted())
    deep = tuple(s for s in spec.live if s != spec.initial.name) if steer else ()
    """Live states a planned prefix may walk a key to."""

    from .family import FamilyMachine

    base: type[SpecMachine] = SpecMachine if child_spec is None else FamilyMachine
    if child_spec is not None:
        child_names = tuple(f"{child_spec.name}-{i}" for i in range(1, keys + 1))
        child_key = st.sampled_from(child_names)
        child_events = _events(child_spec)
        child_model = SpecModel(child_spec)
        child_begin_faults = bool(child_model.begin_acquires) and bool(fault_targets(child_spec))
        child_ticks = _ticks(child_spec, None)

    class Machine(base):  # type: ignore[valid-type,misc]
        @rule(key=key, fault=st.integers(0, 7) if begin_faults else st.just(0))
        def begin_key(self, key: str, fault: int) -> None:
            """A new key, a finished one again (drained or not), or a live one (DuplicateKey).

            One begin in eight has an acquire action made to raise (when the initial state has one).
            """
            self.begin(key, fault if fault == 7 else None)

        @rule(key=key, event=st.sampled_from(events))
        def fire_event(self, key: str, event: str) -> None:
            """Any event at any key: legal, ignored, illegal, or for no instance at all."""
            self.fire(key, event)

        @precondition(lambda self: bool(self.model.movable()))
        @rule(which=st.integers(0, 15), choice=st.integers(0, 15))
        def take_a_transition(self, which: int, choice: int) -> None:
            """An event the spec handles, at a live instance: how examples get deep into the machine."""
            key, event = _pick(self.model.movable(), which, choice)
            self.fire(key, event)

        if faults:

            @precondition(lambda self: self.can_fault and bool(self.model.movable(self.faultable)))
            @rule(which=st.integers(0, 15), choice=st.integers(0, 15), nth=st.integers(0, 3))
            def take_a_transition_whose_action_raises(self, which: int, choice: int, nth: int) -> None:
                """A handled event whose do or acquire action is made to raise: the on_error path."""
                key, event = _pick(self.model.movable(self.faultable), which, choice)
                self.fire(key, event, fault=nth)

        if declared:

            @rule(event=st.sampled_from(declared), pick=st.integers(0, 255))
            def deliver_a_message_naming_any_id(self, event: str, pick: int) -> None:
                """A peer's message naming an id of its space or another, live, stale, retired, never seen, or the
                next one the machine will link (a key not begun yet, for the key's space): early, if declared so."""
                space = self.spec.routed_by(event)
                ahead = (
                    [k for k in self.keys if self.model.state(k) is None]
                    if space == self.spec.key
                    else [self.next_id(space)]
                )
                ids = [*self.model.known_ids(space), *ahead]
                self.deliver(event, ids[pick % len(ids)])

            @precondition(lambda self: bool(self.model.deliverable()))
            @rule(which=st.integers(0, 15))
            def deliver_a_message_to_a_live_instance(self, which: int) -> None:
                """A peer's message naming a live instance by the id of the space the spec routes it by."""
                options = self.model.deliverable()
                self.deliver(*options[which % len(options)])

        if counting:

            @precondition(lambda self: bool(self.model.countable()))
            @rule(which=st.integers(0, 15), sender=st.integers(0, 2), need=st.integers(0, 3))
            def hear_a_counted_event(self, which: int, sender: int, need: int) -> None:
                """A counted event at an instance waiting for it, from one of three senders (repeats included),
                with a drawn K where its payload gives K."""
                options = self.model.countable()
                key, event = options[which % len(options)]
                self.hear(str(key), event, None, f"s{sender}", need)

        @rule(dt=st.sampled_from((*ticks, None)), which=st.integers(0, 15))
        def advance_clock_and_poll(self, dt: float | None, which: int) -> None:
            """Move the clock by a deadline's after (or half of one), or (``dt`` None) exactly to one armed
            deadline, a state's or a phase's: a phase's falls due at its entry plus its after, whatever moves
            inside it and self-loops came since."""
            self.advance(self.step_to(dt, which))

        if timeout_faults:

            @precondition(lambda self: self.can_fault)
            @rule(dt=st.sampled_from((*ticks, None)), which=st.integers(0, 15), nth=st.integers(0, 3))
            def advance_clock_and_poll_with_a_raising_action(self, dt: float | None, which: int, nth: int) -> None:
                self.advance(self.step_to(dt, which), fault=nth)

        @rule()
        def drain_finished(self) -> None:
            self.drain()

        if deep:

            @initialize(key=key, start=st.integers(0, 2 * len(deep) - 1))
            def start_from_a_planned_prefix(self, key: str, start: int) -> None:
                """In one example in two, begin a key and walk it to a live state by a shortest path, before
                the random steps: the deep states and their edges get as many random steps as the shallow ones."""
                if start < len(deep):
                    self.walk(key, deep[start])

        @initialize(roll=st.integers(0, CLOSE_MID_EXAMPLE - 1), after=st.integers(1, 30))
        def decide_whether_to_close_mid_example(self, roll: int, after: int) -> None:
            """Not a step: lets one example in CLOSE_MID_EXAMPLE close the tracker once, after ``after`` steps."""
            self.close_after = after if roll == 0 else None

        @precondition(
            lambda self: self.close_after is not None and len(self.trace) >= self.close_after and not self.model.closed
        )
        @rule()
        def close_the_tracker(self) -> None:
            """``close()`` mid-example: the rest of the example checks that a closed tracker refuses all work."""
            self.close()

        if child_spec is not None:

            @rule(key=child_key, parent=key, fault=st.integers(0, 7) if child_begin_faults else st.just(0))
            def begin_an_owned_instance(self, key: str, parent: str, fault: int) -> None:
                """An owned instance naming a parent that is live, ended or never begun (UnknownParent)."""
                self.begin_child(key, parent, fault if fault == 7 else None)

            @rule(key=child_key, event=st.sampled_from(child_events))
            def fire_an_owned_event(self, key: str, event: str) -> None:
                self.fire_child(key, event)

            @precondition(lambda self: bool(self.model.child.movable()))
            @rule(which=st.integers(0, 15), choice=st.integers(0, 15), nth=st.integers(0, 7))
            def take_an_owned_transition(self, which: int, choice: int, nth: int) -> None:
                """An event an owned instance handles; one in four with its do or acquire made to raise (where the
                driver injects faults): one child failing while the others are still in flight, the case a
                family exists for; one in eight with an action it causes on the parent made to raise."""
                if nth >= 6 and self.child_faults and self.model.child.movable(self.child_faults):
                    key, event = _pick(self.model.child.movable(self.child_faults), which, choice)
                    self.fire_child(key, event, nth - 6)
                else:
                    key, event = _pick(self.model.child.movable(), which, choice)
                    self.fire_child(key, event, None, 0 if nth == 5 else None)

            @rule(dt=st.sampled_from((*child_ticks, None)), which=st.integers(0, 15))
            def advance_clock_and_poll_owned(self, dt: float | None, which: int) -> None:
                """Move the clock (to an owned instance's deadline, or by one of its afters) and poll the owned
                tracker."""
                self.poll_children(self.step_to_child(dt, which))

            @rule()
            def drain_finished_owned(self) -> None:
                self.drain_children()

    name = "".join(part.title() for part in re.split(r"[^0-9A-Za-z]+", spec.name) if part) or "Spec"
    Machine.__name__ = Machine.__qualname__ = f"{name}Machine"
    Machine.spec = spec
    Machine.driver_factory = driver_factory if isinstance(driver_factory, Factory) else staticmethod(driver_factory)
    Machine.params = dict(params) if params else None
    Machine.keys = names
    Machine.coverage = Coverage(spec)
    if child_spec is not None:
        assert owned is not None and issubclass(Machine, FamilyMachine)
        Machine.child_spec = child_spec
        child_factory = owned[1]
        Machine.child_factory = child_factory if isinstance(child_factory, Factory) else staticmethod(child_factory)
        Machine.child_keys = child_names
        Machine.child_coverage = Coverage(child_spec)
    return Machine


__all__ = [
    "KEYS",
    "DriverFactory",
    "SpecMachine",
    "SpecViolation",
    "VirtualClock",
    "begin_resources",
    "check_driver",
    "fault_targets",
    "spec_machine",
]


def _units(held: Counter[str]) -> str:
    """``block_pin ×2, queue_task``: a resource held more than once says how many times."""
    return ", ".join(r if n == 1 else f"{r} ×{n}" for r, n in sorted(held.items()) if n)
