"""Model-based tests of a family: a machine that owns instances of another (``owns:``), both with real drivers.

:func:`~kvfsm.testing.machine.spec_machine` builds a :class:`FamilyMachine`
when it is given the owned machine's spec and driver factory. The parent
runs every rule of a single machine; the child adds its own steps (begin
naming any parent, live, ended or never begun; fire; a raising action;
poll; drain; close), and every step is held to
:class:`~kvfsm.testing.family_oracle.FamilyModel`, which says what both
trackers and both drivers must show afterwards: each key's state and what
it holds, each parent's live children, and each driver's ``observe``. The
events the engine fires on the parent (``ended``, ``failed``) are never
fired by the test, only caused.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

from ..engine import Tracker
from ..errors import UnknownParent
from ..spec import Spec
from .calls import DriverError, DriverFault, Factory
from .contract import ObservableDriver, OwnedFactory, can_inject_faults
from .cover import Pair, Plan, TraceStep, routes
from .coverage import Coverage
from .family_oracle import FamilyModel
from .machine import SpecMachine, _same_drain, _to, check_driver, fault_targets
from .oracle import Outcome, SpecModel
from .story import _move, _moves_and_faults, begin_line, clock, close_line, drain_line, fire_line


def engine_edges(spec: Spec) -> dict[tuple[str, str], str]:
    """``(state, event) → why`` for the parent's edges on ``ended`` and ``failed``: the engine fires them."""
    out = {}
    for rule in spec.owns.values():
        for event in (rule.ended, rule.failed):
            for e in spec.edges():
                if e.event == event:
                    out[e.source, e.event] = (
                        f"fired by the engine when the {rule.name} it owns end (owns: {rule.name}); "
                        "the test causes it, never fires it"
                    )
    return out


def with_children(machine: type[FamilyMachine], plan: Plan) -> Plan:
    """``plan`` (the parent's path cover) with one owned instance begun right after each parent's begin.

    A state that waits for the children (``ended``) is left at once when none is live, so a plan of the parent
    alone could not stay in it to take its edges; with one child live it stays until the child ends.
    """
    steps: list[TraceStep] = []
    for name, args in plan.steps:
        steps.append((name, args))
        if name == "begin":
            key = args[0]
            steps.append(("begin_child", (machine.child_keys[machine.keys.index(str(key))], key, None)))
    return Plan(plan.goal, tuple(steps))


