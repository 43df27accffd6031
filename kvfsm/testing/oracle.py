"""The one plain reading of a spec's single-machine semantics: what begin, fire, poll, finished and close must do.

Independent of the engine on purpose. The Tracker compiles a spec into flat
tables for speed; this module reads the spec model directly, asking it only
its own questions (:meth:`~kvfsm.spec.Spec.edges`, :meth:`~kvfsm.spec.Spec.ignored`,
:meth:`~kvfsm.spec.Spec.holds`, :meth:`~kvfsm.spec.Spec.acquires`,
:meth:`~kvfsm.spec.Spec.releases`, :meth:`~kvfsm.spec.Spec.raising_actions`,
the states' timeouts, :meth:`~kvfsm.spec.Spec.phase_moves` and the phases'
timeouts), and interprets them one instance at a time, slowly
and visibly. Each call returns an :class:`Outcome`: the transitions taken,
the exact driver calls the engine must make, in order, the failures an
``ActionError`` must carry, and the value the Tracker must return. The
model-based tests and the differential test hold the Tracker to it.

The rules, as DESIGN.md states them and as they are applied below:

- a transition runs its ``do``, then acquires what the target holds and the
  source does not (in the target's holds order); the state then changes and
  the derived releases run (in the source's holds order), each on its own;
- release actions are called with the key only;
- if the ``do`` or an acquire raises, the acquires already made are undone
  (their releases, in acquire order), the state does not change, and the
  ``on_error`` event fires from the source instead; if the failing edge is
  that ``on_error`` edge itself (a spec KVF109 warns about), it is taken
  bare: no ``do``, no acquires, its releases only;
- a failed ``begin`` undoes its acquires and releases what the initial state
  holds without an acquire action (the caller took that before ``begin``);
- a state's deadline is armed on entering it (a self-loop re-arms it); a
  phase's deadline (``phases:``) is armed on entering any of its states from
  outside the phase (or at ``begin``), kept while the instance moves among
  its states or takes a self-loop, disarmed on leaving it, and fires at most
  once per entry; either is ``now + after`` at the moment of entry;
- due timeouts fire state by state in declaration order, in arming order
  within a state, then phase by phase in declaration order, in arming order
  within a phase; deadlines armed during a poll (a state's or a phase's)
  wait for the next one, and a state's deadline and a phase's are
  independent;
- ``close()`` aborts every live instance and releases by force what abort
  cannot finish (a ``forced`` anomaly);
- an id a payload carries under a declared space's name is linked to the
  instance once its transition (or begin) is complete; one that already
  names another live instance is a ``link`` failure; a drained instance's
  ids retire with it, and one begun again leaves its earlier ids naming the
  old generation until the old instance is drained;
- a message routed by a declared space (:meth:`SpecModel.deliver`) with an
  id linked to the current generation is that instance's event; an id of an
  earlier generation is ``stale``, a retired one ``late``, any other
  ``unknown`` (a key's space: ``late`` once drained, else ``unknown``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from ..errors import SpecError
from ..spec import run_checks, well_formed
from ..spec.model import ABORT, BEGIN, Spec

How = Literal["begin", "fire", "timeout", "on_error", "close"]
"""What made a transition happen."""

Phase = Literal["do", "acquire", "release", "link"]

NOT_BEGUN = "(not begun)"
"""The state a failure at ``begin`` reports: no instance was created."""


@dataclass(frozen=True)
class Move:
    """One transition the spec prescribes for one key (``source`` is ``""`` for begin)."""

    key: Hashable
    event: str
    source: str
    target: str
    how: How
    phase: str = ""
    """For a timeout: the phase whose deadline fired it ("" for the state's own deadline)."""


@dataclass(frozen=True)
class Call:
    """One driver call the engine must make: the action, the key it is called with, and whether it raises."""

    action: str
    key: Hashable
    raised: bool = False


@dataclass
class ExpectedFailure:
    """One :class:`~kvfsm.Failure` the Tracker must report: which action, and where the instance ended."""

    key: Hashable
    event: str
    action: str
    phase: Phase
    state: str = ""

    def as_tuple(self) -> tuple[Hashable, str, str, str, str]:
        return (self.key, self.event, self.action, self.phase, self.state)


Refusal = Literal["ignored", "illegal", "unknown", "duplicate", "closed", "counted", "kept", "orphan"]


@dataclass
class Outcome:
    """What one call to the Tracker must do."""

    moves: list[Move] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    """Every driver call, in order (after ``close()`` the spec leaves the order of keys open)."""
    failures: list[ExpectedFailure] = field(default_factory=list)
    """Non-empty: the call must raise ActionError carrying exactly these."""
    event: str = ""
    """fire(): the event fired."""
    refused: Refusal | None = None
    """A call that moved nothing: an event ignored (legal), illegal (IllegalTransition) or for an
    unknown key; a begin of a live key (DuplicateKey); any begin or fire after close() (TrackerClosed);
    an arrival of a counted event that did not complete its count (``counted``; a repeat from a sender
    already heard is also a ``duplicate`` anomaly); a message of an ``early:`` event kept for its id
    (``kept``, or an ``early`` anomaly when the bound is full); a child's begin naming no live parent
    (``orphan``: UnknownParent, :mod:`~kvfsm.testing.family_oracle`)."""
    state: str | None = None
    """The state the event met (for refusals) or the call returns (for fire)."""
    fired: list[tuple[Hashable, str, str]] = field(default_factory=list)
    """poll(): (key, event, state afterwards) per timeout fired."""
    drained: list[tuple[Hashable, str]] = field(default_factory=list)
    """finished(): (key, final state) per instance retired."""
    unordered: int = 0
    """finished(): how many of the last ``drained`` close() finished; the spec leaves their order open."""
    forced: list[Hashable] = field(default_factory=list)
    """close(): keys whose resources were released without a transition."""
    anomaly: str = ""
    """The kind of the anomaly a refused call counts: ``unknown``, ``late`` or ``stale`` (refused as
    ``unknown``), ``duplicate`` (refused as ``counted``)."""
    key: Hashable | None = None
    """deliver(): the instance the id named (None: it named none)."""
    expired: list[Expiry] = field(default_factory=list)
    """poll(): each phase deadline fired, in order."""


@dataclass(frozen=True)
class Expiry:
    """A phase's deadline that fired: when the instance entered the phase, and how many moves it made inside it
    since (transitions among the phase's states and self-loops, none of which touch the deadline)."""

    key: Hashable
    phase: str
    entered: float
    moves: int


@dataclass(frozen=True)
class Fault:
    """An injected fault not yet spent: the next call of ``action`` (None: any) for ``key`` (None: any) raises."""

    action: str | None = None
    key: Hashable | None = None

    def hits(self, action: str, key: Hashable) -> bool:
        return self.action in (None, action) and (self.key is None or self.key == key)


@dataclass(frozen=True)
class ActionEdge:
    """One ``(source, event) → target`` with the driver actions the spec derives for it."""

    source: str
    event: str
    target: str
    do: str | None
    acquires: tuple[tuple[str, str], ...]
    """(acquire action, the release that undoes it), in the target's holds order."""
    releases: tuple[str, ...]
    """Release actions run after the state changes, in the source's holds order."""
    bare: bool = False
    """The on_error edge taken without its own actions, because one of them raised."""

    @property
    def prepare_actions(self) -> tuple[str, ...]:
        """Actions that run before the state changes, in order: the do, then the acquires."""
        return () if self.bare else tuple([self.do] if self.do else []) + tuple(a for a, _r in self.acquires)


class Instance:
    """One begun instance: its state and its armed deadlines, if any."""

    __slots__ = ("by_close", "due", "gen", "heard", "inside", "key", "need", "phases", "seq", "state")

    def __init__(self, key: Hashable, state: str, gen: int = 0) -> None:
        self.key = key
        self.state = state
        self.gen = gen
        """The generation: each begin of a key makes a new one."""
        self.due: float | None = None
        self.seq = 0
        """Arming number of ``due``: deadlines fire in arming order within a state."""
        self.by_close = False
        self.heard: set[Hashable] = set()
        """Senders of a counted event heard during this stay in the state."""
        self.need: dict[str, int] = {}
        """The K its ``begin`` payload gave each count, by payload key."""
        self.phases: dict[str, tuple[float, int]] = {}
        """Phase → (due, arming number) of its armed deadline: set on entering the phase, kept inside it."""
        self.inside: dict[str, int] = {}
        """Phase → transitions taken among its states (self-loops included) since the instance entered it."""


class SpecModel:
    """The spec's semantics over a handful of keys, with a clock and pending faults.

    ``faults`` holds the injected faults not yet spent: the driver was told
    the same, and the model knows which calls each transition makes, so it
    can say exactly which call a fault breaks and what follows.
    """

    def __init__(self, spec: Spec, params: Mapping[str, float] | None = None) -> None:
        """``spec`` must be one the engine runs (:func:`kvfsm.spec.well_formed`); ``params`` override its own."""
        self.spec = well_formed(spec)
        self.edges: dict[tuple[str, str], ActionEdge] = {}
        for e in spec.edges():
            acquires = self._acquires(e.source, e.target)
            releases = tuple(action for _r, action in spec.release_actions(e))
            self.edges[e.source, e.event] = ActionEdge(e.source, e.event, e.target, e.do, acquires, releases)
        self.ignored = {(state, event) for state, event, _rule in spec.ignored()}
        self.counted = {where: spec.count_source(t) for where, t in spec.counted().items()}
        """(state, event) → where its K comes from (see :meth:`Spec.count_source`)."""
        self.params = dict(params or {})
        self.after = {
            s.name: (spec.param(s.timeout.after, params), s.timeout.fire)
            for s in spec.states.values()
            if s.timeout is not None
        }
        self.order = {name: i for i, name in enumerate(spec.states)}
        self.phase_after = {
            name: (spec.param(p.timeout.after, params), p.timeout.fire) for name, p in spec.phases.items()
        }
        """Phase → (seconds its deadline is armed for, the event it fires), in declaration order."""
        if any(
            (s, p.timeout.fire) not in spec.table
            for p in spec.phases.values()
            for s in spec.phase_states[p.name]
            if s in spec.states and not spec.states[s].is_final
        ):  # a deadline the state cannot take (the engine's poll would raise IllegalTransition): KVF118
            raise SpecError([f for f in run_checks(spec) if f.code == "KVF118"])
        initial = spec.initial.name
        self.begin_acquires = self._acquires(None, initial)
        self.begin_given = tuple(
            spec.resources[r].release for r in spec.holds(initial) if not spec.resources[r].acquire
        )
        """Releases of what the initial state holds without an acquire action: undone if begin fails."""
        self.live: dict[Hashable, Instance] = {}
        """The current instance per key, final ones included until drained."""
        self.finished: list[Instance] = []
        self.faults: list[Fault] = []
        self.now = 0.0
        self.closed = False
        self.counts = dict.fromkeys(
            (
                "ignored",
                "illegal",
                "unknown",
                "late",
                "stale",
                "forced",
                "timeouts",
                "action_errors",
                "release_errors",
                "counted",
                "duplicate",
                "kept_early",
                "early",
            ),
            0,
        )
        self.anomalies: list[tuple[str, str, Hashable, str]] = []
        """(kind, id space, id, event) per anomaly, in order; the caller drains it."""
        self.retired: set[Hashable] = set()
        """Keys whose instance was drained: an event for one is ``late``, not ``unknown``."""
        self.links: dict[str, dict[Hashable, tuple[Hashable, int]]] = {name: {} for name in spec.spaces}
        """Per declared space: id → (key, generation) it was linked to, until that instance retires."""
        self.retired_ids: dict[str, dict[Hashable, None]] = {name: {} for name in spec.spaces}
        """Per declared space: ids whose instance was drained (a message naming one is ``late``)."""
        self._gen = 0
        self._seq = 0
        self.early = {
            n: (d.early.keep, spec.param(d.early.within, params)) for n, d in spec.event_decls.items() if d.early
        }
        """Event → (how many may wait, for how long), for events declared ``early:``."""
        self.kept: dict[tuple[str, Hashable], list[tuple[str, dict[str, Any], float, int]]] = {}
        """(space, id) → (event, payload, due, arrival number) per message kept for an id not yet known, in arrival
        order."""
        self._arrivals = 0
        self.on_move: Callable[[Instance, Move, Outcome], None] | None = None
        """Called after each begin, and after each transition's releases: where the engine runs an edge's taps.
        The family rules (``owns:``, :mod:`kvfsm.testing.family_oracle`) hook in here; None for one machine."""
        self.on_forced: Callable[[Hashable, Outcome], None] | None = None
        """Called after ``close()`` released a key by force (its releases done)."""
        self.settle: Callable[[Outcome], None] | None = None
        """Called after each timeout ``poll()`` fires and after each key ``close()`` aborts: where the engine runs
        what that step queued before the next key's turn."""

    def _acquires(self, source: str | None, target: str) -> tuple[tuple[str, str], ...]:
        out = []
        for r in self.spec.acquires(source, target):
            resource = self.spec.resources[r]
            if resource.acquire:
                out.append((resource.acquire, resource.release))
        return tuple(out)

    # -- faults --------------------------------------------------------------

    def inject(self, action: str | None = None, key: Hashable | None = None) -> None:
        """The next call of ``action`` (None: any) for ``key`` (None: any) raises, as the driver was told."""
        self.faults.append(Fault(action, key))

    def _call(self, out: Outcome, action: str, key: Hashable) -> bool:
        """Make one driver call; returns whether it raises (spending the oldest fault that hits it)."""
        hit = next((i for i, f in enumerate(self.faults) if f.hits(action, key)), None)
        if hit is not None:
            del self.faults[hit]
        out.calls.append(Call(action, key, hit is not None))
        return hit is not None

    # -- queries -------------------------------------------------------------

    def state(self, key: Hashable) -> str | None:
        inst = self.live.get(key)
        return inst.state if inst is not None else None

    def held(self, key: Hashable) -> tuple[str, ...]:
        state = self.state(key)
        return self.spec.holds(state) if state is not None else ()

    def is_final(self, key: Hashable) -> bool:
        state = self.state(key)
        return state is not None and self.spec.states[state].is_final

    def live_count(self) -> int:
        return sum(not self.spec.states[i.state].is_final for i in self.live.values())

    def next_deadline(self) -> float | None:
        dues = [due for _key, due, _phase, _event in self.deadlines()]
        return min(dues) if dues else None

    def deadlines(self) -> list[tuple[Hashable, float, str, str]]:
        """``(key, due, phase, event)`` for every armed deadline of a live instance: its state's own (``phase``
        ""), then its phases' (in the order they were armed)."""
        out: list[tuple[Hashable, float, str, str]] = []
        for key, inst in self.live.items():
            if inst.due is not None:
                out.append((key, inst.due, "", self.after[inst.state][1]))
            out += [(key, due, p, self.phase_after[p][1]) for p, (due, _seq) in inst.phases.items()]
        return out

    def ids(self, key: Hashable) -> dict[str, Hashable]:
        """The ids linked to ``key``'s current instance, by space (what ``Tracker.ids`` must say)."""
        inst = self.live.get(key)
        if inst is None:
            return {}
        return {
            space: ident for space, table in self.links.items() for ident, at in table.items() if at == (key, inst.gen)
        }

    def resolve(self, space: str, ident: Hashable) -> tuple[Hashable | None, str]:
        """The key ``ident`` names in ``space`` and "", or None and the anomaly a message naming it counts."""
        if space == self.spec.key:
            if ident in self.live:
                return ident, ""
            return None, "late" if ident in self.retired else "unknown"
        entry = self.links[space].get(ident)
        if entry is None:
            return None, "late" if ident in self.retired_ids[space] else "unknown"
        key, gen = entry
        inst = self.live.get(key)
        return (key, "") if inst is not None and inst.gen == gen else (None, "stale")

    def known_ids(self, space: str) -> list[Hashable]:
        """Ids worth sending a message of ``space``: its live ones, then earlier generations', retired ones, the
        other spaces' ids and the keys (the wrong space, unless it is the key's), and one never seen."""
        out: dict[Hashable, None] = {}
        if space != self.spec.key:
            out.update(dict.fromkeys(self.links[space]))
            out.update(self.retired_ids[space])
        out.update(dict.fromkeys(self.live))
        out.update(dict.fromkeys(self.retired))
        for other, table in self.links.items():
            if other != space:
                out.update(dict.fromkeys(table))
        out[f"never-{space}"] = None
        return list(out)

    def deliverable(self) -> list[tuple[str, Hashable]]:
        """``(event, id)`` for every declared event a live instance's state handles, named in its routing space."""
        out = []
        for key, inst in self.live.items():
            ids = self.ids(key)
            for event in self.spec.event_decls:
                space = self.spec.routed_by(event)
                ident = key if space == self.spec.key else ids.get(space)
                if ident is not None and (inst.state, event) in self.edges:
                    out.append((event, ident))
        return out

    def accepted(self, state: str) -> set[str]:
        """Events ``state`` handles or ignores: what IllegalTransition lists."""
        return {e for (s, e) in self.edges if s == state} | {e for (s, e) in self.ignored if s == state}

    def begin_actions(self, key: Hashable) -> tuple[str, ...]:
        """Acquire actions ``begin(key)`` will run, in order (none for a live key, DuplicateKey, or once closed)."""
        old = self.live.get(key)
        if self.closed or (old is not None and not self.spec.states[old.state].is_final):
            return ()
        return tuple(a for a, _r in self.begin_acquires)

    def fire_actions(self, key: Hashable, event: str) -> tuple[str, ...]:
        """Actions ``fire(key, event)`` will run before the state changes, in order."""
        inst = self.live.get(key)
        edge = self.edges.get((inst.state, event)) if inst is not None and not self.closed else None
        return edge.prepare_actions if edge is not None else ()

    def poll_actions(self) -> tuple[str, ...]:
        """Actions ``poll()`` will run now before states change, in order (a phase's deadline that a state's
        timeout before it takes out of the phase runs none): read from a poll of a copy, with no faults."""
        trial = self.clone()
        trial.faults = []
        return tuple(c.action for c in trial.poll().calls)

    def clone(self) -> Self:
        """An independent copy of this model's state (the spec and what it derives are shared): to ask what a
        call would do without doing it."""
        return copy.deepcopy(self, {id(x): x for x in self._shared()})

    def _shared(self) -> tuple[object, ...]:
        """What :meth:`clone` shares rather than copies: the spec and what is derived from it."""
        return (
            self.spec, self.edges, self.ignored, self.counted, self.params, self.after, self.order,
            self.phase_after, self.begin_acquires, self.begin_given, self.early,
        )  # fmt: skip

    def movable(self, running: Collection[str] | None = None) -> list[tuple[Hashable, list[str]]]:
        """``(key, events its state handles)`` for every live instance not yet final.

        An event that leads to another live state is listed three times, so a
        pick from the list goes deeper into the machine more often than it
        ends the instance. With ``running``, only the events whose transition
        runs one of those actions are listed.
        """
        out = []
        for key, inst in self.live.items():
            if self.spec.states[inst.state].is_final:
                continue
            handled: list[str] = []
            for (source, _event), e in self.edges.items():
                if source == inst.state and (running is None or any(a in running for a in e.prepare_actions)):
                    handled += [e.event] * (1 if self.spec.states[e.target].is_final else 3)
            if handled:
                out.append((key, handled))
        return out

    # -- the calls -------------------------------------------------------------

    def begin(self, key: Hashable, payload: Mapping[str, Any] | None = None) -> Outcome:
        """``payload``: what begin carries; the ids it holds under declared spaces' names are linked."""
        out = Outcome(event="begin")
        if self.closed:
            out.refused = "closed"
            return out
        old = self.live.get(key)
        if old is not None and not self.spec.states[old.state].is_final:
            out.refused, out.state = "duplicate", old.state
            return out
        for done, (acquire, _release) in enumerate(self.begin_acquires):
            if self._call(out, acquire, key):
                self._failed(out, key, "begin", acquire, "acquire", NOT_BEGUN)
                undo = (*(r for _a, r in self.begin_acquires[:done]), *self.begin_given)
                self._release(out, key, "begin", undo, NOT_BEGUN)
                return out
        initial = self.spec.initial.name
        self._gen += 1
        inst = self.live[key] = Instance(key, initial, self._gen)
        inst.need = {
            str(what): int((payload or {})[str(what)]) for kind, what in self.count_sources() if kind == "begin"
        }
        self._arm(inst)
        self._move_phases(inst, None)
        self._link(out, inst, BEGIN, "begin", payload)
        out.moves.append(Move(key, "begin", "", initial, "begin"))
        if self.on_move is not None:
            self.on_move(inst, out.moves[-1], out)
        self._at_once(inst, out)
        self._apply_kept(out, self.spec.key, key, key)
        return out

    def count_payload(self, state: str | None, event: str, sender: Hashable, need: int) -> dict[str, Any]:
        """What an arrival of ``event`` in ``state`` carries for its count: ``sender``, and K (``need``) where the
        arrival gives it; nothing where ``event`` counts nothing there. Every caller that delivers one uses this.

        ``state`` None (no instance yet): for an ``early:`` event, what it carries where it will be applied (the
        initial state, else the first state that counts it), since it is kept with its sender and payload."""
        if state is None and event in self.early:
            where = [s for (s, e) in self.counted if e == event]
            state = self.spec.initial.name if self.spec.initial.name in where else next(iter(where), None)
        source = self.counted.get((state, event)) if state is not None else None
        if source is None:
            return {}
        return {"sender": sender, **({str(source[1]): need} if source[0] == "event" else {})}

    def countable(self) -> list[tuple[Hashable, str]]:
        """(key, event) for each live instance in a state where ``event`` is counted."""
        return [
            (key, event) for key, inst in self.live.items() for (state, event) in self.counted if state == inst.state
        ]

    def count_sources(self) -> set[tuple[str, int | str]]:
        return {source for source in self.counted.values() if source is not None}

    def need(self, inst: Instance, event: str, payload: Mapping[str, Any] | None) -> int | None:
        """How many distinct senders ``event`` waits for in ``inst``'s state (None: it counts nothing there)."""
        source = self.counted.get((inst.state, event))
        if source is None:
            return None
        kind, what = source
        if kind == "number":
            return int(what)
        if kind == "param":
            return int(self.spec.param(str(what), self.params))
        if kind == "begin":
            return inst.need.get(str(what), 0)
        return int((payload or {})[str(what)])

    def _hear(self, inst: Instance, event: str, payload: Mapping[str, Any] | None, out: Outcome) -> bool:
        """Count one arrival of a counted event; whether it completes the count (the edge is then taken)."""
        need = self.need(inst, event, payload)
        if need is None:
            return True
        sender = (payload or {}).get("sender")
        if sender in inst.heard:
            self.counts["duplicate"] += 1
            self.anomalies.append(("duplicate", self.spec.key, inst.key, event))
            out.refused, out.anomaly = "counted", "duplicate"
            return False
        inst.heard.add(sender)
        if len(inst.heard) < need:
            self.counts["counted"] += 1
            out.refused = "counted"
            return False
        return True

    def _at_once(self, inst: Instance, out: Outcome) -> None:
        """A count whose K is known on entry and is 0 fires its event as the instance enters the state."""
        for (state, event), source in self.counted.items():
            if (
                state == inst.state
                and source is not None
                and source[0] != "event"
                and self.need(inst, event, None) == 0
            ):
                self._take(inst, self.edges[state, event], "fire", out)
                return

    def fire(self, key: Hashable, event: str, payload: Mapping[str, Any] | None = None) -> Outcome:
        """After close() every instance is final or gone, so every event is refused, and counted nowhere."""
        out = Outcome(event=event)
        inst = self.live.get(key)
        if self.closed:
            out.refused, out.state = "closed", inst.state if inst is not None else None
            return out
        if inst is None:
            kind = "late" if key in self.retired else "unknown"
            if not (kind == "unknown" and self._keep(out, self.spec.key, key, event, payload)):
                self._anomaly(out, kind, self.spec.key, key, event)
            return out
        out.state = inst.state
        edge = self.edges.get((inst.state, event))
        if edge is None:
            out.refused = "ignored" if (inst.state, event) in self.ignored else "illegal"
            self.counts[out.refused] += 1
            return out
        if not self._hear(inst, event, payload, out):
            return out
        self._take(inst, edge, "fire", out, {k: v for k, v in (payload or {}).items() if k != "sender"})
        out.state = inst.state
        return out

    def deliver(self, event: str, ident: Hashable, payload: Mapping[str, Any] | None = None) -> Outcome:
        """A peer's message: ``event`` for the instance ``ident`` names in the space the spec routes it by.

        An id that names no current instance is counted (``unknown``, ``late``
        or ``stale``) and not applied, even after close(): nothing is refused
        before the id is resolved.
        """
        space = self.spec.routed_by(event)
        if space == self.spec.key:
            out = self.fire(ident, event, payload)
            out.key = ident if out.refused != "unknown" else None
            return out
        key, kind = self.resolve(space, ident)
        if key is None:
            out = Outcome(event=event)
            if not (kind == "unknown" and self._keep(out, space, ident, event, payload)):
                self._anomaly(out, kind, space, ident, event)
            return out
        out = self.fire(key, event, payload)
        out.key = key
        return out

    def poll(self, now: float | None = None) -> Outcome:
        """Fire the deadlines due at ``now`` (default: the clock): the states' own first, state by state in
        declaration order, then the phases', phase by phase; any armed during this poll waits for the next."""
        out = Outcome()
        now = self.now if now is None else now
        self._drop_kept(now)
        before = self._seq  # deadlines armed from here on are this poll's own
        for seq, inst in self._due(now):
            if inst.seq != seq or inst.due is None:
                continue
            _after, event = self.after[inst.state]
            self.counts["timeouts"] += 1
            self._take(inst, self.edges[inst.state, event], "timeout", out)
            if self.settle is not None:
                self.settle(out)
            out.fired.append((inst.key, event, inst.state))
        for phase, seq, inst in self._phases_due(now, before):
            if inst.phases.get(phase, (0.0, -1))[1] != seq or self.live.get(inst.key) is not inst:
                continue  # left the phase since (or forced out): disarmed
            due, _seq = inst.phases.pop(phase)  # fires once per entry
            after, event = self.phase_after[phase]
            out.expired.append(Expiry(inst.key, phase, due - after, inst.inside.pop(phase, 0)))
            self.counts["timeouts"] += 1
            self._take(inst, self.edges[inst.state, event], "timeout", out, deadline=phase)
            if self.settle is not None:
                self.settle(out)
            out.fired.append((inst.key, event, inst.state))
        return out

    def _due(self, now: float) -> list[tuple[int, Instance]]:
        """``(arming number, instance)`` for each deadline due at ``now``: by state declaration, then arming."""
        due = [i for i in self.live.values() if i.due is not None and i.due <= now]
        return [(i.seq, i) for i in sorted(due, key=lambda i: (self.order[i.state], i.seq))]

    def _phases_due(self, now: float, before: int) -> list[tuple[str, int, Instance]]:
        """``(phase, arming number, instance)`` for each phase deadline armed before arming number ``before``
        and due at ``now``: by phase declaration, then arming."""
        rank = {name: i for i, name in enumerate(self.phase_after)}
        due = [
            (rank[p], seq, p, inst)
            for inst in self.live.values()
            for p, (when, seq) in inst.phases.items()
            if when <= now and seq <= before
        ]
        return [(p, seq, inst) for _r, seq, p, inst in sorted(due, key=lambda d: (d[0], d[1]))]

    def drain(self) -> Outcome:
        out = Outcome()
        done, self.finished = self.finished, []
        for inst in done:
            if self.live.get(inst.key) is inst:
                del self.live[inst.key]
                self.retired.add(inst.key)
                self._unlink(inst.key, None)
            else:  # begun again since: the ids of its earlier generations retire, the current one's stay
                self._unlink(inst.key, self.live[inst.key].gen if inst.key in self.live else None)
            out.drained.append((inst.key, inst.state))
            out.unordered += inst.by_close  # after a close nothing else finishes, so these come last
        return out

    def close(self) -> Outcome:
        """Abort every live instance; one abort cannot finish is released by force (a ``forced`` anomaly).

        A second close() does nothing. Afterwards begin and fire are refused
        (TrackerClosed); poll finds nothing armed and finished() still drains.
        """
        out = Outcome()
        if self.closed:
            return out
        self._drop_kept(math.inf)
        for key, inst in list(self.live.items()):
            if self.spec.states[inst.state].is_final:
                continue
            edge = self.edges.get((inst.state, ABORT))
            if edge is not None:
                self._take(inst, edge, "close", out)
                inst.by_close = True
                if self.settle is not None:
                    self.settle(out)
            if not self.spec.states[inst.state].is_final:
                self._anomaly(Outcome(), "forced", self.spec.key, key, ABORT)
                del self.live[key]
                self._unlink(key, None)
                inst.due = None
                inst.phases.clear()
                out.forced.append(key)
                releases = tuple(self.spec.resources[r].release for r in self.spec.holds(inst.state))
                self._release(out, key, ABORT, releases, inst.state)
                if self.on_forced is not None:
                    self.on_forced(key, out)
                    if self.settle is not None:
                        self.settle(out)
        self.closed = True
        return out

    # -- the transition ----------------------------------------------------------

    def _take(
        self,
        inst: Instance,
        edge: ActionEdge,
        how: How,
        out: Outcome,
        payload: Mapping[str, Any] | None = None,
        deadline: str = "",
    ) -> None:
        """do → acquires → state change (deadlines) → links → releases; a raise before the change fires on_error
        instead. ``deadline``: the phase whose deadline fired this transition ("" for none, or the state's own)."""
        key = inst.key
        mine = len(out.failures)
        if not edge.bare:
            if edge.do is not None and self._call(out, edge.do, key):
                self._failed(out, key, edge.event, edge.do, "do")
                self._on_error(inst, edge, mine, out)
                return
            for done, (acquire, _release) in enumerate(edge.acquires):
                if self._call(out, acquire, key):
                    self._failed(out, key, edge.event, acquire, "acquire")
                    self._release(out, key, edge.event, tuple(r for _a, r in edge.acquires[:done]), "")
                    self._on_error(inst, edge, mine, out)
                    return
        source = inst.state
        inst.state = edge.target
        inst.due = None
        if edge.target != source:
            inst.heard = set()  # a count lives for one stay in its state
        self._arm(inst)
        self._move_phases(inst, source)
        if self.spec.states[edge.target].is_final:
            self.finished.append(inst)
        if not edge.bare:
            self._link(out, inst, edge.event, edge.event, payload)
        out.moves.append(Move(key, edge.event, source, edge.target, how, deadline))
        self._release(out, key, edge.event, edge.releases, edge.target)
        if self.on_move is not None:
            self.on_move(inst, out.moves[-1], out)
        if edge.target != source:
            self._at_once(inst, out)

    def _on_error(self, inst: Instance, failed: ActionEdge, mine: int, out: Outcome) -> None:
        """Fire on_error from the source, if it handles it (bare if ``failed`` is that very edge);
        failures since ``mine`` report the state the instance ends in."""
        handled = len(out.failures)
        on_error = self.spec.on_error
        handler = self.edges.get((inst.state, on_error)) if on_error is not None else None
        if handler is not None:
            if handler is failed:
                handler = ActionEdge(
                    handler.source, handler.event, handler.target, None, (), handler.releases, bare=True
                )
            self._take(inst, handler, "on_error", out)
        for failure in out.failures[mine:handled]:
            failure.state = inst.state

    def _release(self, out: Outcome, key: Hashable, event: str, releases: tuple[str, ...], state: str) -> None:
        """Each release on its own: one that raises is reported and the others still run."""
        for release in releases:
            if self._call(out, release, key):
                self._failed(out, key, event, release, "release", state)

    def _failed(self, out: Outcome, key: Hashable, event: str, action: str, phase: Phase, state: str = "") -> None:
        self.counts["release_errors" if phase == "release" else "action_errors"] += 1
        out.failures.append(ExpectedFailure(key, event, action, phase, state))

    def _arm(self, inst: Instance) -> None:
        timed = self.after.get(inst.state)
        if timed is not None:
            self._seq += 1
            inst.due, inst.seq = self.now + timed[0], self._seq

    def _move_phases(self, inst: Instance, source: str | None) -> None:
        """``inst`` has just moved from ``source`` (None: begun) to its state: leaving a phase disarms its deadline,
        entering one arms it at ``now + after``, a move inside one (or a self-loop) leaves it as it is."""
        if not self.phase_after:
            return
        entered, left = self.spec.phase_moves(source, inst.state)
        for phase in left:
            inst.phases.pop(phase, None)
            inst.inside.pop(phase, None)
        for phase in inst.phases:
            if phase not in entered and source is not None:
                inst.inside[phase] = inst.inside.get(phase, 0) + 1
        for phase in entered:
            self._seq += 1
            inst.phases[phase] = (self.now + self.phase_after[phase][0], self._seq)
            inst.inside[phase] = 0

    def _keep(self, out: Outcome, space: str, ident: Hashable, event: str, payload: Mapping[str, Any] | None) -> bool:
        """Keep a message of an ``early:`` event for an id not yet known (see ``Tracker``); False: not early here."""
        rule = self.early.get(event)
        if rule is None or self.spec.routed_by(event) != space:
            return False
        keep, within = rule
        if sum(1 for kept in self.kept.values() for e in kept if e[0] == event) >= keep:
            self._anomaly(out, "early", space, ident, event)
            return True
        self._arrivals += 1
        self.kept.setdefault((space, ident), []).append((event, dict(payload or {}), self.now + within, self._arrivals))
        self.counts["kept_early"] += 1
        out.refused = "kept"
        return True

    def _apply_kept(self, out: Outcome, space: str, ident: Hashable, key: Hashable) -> None:
        """The id appeared: apply what was kept for it, oldest first, as the Tracker's queue does."""
        for event, payload, _due, _n in self.kept.pop((space, ident), []):
            inst = self.live.get(key)
            if inst is None:
                continue
            edge = self.edges.get((inst.state, event))
            if edge is None:
                self.counts["ignored" if (inst.state, event) in self.ignored else "illegal"] += 1
                continue
            if self._hear(inst, event, payload, Outcome()):
                self._take(inst, edge, "fire", out, {k: v for k, v in payload.items() if k != "sender"})

    def _drop_kept(self, now: float) -> None:
        """Drop, as ``early`` anomalies in arrival order, the kept messages whose window has passed."""
        due = sorted(
            ((e[2], where, e) for where, kept in self.kept.items() for e in kept), key=lambda x: (x[0], x[2][3])
        )
        for d, where, entry in due:
            if d > now:
                break
            self.kept[where].remove(entry)
            if not self.kept[where]:
                del self.kept[where]
            self._anomaly(Outcome(), "early", where[0], where[1], entry[0])

    def _anomaly(self, out: Outcome, kind: str, space: str, ident: Hashable, event: str) -> None:
        """Count a message that named no current instance; the call is refused as ``unknown``."""
        self.counts[kind] += 1
        self.anomalies.append((kind, space, ident, event))
        out.refused, out.anomaly = "unknown", kind

    def _link(self, out: Outcome, inst: Instance, at: str, event: str, payload: Mapping[str, Any] | None) -> None:
        """Link the ids ``payload`` carries for the spaces linked at ``at``; one naming another live instance fails."""
        for space in self.spec.linked_at(at):
            if not payload or space not in payload:
                continue
            ident = payload[space]
            table = self.links[space]
            other = table.get(ident)
            if other == (inst.key, inst.gen):
                continue
            owner = self.live.get(other[0]) if other is not None else None
            if owner is not None and other is not None and owner.gen == other[1] and not self.is_final(owner.key):
                self._failed(out, inst.key, event, f"<link {space}>", "link", inst.state)
                continue
            table[ident] = (inst.key, inst.gen)
            self._apply_kept(out, space, ident, inst.key)

    def _unlink(self, key: Hashable, below: int | None) -> None:
        """Retire ``key``'s linked ids (only those of generations before ``below``, if given)."""
        for space, table in self.links.items():
            for ident, (owner, gen) in list(table.items()):
                if owner == key and (below is None or gen < below):
                    del table[ident]
                    self.retired_ids[space][ident] = None


__all__ = [
    "NOT_BEGUN",
    "ActionEdge",
    "Call",
    "ExpectedFailure",
    "Expiry",
    "Fault",
    "How",
    "Instance",
    "Move",
    "Outcome",
    "SpecModel",
]
