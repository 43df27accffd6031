"""The immutable, typed model of one machine spec (schema version 1).

The model is the single source of the semantics every other part shares: the
engine compiles it, the checks prove things about it, generators draw and test
it. Derived facts (expanded ``"*"`` sources, which resources a transition
releases) are computed here once, so no consumer re-derives them its own way.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from ..errors import KvfsmError

WILDCARD = "*"
"""A transition source meaning every non-final state."""

ABORT = "abort"
"""The event every live state must accept (KVF108)."""

FinalKind = Literal["success", "failure"]


@dataclass(frozen=True, slots=True)
class Loc:
    """Where something was written: file, 1-based line and column."""

    path: str
    line: int
    col: int = 1

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


NOWHERE = Loc("<memory>", 0, 0)


@dataclass(frozen=True, slots=True)
class Resource:
    """Something an instance can hold; ``release`` is the driver action that gives it back."""

    name: str
    release: str
    acquire: str | None = None
    doc: str = ""
    loc: Loc = NOWHERE


@dataclass(frozen=True, slots=True)
class Timeout:
    """A deadline armed on entering a state: after ``after`` seconds, ``fire`` the event."""

    after: str | float
    """A param name, or a literal number of seconds."""
    fire: str
    loc: Loc = NOWHERE


@dataclass(frozen=True, slots=True)
class Phase:
    """A deadline that spans states: armed on entering any of ``states`` from outside them (or at ``begin``),
    kept while the instance moves among them or takes a self-loop, disarmed on leaving them.

    It fires at most once per entry into the phase. ``states`` is as written;
    ``"*"`` means every non-final state (a lease on the whole instance, from
    ``begin``).
    """

    name: str
    states: tuple[str, ...]
    timeout: Timeout
    doc: str = ""
    loc: Loc = NOWHERE


@dataclass(frozen=True, slots=True)
class Owned:
    """Instances of another machine this one owns (``owns:``): a request's store jobs, its per-rank handles.

    A child names its parent in its ``begin`` payload key ``by``. The engine
    fires ``ended`` on the parent once no child of it is live, whenever the
    parent is in a state with a transition on it (so at once on entering such
    a state with none live), ``failed`` (if given) each time a child ends in a
    failure state, and passes each event in ``forward`` fired on the parent on
    to every live child. The parent's own spec says what those events do: a
    request keeps its blocks until ``ended`` lets it go.
    """

    name: str
    machine: str
    by: str
    ended: str
    failed: str | None = None
    forward: tuple[str, ...] = ()
    doc: str = ""
    loc: Loc = NOWHERE


@dataclass(frozen=True, slots=True)
class State:
    name: str
    initial: bool = False
    final: FinalKind | None = None
    holds: tuple[str, ...] = ()
    waits_local: bool = False
    timeout: Timeout | None = None
    doc: str = ""
    loc: Loc = NOWHERE
    warn_after: str | float | None = None
    """Seconds (or a param) after which an instance still here is worth one warning (observe-only)."""

    @property
    def is_final(self) -> bool:
        return self.final is not None


@dataclass(frozen=True, slots=True)
class Send:
    """A message a transition sends to another role of a composition (see :mod:`kvfsm.spec.system`).

    A machine on its own gives ``send`` no meaning: the engine ignores it, and
    only a composition says which role ``to`` names and whether ``message`` is
    declared there.
    """

    to: str
    message: str
    loc: Loc = NOWHERE


@dataclass(frozen=True, slots=True)
class Transition:
    """One declared transition line; ``sources`` is as written (may be ``("*",)``)."""

    event: str
    sources: tuple[str, ...]
    target: str
    do: str | None = None
    doc: str = ""
    loc: Loc = NOWHERE
    sends: tuple[Send, ...] = ()
    """Messages sent when the transition happens, in the order written."""
    payload: tuple[str, ...] = ()
    """The keyword arguments the event carries to this transition's ``do`` and acquire actions."""
    count: int | str | None = None
    """``count: K``: the transition waits for the event from K distinct senders (``fire(..., sender=...)``)
    during one stay in its source state. K is a number, a param, a ``begin`` payload key (per instance) or
    a key of this transition's payload (each arrival says it); None: every arrival fires it."""
    release: tuple[tuple[str, str], ...] = ()
    """``release: {resource: action}``: resources this transition releases by another action than their own
    (a load's report says its blocks are valid only on the edge that checked them)."""

    @property
    def wildcard(self) -> bool:
        return WILDCARD in self.sources