def family_cover(
    machine: type[FamilyMachine],
    blocked: Collection[Pair],
    child_faults: Collection[str],
    parent_faults: Collection[str],
) -> list[Plan]:
    """Planned examples of what a family exists for: children failing, one while another is still in flight.

    For each live state of the parent (reached around ``blocked``) and each edge of the child with an action
    ``child_faults`` may make raise: begin a parent and two children, walk the parent to its state and the first
    child to the edge's source, take the edge with the action raising, then walk the second child to a final
    state; the parent must hold what it holds until the second has let go. Then each event the parent handles
    or ignores where that left it, with the second child still in flight. And for each child edge into a failure
    state, with the parent's only child: take it bare, and with each action it causes on the parent (``failed``,
    ``ended``) made to raise (``parent_faults``); the parent must still end once its child has.
    """
    spec, child = machine.spec, machine.child_spec
    parent_routes, child_routes = routes(spec, blocked), routes(child)
    model = SpecModel(child)
    key, first, second = machine.keys[0], machine.child_keys[0], machine.child_keys[1]
    ends = [s for s in child.states.values() if s.final == "success" and s.name in child_routes]
    rest = [("fire_child", (second, ev, None, None)) for _s, ev in child_routes.get(ends[0].name, ())] if ends else []
    plans, seen = [], set()

    def walk(state: str, source: str, children: tuple[str, ...]) -> list[TraceStep]:
        return [
            ("begin", (key, None)),
            *(("begin_child", (c, key, None)) for c in children),
            *(("fire", (key, ev, None)) for _s, ev in parent_routes[state]),
            *(("fire_child", (first, ev, None, None)) for _s, ev in child_routes[source]),
        ]

    for state in (s for s in spec.live if s in parent_routes):
        for (source, event), edge in model.edges.items():
            if source not in child_routes:
                continue
            actions = [a for a in edge.prepare_actions if a in child_faults]
            for nth, action in enumerate(actions):
                steps = [*walk(state, source, (first, second)), ("fire_child", (first, event, nth, None))]
                goal = f"{key} {state} while {first} fails at {action}() on {event} and {second} is in flight"
                plans.append(Plan(goal, (*steps, *rest)))
                after = _replay(machine, steps, child_faults, parent_faults).state(key)
                for ev in sorted(_events_at(spec, after, blocked)):
                    if after is not None and (after, ev) not in seen:
                        seen.add((after, ev))
                        goal = f"{ev} at {key} {after} while {second} is in flight"
                        plans.append(Plan(goal, (*steps, ("fire", (key, ev, None)), *rest)))
            if child.states[edge.target].final != "failure":
                continue
            steps = walk(state, source, (first,))
            caused = [
                c.action
                for c in _replay(machine, steps, child_faults, parent_faults).fire_child(first, event).calls
                if c.key == key and c.action in parent_faults
            ]
            plans.append(
                Plan(
                    f"{key} {state} as its only child {first} ends {edge.target}",
                    (*steps, ("fire_child", (first, event, None, None))),
                )
            )
            for nth, action in enumerate(caused):
                goal = f"{key} {state} as its only child {first} ends {edge.target} and {key}'s {action}() raises"
                plans.append(Plan(goal, (*steps, ("fire_child", (first, event, None, nth)))))
    # A state the engine's ``ended`` enters is reached from a state that takes it: walked there with a child in
    # flight that then ends (a state that waits is reached only so; on the way, ``ended`` would fire early), or
    # entered with no child live. From there, each event it handles or ignores.
    ended = next(o.ended for o in spec.owns.values() if o.machine == child.name)
    finish: list[TraceStep] = (
        [("fire_child", (first, ev, None, None)) for _s, ev in child_routes.get(ends[0].name, ())] if ends else []
    )
    for state in parent_routes:
        if (state, ended) not in spec.table:
            continue
        route: list[TraceStep] = [("fire", (key, ev, None)) for _s, ev in parent_routes[state]]
        bare: list[TraceStep] = [("begin", (key, None))]
        for steps in (
            [*bare, ("begin_child", (first, key, None)), *route, *finish],
            [*bare, *route],
        ):
            after = _replay(machine, steps, child_faults, parent_faults).state(key)
            events = _events_at(spec, after, blocked) | {ev for s, ev, _r in spec.ignored() if s == after}
            for ev in sorted(events):
                if after is not None and (after, ev) not in seen:
                    seen.add((after, ev))
                    goal = f"{ev} at {key} {after}, its children ended"
                    plans.append(Plan(goal, (*steps, ("fire", (key, ev, None)))))
    return plans


def _replay(
    machine: type[FamilyMachine], steps: list[TraceStep], child_faults: Collection[str], parent_faults: Collection[str]
) -> FamilyModel:
    """The family's oracle after ``steps``, with the faults the machine would arm for them."""
    model = FamilyModel(machine.spec, machine.child_spec, machine.params)
    for name, args in steps:
        if name == "begin":
            model.begin(args[0], {})
        elif name == "fire":
            model.fire(args[0], str(args[1]))
        elif name == "begin_child":
            model.begin_child(args[0], {model.rule.by: args[1]})
        elif name == "fire_child":
            key, event, fault, parent_fault = (str(args[0]), str(args[1]), args[2], args[3])
            wanted = parent_faults if isinstance(parent_fault, int) else None
            mine, theirs = _candidates(model, machine.keys, key, event, child_faults, wanted)
            if isinstance(parent_fault, int) and theirs:
                model.inject(theirs[parent_fault % len(theirs)])
            if isinstance(fault, int) and mine:
                model.child.inject(mine[fault % len(mine)])
            model.fire_child(key, event)
    return model


def _candidates(
    model: FamilyModel,
    parents: Collection[str],
    key: str,
    event: str,
    child_faults: Collection[str],
    parent_faults: Collection[str] | None,
) -> tuple[list[str], list[str]]:
    """The actions ``fire_child(key, event)`` would run that may be made to raise, in the order a fault's index
    picks from: the child's own, and (``parent_faults`` not None) the parent's that it causes (``failed``,
    ``ended``)."""
    mine = [a for a in model.child.fire_actions(key, event) if a in child_faults]
    theirs = []
    if parent_faults is not None:
        caused = [c.action for c in model.clone().fire_child(key, event).calls if c.key in parents]
        theirs = [a for a in caused if a in parent_faults]
    return mine, theirs


def _events_at(spec: Spec, state: str | None, blocked: Collection[Pair]) -> set[str]:
    """The events ``state`` handles (not behind a blocked edge) or ignores."""
    if state is None or spec.states[state].is_final:
        return set()
    handled = {e.event for e in spec.edges() if e.source == state and (state, e.event) not in blocked}
    return handled | {event for s, event, _rule in spec.ignored() if s == state}