@dataclass(frozen=True, slots=True)
class IgnoreRule:
    """Events that are legal no-ops in the listed states (late or duplicate events)."""

    events: tuple[str, ...]
    states: tuple[str, ...]
    loc: Loc = NOWHERE


BEGIN = "begin"
"""Where a space may be linked besides an event: the ids ``begin`` carries."""


@dataclass(frozen=True, slots=True)
class Space:
    """An id space besides the key's: a peer's request id, a transfer id. ``linked_at`` is the event (or
    ``begin``) whose payload carries the id, under the space's own name; the tracker links it there."""

    name: str
    linked_at: str
    doc: str = ""
    loc: Loc = NOWHERE


@dataclass(frozen=True, slots=True)
class EventDecl:
    """What an event is: the id space a message of it names (``by``), and whether a remote party sends it."""

    name: str
    by: str
    remote: bool = False
    doc: str = ""
    loc: Loc = NOWHERE
    early: Early | None = None
    """``early: {keep, within}``: a message of this event naming an id not yet known in its space is kept and
    applied when the id appears (None: it is an ``unknown`` anomaly at once)."""


@dataclass(frozen=True, slots=True)
class Early:
    """How many messages of an event may wait for their id (``keep``, over all ids) and for how long
    (``within``: seconds or a param); past either they are dropped as ``early`` anomalies."""

    keep: int
    within: str | float
    loc: Loc = NOWHERE


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A message this machine sends a peer machine: which event of which peer, and which id space its id is from.

    What a peer routes by is the peer's business (its own ``events:``); what
    this side puts on the wire is this side's, and ``carries`` says it: the
    key's space or a declared one (``remote_request_id``). A driver reports
    each message it sends (:mod:`kvfsm.engine.outbox`), so an id from the
    wrong space is caught where it leaves, not where it is dropped.
    """

    name: str
    to: str
    """The peer machine (its ``machine:`` name)."""
    event: str
    """The peer's event the message fires (defaults to ``name``)."""
    carries: str
    """The id space the message's id is taken from."""
    doc: str = ""
    loc: Loc = NOWHERE


Term = tuple[float, str | None]
"""``coefficient × param`` (a bare number when the name is None)."""

COMPARE: Mapping[str, Callable[[float, float], bool]] = {
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
}


@dataclass(frozen=True, slots=True)
class Relation:
    """A declared relation between params, e.g. ``lease_ttl > transfer_timeout + 5``: sums of terms compared."""

    left: tuple[Term, ...]
    op: str
    right: tuple[Term, ...]
    text: str
    loc: Loc = NOWHERE

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(name for _c, name in (*self.left, *self.right) if name is not None)

    def holds(self, values: Mapping[str, float]) -> bool:
        """Whether the relation holds for these param values (every param it names must be given)."""

        def total(terms: tuple[Term, ...]) -> float:
            return sum(c * (values[name] if name is not None else 1.0) for c, name in terms)

        return COMPARE[self.op](total(self.left), total(self.right))

    def given(self, values: Mapping[str, float]) -> str:
        """``lease_ttl = 10, transfer_timeout = 30``: the values the relation was judged on, for messages."""
        return ", ".join(f"{p} = {values[p]:g}" for p in dict.fromkeys(self.params) if p in values)


@dataclass(frozen=True, slots=True)
class Edge:
    """A transition expanded to one concrete source state."""

    source: str
    event: str
    target: str
    do: str | None
    transition: Transition


@dataclass(frozen=True)
class Spec:
    """One machine: states, resources, transitions and the rules that join them."""

    name: str
    key: str
    states: Mapping[str, State]
    transitions: tuple[Transition, ...]
    resources: Mapping[str, Resource] = field(default_factory=dict)
    params: Mapping[str, float] = field(default_factory=dict)
    ignore: tuple[IgnoreRule, ...] = ()
    on_error: str | None = None
    doc: str = ""
    path: str = "<memory>"
    locs: Mapping[str, Loc] = field(default_factory=dict)
    """Where each top-level key was written (for findings about the spec as a whole)."""
    begin_payload: tuple[str, ...] = ()
    """The keyword arguments ``begin`` carries to the initial state's acquire actions."""
    relations: tuple[Relation, ...] = ()
    """Relations every binding of the params must keep (``lease_ttl > transfer_timeout``)."""
    spaces: Mapping[str, Space] = field(default_factory=dict)
    """Id spaces besides ``key``'s, each linked by the payload of one event (or begin)."""
    event_decls: Mapping[str, EventDecl] = field(default_factory=dict)
    """Events declared under ``events:`` (routing space, remote or not); undeclared ones are local, by key."""
    outgoing: Mapping[str, Outgoing] = field(default_factory=dict)
    """Messages sent to peer machines, by name, each with the id space its id comes from (``outgoing:``)."""
    phases: Mapping[str, Phase] = field(default_factory=dict)
    """Deadlines that span states (``phases:``), by name."""
    owns: Mapping[str, Owned] = field(default_factory=dict)
    """Instances of other machines this one owns (``owns:``), by name."""

    @property
    def owned_events(self) -> frozenset[str]:
        """The events the engine fires on this machine for its children (each ``ended`` and ``failed``)."""
        return frozenset(e for o in self.owns.values() for e in (o.ended, o.failed) if e is not None)

    def routed_by(self, event: str) -> str:
        """The id space a message of ``event`` names: its declared ``by``, else the key's."""
        decl = self.event_decls.get(event)
        return decl.by if decl is not None else self.key

    def carried_by(self, message: str) -> str:
        """The id space an outgoing ``message`` names; raises :class:`~kvfsm.KvfsmError` for one ``outgoing:`` lacks."""
        decl = self.outgoing.get(message)
        if decl is None:
            known = ", ".join(self.outgoing) or "none"
            raise KvfsmError(
                f"machine {self.name!r} declares no outgoing message {message!r} (declared: {known}); "
                "add it under 'outgoing:' with the id space it carries"
            )
        return decl.carries

    def is_remote(self, event: str) -> bool:
        """Whether a remote party sends ``event`` (so it may arrive late, anywhere, even after the end)."""
        decl = self.event_decls.get(event)
        return decl is not None and decl.remote

    def count_source(self, t: Transition) -> tuple[str, int | str] | None:
        """Where transition ``t``'s K comes from: ``("number", K)``, ``("param", name)``, ``("begin", key)``
        or ``("event", key)``; None if ``t`` counts nothing or names nothing that gives K (KVF116)."""
        if t.count is None:
            return None
        if isinstance(t.count, int):
            return ("number", t.count)
        if t.count in t.payload:
            return ("event", t.count)
        if t.count in self.begin_payload:
            return ("begin", t.count)
        if t.count in self.params:
            return ("param", t.count)
        return None

    def counted(self) -> dict[tuple[str, str], Transition]:
        """Every (source state, event) whose transition counts senders."""
        return {(e.source, e.event): e.transition for e in self.edges() if e.transition.count is not None}

    @cached_property
    def phase_states(self) -> Mapping[str, frozenset[str]]:
        """Phase → the states it spans, ``"*"`` expanded (names a spec does not declare are kept: KVF118)."""
        return {name: frozenset(self.expand(p.states)) for name, p in self.phases.items()}

    def phases_of(self, state: str | None) -> tuple[str, ...]:
        """The phases ``state`` is in, in declaration order (None, before ``begin``: none)."""
        return tuple(name for name, states in self.phase_states.items() if state in states)

    def phase_moves(self, source: str | None, target: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(entered, left)``: the phases whose deadline moving ``source`` → ``target`` arms and disarms
        (``None`` source: entering at ``begin``). A move inside a phase, or a self-loop, does neither."""
        before, after = self.phases_of(source), self.phases_of(target)
        return tuple(p for p in after if p not in before), tuple(p for p in before if p not in after)

    def timeouts(self, state: str) -> tuple[Timeout, ...]:
        """Every deadline that may be armed while an instance is in ``state``: its own, then its phases'."""
        own = self.states[state].timeout if state in self.states else None
        return (*((own,) if own is not None else ()), *(self.phases[p].timeout for p in self.phases_of(state)))

    def fires_on_timeout(self, state: str, event: str) -> bool:
        """Whether ``event`` in ``state`` may be a deadline firing (the state's own or a phase's)."""
        return any(t.fire == event for t in self.timeouts(state))

    def linked_at(self, event: str) -> tuple[str, ...]:
        """The spaces whose id ``event`` (or ``"begin"``) carries in its payload, to link on the way."""
        return tuple(name for name, space in self.spaces.items() if space.linked_at == event)

    # -- derived structure -------------------------------------------------

    @property
    def initial(self) -> State:
        """The initial state (the first one marked, if a broken spec marks several)."""
        for state in self.states.values():
            if state.initial:
                return state
        raise LookupError(f"{self.path}: machine {self.name!r} declares no initial state")

    @property
    def finals(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states.values() if s.is_final)

    @property
    def events(self) -> tuple[str, ...]:
        """Every event the machine handles, in order of first declaration."""
        seen: dict[str, None] = {}
        for t in self.transitions:
            seen.setdefault(t.event)
        return tuple(seen)

    def expand(self, sources: tuple[str, ...]) -> tuple[str, ...]:
        """Sources with ``"*"`` replaced by every non-final state, declaration order kept."""
        if WILDCARD not in sources:
            return sources
        out: dict[str, None] = {}
        for s in sources:
            if s == WILDCARD:
                out.update((n, None) for n, st in self.states.items() if not st.is_final)
            else:
                out.setdefault(s)
        return tuple(out)

    def edges(self) -> Iterator[Edge]:
        """Every (source, event) → target edge, wildcards expanded, declaration order."""
        for t in self.transitions:
            for src in self.expand(t.sources):
                yield Edge(src, t.event, t.target, t.do, t)

    def ignored(self) -> Iterator[tuple[str, str, IgnoreRule]]:
        """Every (state, event) pair an ignore rule makes a legal no-op.

        In an ignore rule ``"*"`` means every state, final ones included, that
        has no transition for the event: "a late ``complete`` is harmless
        wherever it is not handled".
        """
        handled = {(e.source, e.event) for e in self.edges()}
        for rule in self.ignore:
            for event in rule.events:
                for state in rule.states:
                    if state != WILDCARD:
                        yield state, event, rule
                    else:
                        for name in self.states:
                            if (name, event) not in handled and name not in rule.states:
                                yield name, event, rule

    @cached_property
    def table(self) -> Mapping[tuple[str, str], Edge]:
        """``(state, event) → edge``: the one lookup every consumer asks "what does event do here?".

        The first declaration wins where a broken spec gives a pair two
        targets (KVF105 reports it); the engine and every oracle read this.
        """
        out: dict[tuple[str, str], Edge] = {}
        for e in self.edges():
            out.setdefault((e.source, e.event), e)
        return out

    @cached_property
    def ignores(self) -> frozenset[tuple[str, str]]:
        """``(state, event)`` pairs that are legal no-ops and not transitions."""
        table = self.table
        return frozenset((s, e) for s, e, _rule in self.ignored() if (s, e) not in table)

    def accepts(self, state: str, event: str) -> bool:
        """Whether ``event`` takes a transition from ``state`` (ignored events do not)."""
        return (state, event) in self.table

    @property
    def live(self) -> tuple[str, ...]:
        """The non-final states, in declaration order."""
        return tuple(s.name for s in self.states.values() if not s.is_final)

    @cached_property
    def payloads(self) -> Mapping[str, frozenset[str]]:
        """Event → the payload keys it may carry: the union of what its transitions declare."""
        out: dict[str, set[str]] = {}
        for t in self.transitions:
            out.setdefault(t.event, set()).update(t.payload)
        return {event: frozenset(names) for event, names in out.items()}

    def holds(self, state: str) -> tuple[str, ...]:
        st = self.states.get(state)
        return st.holds if st is not None else ()

    def releases(self, source: str, target: str) -> tuple[str, ...]:
        """Resources released moving source → target: holds(source) − holds(target), counted (a resource held
        twice in the source and once in the target is released once)."""
        return _minus(self.holds(source), self.holds(target))

    def acquires(self, source: str | None, target: str) -> tuple[str, ...]:
        """Resources acquired moving source → target (``None`` source: entering at begin), counted."""
        return _minus(self.holds(target), self.holds(source) if source is not None else ())

    def param_problems(self, overrides: Mapping[str, object]) -> list[str]:
        """What is wrong with params a deployment overrides: undeclared names, values that are no deadline."""
        problems = []
        unknown = sorted(set(overrides) - set(self.params))
        if unknown:
            known = ", ".join(self.params) or "none"
            problems.append(
                f"params {', '.join(map(repr, unknown))} are not declared by machine {self.name!r} (declared: {known})"
            )
        for name, value in overrides.items():
            number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
            if number is None or number < 0 or not math.isfinite(number):
                problems.append(
                    f"param {name!r} must be a finite, non-negative number of seconds, not {value!r} "
                    "(a negative, infinite or NaN deadline is no deadline)"
                )
        return problems

    def broken_relations(self, overrides: Mapping[str, float] | None = None) -> list[Relation]:
        """The declared relations the params break, with ``overrides`` applied to the spec's values."""
        values = {**self.params, **(overrides or {})}
        return [r for r in self.relations if all(p in values for p in r.params) and not r.holds(values)]

    def param(self, value: str | float, overrides: Mapping[str, float] | None = None) -> float:
        """Resolve a timeout's ``after`` (param name or number) to seconds."""
        if isinstance(value, str):
            if overrides and value in overrides:
                return float(overrides[value])
            return float(self.params[value])
        return float(value)

    def raising_actions(self, edge: Edge) -> tuple[str, ...]:
        """Driver actions that run before the state changes on ``edge`` (any can raise)."""
        acts = [edge.do] if edge.do else []
        for r in self.acquires(edge.source, edge.target):
            acquire = self.resources[r].acquire if r in self.resources else None
            if acquire:
                acts.append(acquire)
        return tuple(acts)

    def release_actions(self, edge: Edge) -> tuple[tuple[str, str], ...]:
        """``(resource, release action)`` for what ``edge`` releases, in the source's holds order: each
        resource's own release, or the one the transition names for it (``release:``)."""
        by = dict(edge.transition.release)
        return tuple((r, by.get(r, self.resources[r].release)) for r in self.releases(edge.source, edge.target))

    def actions(self) -> tuple[str, ...]:
        """Every driver method the spec names (do, acquire, release, a transition's own release), sorted."""
        names: set[str] = {t.do for t in self.transitions if t.do}
        names.update(action for t in self.transitions for _r, action in t.release)
        for r in self.resources.values():
            names.add(r.release)
            if r.acquire:
                names.add(r.acquire)
        return tuple(sorted(names))


def split_params(params: Mapping[str, Any] | None, *specs: Spec) -> list[dict[str, Any]]:
    """``params`` for machines run side by side, each spec's own share; a name none declares is a ValueError
    naming the known ones (a typo must not run with a default)."""
    given = dict(params or {})
    known = {name for spec in specs for name in spec.params}
    unknown = set(given) - known
    if unknown:
        raise ValueError(f"unknown params {sorted(unknown)}; known: {sorted(known)}")
    return [{k: v for k, v in given.items() if k in spec.params} for spec in specs]


def _minus(have: tuple[str, ...], keep: tuple[str, ...]) -> tuple[str, ...]:
    """``have`` less ``keep`` as multisets, in ``have``'s order: the units of each resource ``keep`` lacks."""
    left = Counter(keep)
    out = []
    for r in have:
        if left[r]:
            left[r] -= 1
        else:
            out.append(r)
    return tuple(out)