class FamilyMachine(SpecMachine):
    """A :class:`SpecMachine` for a spec that owns another machine: the parent's rules, the child's, one oracle."""

    child_spec: ClassVar[Spec]
    child_factory: ClassVar[OwnedFactory | Factory]
    """Makes the owned machine's driver of an example, given the parent's driver of the same example."""
    child_keys: ClassVar[tuple[str, ...]]
    child_coverage: ClassVar[Coverage]
    """The owned machine's coverage, summed over every example."""
    model: FamilyModel

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        factory = cls.child_factory
        if isinstance(factory, Factory):
            try:
                self.child_driver: ObservableDriver = factory.make(f"for example {cls.coverage.examples}", self.driver)
            except DriverError as exc:
                raise DriverFault(str(exc)) from None
        else:
            self.child_driver = factory(self.driver)
        check_driver(cls.child_spec, self.child_driver)
        self.child_tracker = Tracker(
            cls.child_spec, self.child_driver, clock=self.clock, threadsafe=False, parent=self.tracker
        )
        self.child_faults = frozenset(fault_targets(cls.child_spec)) if can_inject_faults(self.child_driver) else ()
        self._own = False
        """Set while a child step runs: its outcome is the child's, what it caused in the parent is the parent's."""

    def new_model(self) -> SpecModel:
        cls = type(self)
        return FamilyModel(cls.spec, cls.child_spec, cls.params)

    # -- the child's steps -----------------------------------------------------------

    def begin_child(self, key: str, parent: str, fault: int | None = None) -> None:
        """``begin`` on the child tracker, naming ``parent`` as its owner (live, ended, or never begun)."""
        with self._step("begin_child", key, parent, fault), self._as_child():
            model = self.model
            payload = {**self._child_payload(key), model.rule.by: parent}
            if model.orphan(key, payload) is None:  # an orphan runs nothing: no fault to arm
                self._arm_on(self.child_driver, model.child, self._faultable(model.child.begin_actions(key)), fault)
            outcome = model.begin_child(key, payload)
            name = self.child_spec.name
            if outcome.refused == "orphan":
                where = "has no instance" if outcome.state is None else f"has ended ({outcome.state})"
                self._tell(f"{name} begin {key} by {parent}: {parent} {where} (UnknownParent, nothing begun)", outcome)
                try:
                    self._guarded("a Tracker call of this step", lambda: self.child_tracker.begin(key, **payload))
                except UnknownParent:
                    return
                except Exception as exc:
                    self._diverge([f"{type(exc).__name__} escaped where UnknownParent was due: {exc}"])
                self._diverge([f"no UnknownParent, though {parent} {where}"])
            self._tell(f"{name} {begin_line(key, outcome)} (by {parent})", outcome)
            self._call(outcome, lambda: self.child_tracker.begin(key, **payload))

    def _child_payload(self, key: str) -> dict[str, Any]:
        """The rest of a child's ``begin`` payload, from its driver's ``before_begin`` (as a single machine's):
        which prefill rank a READ reads, say. Its owner (``by``) is the step's to choose."""
        hook = getattr(self.child_driver, "before_begin", None)
        extra = set(self.child_spec.begin_payload) - {self.model.rule.by}
        if not extra or hook is None:
            return {}
        given = hook(key, frozenset(self.child_spec.initial.holds))
        return dict(given) if isinstance(given, Mapping) else {}

    def fire_child(self, key: str, event: str, fault: int | None = None, parent_fault: int | None = None) -> None:
        """``fire`` on the child tracker; ``fault``: make the fault-th action the transition runs raise;
        ``parent_fault``: the fault-th action of the parent's that the step causes (``failed``, ``ended``)."""
        with self._step("fire_child", key, event, fault, parent_fault), self._as_child():
            model = self.model
            wanted = self.faultable if parent_fault is not None and self.can_fault else None
            mine, theirs = _candidates(model, self.keys, key, event, self.child_faults, wanted)
            self._arm_on(self.driver, model, theirs, parent_fault)
            self._arm_on(self.child_driver, model.child, mine, fault)
            outcome = model.fire_child(key, event)
            line = fire_line(key, event, outcome)
            if any(f.key != key for f in outcome.failures):  # a parent's action raised: tell each in its place
                line = "; ".join(_moves_and_faults(outcome))
            self._tell(f"{self.child_spec.name} {line}", outcome)
            self._apply("fire", outcome, lambda: self.child_tracker.fire(key, event))

    def poll_children(self, dt: float) -> None:
        """Move the clock by ``dt`` and ``poll()`` the child tracker (the parent's is polled by its own step)."""
        with self._step("poll_children", dt), self._as_child():
            self.model.now = self.clock.advance(dt)
            self._poll(dt, self.model.poll_child, self.child_tracker.poll, f"{self.child_spec.name} ")

    def step_to_child(self, dt: float | None, which: int) -> float:
        """``dt``, or (None) the clock step to the ``which``-th armed deadline of an owned instance."""
        if dt is not None:
            return dt
        dues = sorted({due for _key, due, _phase, _event in self.model.child.deadlines()})
        if not dues:
            return 0.0
        return _to(self.clock.now, dues[which % len(dues)])

    def drain_children(self) -> None:
        with self._step("drain_children"), self._as_child():
            outcome = self.model.drain_child()
            self._tell(f"{self.child_spec.name} {drain_line(outcome)}", outcome)
            got = self._call(outcome, self.child_tracker.finished)
            if not _same_drain(got, outcome):
                self._diverge([f"finished() returned {got}, the spec says {outcome.drained}"])

    def close(self, name: str = "close") -> None:
        """The parent tracker's ``close()``, then the child tracker's: nothing held by either afterwards."""
        super().close(name)
        self._busy = True  # part of the same step (one entry in the trace); a raise leaves the mark, as a step's does
        with self._as_child():
            again = self.model.child.closed
            outcome = self.model.close_child()
            self._tell(f"{self.child_spec.name} {close_line(outcome, again)}", outcome)
            self._call(outcome, self.child_tracker.close)
        self._busy = False

    # -- the checks ---------------------------------------------------------------------

    def agrees_with_spec(self) -> None:
        """The parent's checks, then each child key's state, holdings and ``observe``, and each parent's children."""
        super().agrees_with_spec()
        model, child, tracker = self.model, self.model.child, self.child_tracker
        problems: list[str] = []
        for key in self.child_keys:
            state, got = child.state(key), tracker.state(key)
            if got != state:
                problems.append(f"Tracker says {key} is in {got!r}, the spec says {state!r}")
            if tracker.held(key) != child.held(key):
                problems.append(f"Tracker says {key} holds {list(tracker.held(key))}, the spec says {child.held(key)}")
            problems += self._reality(key, state, self.child_driver, child)
        for key in self.keys:
            owned, want = self.tracker.owned(key), frozenset(model.children.get(key, ()))
            if owned != want:
                problems.append(
                    f"Tracker says {key} owns {sorted(owned, key=repr)} live, the spec says {sorted(want, key=repr)}"
                )
        if tracker.live() != child.live_count():
            problems.append(
                f"Tracker says {tracker.live()} {self.child_spec.name} live, the spec says {child.live_count()}"
            )
        child.anomalies.clear()
        if problems:
            self._diverge(problems)

    # -- helpers ----------------------------------------------------------------------------

    def accepted(self, state: str) -> set[str]:
        return self.model.child.accepted(state) if self._own else self.model.accepted(state)

    def _faultable(self, actions: tuple[str, ...]) -> list[str]:
        return [a for a in actions if a in self.child_faults]

    @contextmanager
    def _as_child(self) -> Iterator[None]:
        """Marks the step as the child tracker's while it runs (see :meth:`_tell`)."""
        self._own = True
        try:
            yield
        finally:
            self._own = False

    def _tell(self, line: str, outcome: Outcome) -> None:
        """Tell the step, and count each move and failure on the machine whose key it is."""
        mine = frozenset(self.child_keys) if self._own else frozenset(self.keys)
        ours = dataclasses.replace(
            outcome,
            moves=[m for m in outcome.moves if m.key in mine],
            failures=[f for f in outcome.failures if f.key in mine],
        )
        theirs = Outcome(
            moves=[m for m in outcome.moves if m.key not in mine],
            failures=[f for f in outcome.failures if f.key not in mine],
        )
        first, second = (self.child_coverage, self.coverage) if self._own else (self.coverage, self.child_coverage)
        self.story.append(f"{clock(self.clock.now)} {_then(line, outcome)}")
        self.moved.append(tuple(outcome.moves))
        first.record(ours)
        second.record(theirs)
        self.coverage.steps += 1


def _then(line: str, outcome: Outcome) -> str:
    """``line`` with what the step caused that it does not tell yet: the other machine's moves, the engine's events."""
    told: Counter[str] = Counter()
    caused = []
    for move in outcome.moves:
        if move.how == "begin":
            continue
        text = _move(move, outcome.expired)
        told[text] += 1
        if told[text] > line.count(text):
            caused.append(text)
    return f"{line}; then {', '.join(caused)}" if caused else line
