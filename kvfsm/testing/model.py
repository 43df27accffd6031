"""What a spec says must happen, computed from the spec model alone: the oracle of model-based tests.

A plain interpretation, independent of the engine on purpose: a dict of
``(state, event) → edge`` built from :meth:`Spec.edges`, the set of pairs
:meth:`Spec.ignored` makes legal no-ops, one record per instance, and the set
of driver actions an injected fault will make raise. Each call returns an
:class:`Outcome` (the transitions taken, the failures an ``ActionError`` must
carry, the value the Tracker must return); the generated tests hold the
Tracker and the driver's real resources to it after every step.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..spec.model import ABORT, Spec

How = Literal["begin", "fire", "timeout", "on_error", "close"]
"""What made a transition happen."""

NOT_BEGUN = "(not begun)"
"""The state a failure at ``begin`` reports: no instance was created."""


@dataclass(frozen=True)
class Step:
    """One transition the spec prescribes (``source`` is ``""`` for begin)."""

    key: str
    event: str
    source: str
    target: str
    how: How


@dataclass
class Expected:
    """One :class:`~kvfsm.Failure` the Tracker must report: which action, and where the instance ended."""

    key: str
    event: str
    action: str
    phase: str
    state: str = ""

    def as_tuple(self) -> tuple[str, str, str, str, str]:
        return (self.key, self.event, self.action, self.phase, self.state)


Refusal = Literal["ignored", "illegal", "unknown", "duplicate", "closed"]


@dataclass
class Outcome:
    """What one call to the Tracker must do."""

    steps: list[Step] = field(default_factory=list)
    failures: list[Expected] = field(default_factory=list)
    """Non-empty: the call must raise ActionError carrying exactly these."""
    event: str = ""
    """fire(): the event fired."""
    refused: Refusal | None = None
    """A call that moved nothing: an event ignored (legal), illegal (IllegalTransition) or for an
    unknown key; a begin of a live key (DuplicateKey); any begin or fire after close() (TrackerClosed)."""
    state: str | None = None
    """The state the event met (for refusals) or the call returns (for fire)."""
    fired: list[tuple[str, str, str]] = field(default_factory=list)
    """poll(): (key, event, state afterwards) per timeout fired."""
    drained: list[tuple[str, str]] = field(default_factory=list)
    """finished(): (key, final state) per instance retired."""
    unordered: int = 0
    """finished(): how many of the last ``drained`` close() finished; the spec leaves their order open."""
    forced: list[str] = field(default_factory=list)
    """close(): keys whose resources were released without a transition."""


@dataclass(frozen=True)
class _Edge:
    source: str
    event: str
    target: str
    prepare: tuple[tuple[str, str], ...]
    """(action, phase) that run before the state changes, in order: the do, then acquires."""
    bare: bool = False

    @property
    def prepare_actions(self) -> tuple[str, ...]:
        return tuple(a for a, _phase in self.prepare)


class _Instance:
    """One begun instance: its state and its armed deadline, if any."""

    __slots__ = ("by_close", "due", "key", "seq", "state")

    def __init__(self, key: str, state: str) -> None:
        self.key = key
        self.state = state
        self.due: float | None = None
        self.seq = 0
        self.by_close = False


class SpecModel:
    """The spec's semantics over a handful of keys, with a clock and pending faults.

    ``faults`` holds the actions whose next call will raise: the driver was
    told so through ``inject_fault``, and the model knows which edges call which
    actions, so it can say exactly which transition a fault breaks.
    """

    def __init__(self, spec: Spec, params: Mapping[str, float] | None = None) -> None:
        self.spec = spec
        self.edges: dict[tuple[str, str], _Edge] = {}
        for e in spec.edges():
            prepare = [(e.do, "do")] if e.do else []
            for r in spec.acquires(e.source, e.target):
                acquire = spec.resources[r].acquire
                if acquire:
                    prepare.append((acquire, "acquire"))
            self.edges[e.source, e.event] = _Edge(e.source, e.event, e.target, tuple(prepare))
        self.ignored = {(state, event) for state, event, _rule in spec.ignored()}
        self.after = {
            s.name: (spec.param(s.timeout.after, params), s.timeout.fire)
            for s in spec.states.values()
            if s.timeout is not None
        }
        self.order = {name: i for i, name in enumerate(spec.states)}
        initial = spec.initial.name
        self.begin_acquires = tuple(
            (a, "acquire") for r in spec.holds(initial) if (a := spec.resources[r].acquire) is not None
        )
        self.live: dict[str, _Instance] = {}
        """The current instance per key, final ones included until drained (insertion order as the Tracker's)."""
        self.finished: list[_Instance] = []
        self.faults: set[str] = set()
        self.now = 0.0
        self.closed = False
        self.counts = dict.fromkeys(
            ("ignored", "illegal", "unknown", "stale", "forced", "timeouts", "action_errors", "release_errors"), 0
        )
        self.anomalies: list[tuple[str, str, str, str]] = []
        self._seq = 0

    # -- queries -------------------------------------------------------------

    def state(self, key: str) -> str | None:
        inst = self.live.get(key)
        return inst.state if inst is not None else None

    def held(self, key: str) -> tuple[str, ...]:
        state = self.state(key)
        return self.spec.holds(state) if state is not None else ()

    def is_final(self, key: str) -> bool:
        state = self.state(key)
        return state is not None and self.spec.states[state].is_final

    def live_count(self) -> int:
        return sum(not self.spec.states[i.state].is_final for i in self.live.values())

    def next_deadline(self) -> float | None:
        dues = [i.due for i in self.live.values() if i.due is not None]
        return min(dues) if dues else None

    def begin_actions(self, key: str) -> tuple[str, ...]:
        """Actions ``begin(key)`` will run, in order (none for a live key, DuplicateKey, or once closed)."""
        old = self.live.get(key)
        if self.closed or (old is not None and not self.spec.states[old.state].is_final):
            return ()
        return tuple(a for a, _phase in self.begin_acquires)

    def fire_actions(self, key: str, event: str) -> tuple[str, ...]:
        """Actions ``fire(key, event)`` will run before the state changes, in order."""
        inst = self.live.get(key)
        edge = self.edges.get((inst.state, event)) if inst is not None and not self.closed else None
        return edge.prepare_actions if edge is not None else ()

    def poll_actions(self) -> tuple[str, ...]:
        """Actions the timeouts due now will run before their states change, in firing order."""
        out: list[str] = []
        for _order, _seq, inst in self._due():
            _after, event = self.after[inst.state]
            out += self.edges[inst.state, event].prepare_actions
        return tuple(out)

    def movable(self, running: Collection[str] | None = None) -> list[tuple[str, list[str]]]:
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

    def accepted(self, state: str) -> set[str]:
        return {e for (s, e) in self.edges if s == state} | {e for (s, e) in self.ignored if s == state}

    # -- the calls -------------------------------------------------------------

    def begin(self, key: str) -> Outcome:
        out = Outcome(event="begin")
        if self.closed:
            out.refused = "closed"
            return out
        old = self.live.get(key)
        if old is not None and not self.spec.states[old.state].is_final:
            out.refused, out.state = "duplicate", old.state
            return out
        for action, phase in self.begin_acquires:
            if action in self.faults:
                self.faults.discard(action)
                self.counts["action_errors"] += 1
                out.failures.append(Expected(key, "begin", action, phase, NOT_BEGUN))
                return out
        initial = self.spec.initial.name
        inst = self.live[key] = _Instance(key, initial)
        self._arm(inst)
        out.steps.append(Step(key, "begin", "", initial, "begin"))
        return out

    def fire(self, key: str, event: str) -> Outcome:
        """After close() every instance is final or gone, so every event is refused, and counted nowhere."""
        out = Outcome(event=event)
        inst = self.live.get(key)
        if self.closed:
            out.refused, out.state = "closed", inst.state if inst is not None else None
            return out
        if inst is None:
            self._anomaly("unknown", key, event)
            out.refused = "unknown"
            return out
        out.state = inst.state
        edge = self.edges.get((inst.state, event))
        if edge is None:
            out.refused = "ignored" if (inst.state, event) in self.ignored else "illegal"
            self.counts[out.refused] += 1
            return out
        self._step(inst, edge, "fire", out)
        out.state = inst.state
        return out

    def poll(self) -> Outcome:
        """Due timeouts, state by state in declaration order, in arming order within a state."""
        out = Outcome()
        for _order, seq, inst in self._due():
            if inst.seq != seq or inst.due is None:
                continue
            _after, event = self.after[inst.state]
            self.counts["timeouts"] += 1
            self._step(inst, self.edges[inst.state, event], "timeout", out)
            out.fired.append((inst.key, event, inst.state))
        return out

    def _due(self) -> list[tuple[int, int, _Instance]]:
        return sorted(
            ((self.order[i.state], i.seq, i) for i in self.live.values() if i.due is not None and i.due <= self.now),
            key=lambda t: (t[0], t[1]),
        )

    def drain(self) -> Outcome:
        out = Outcome()
        done, self.finished = self.finished, []
        for inst in done:
            if self.live.get(inst.key) is inst:
                del self.live[inst.key]
            out.drained.append((inst.key, inst.state))
            out.unordered += inst.by_close  # after a close nothing else finishes, so these come last
        return out

    def close(self) -> Outcome:
        """Abort every live instance; one abort cannot finish is released by force (a ``forced`` anomaly).

        A second close() does nothing. Afterwards begin and fire are refused
        (TrackerClosed); poll finds nothing armed and finished() still drains.
        """
        out = Outcome()
        for key, inst in list(self.live.items()):
            if self.spec.states[inst.state].is_final:
                continue
            edge = self.edges.get((inst.state, ABORT))
            if edge is not None:
                self._step(inst, edge, "close", out)
                inst.by_close = True
            if not self.spec.states[inst.state].is_final:
                self._anomaly("forced", key, ABORT)
                del self.live[key]
                inst.due = None
                out.forced.append(key)
        self.closed = True
        return out

    # -- the transition ----------------------------------------------------------

    def _step(self, inst: _Instance, edge: _Edge, how: How, out: Outcome) -> None:
        """do → acquires → state change; a pending fault on one of those fires on_error instead."""
        if not edge.bare:
            for action, phase in edge.prepare:
                if action in self.faults:
                    self.faults.discard(action)
                    self.counts["action_errors"] += 1
                    mine = len(out.failures)
                    out.failures.append(Expected(inst.key, edge.event, action, phase))
                    self._on_error(inst, edge, out)
                    for failure in out.failures[mine:]:
                        failure.state = failure.state or inst.state
                    return
        source = inst.state
        inst.state = edge.target
        inst.due = None
        self._arm(inst)
        if self.spec.states[edge.target].is_final:
            self.finished.append(inst)
        out.steps.append(Step(inst.key, edge.event, source, edge.target, how))

    def _on_error(self, inst: _Instance, failed: _Edge, out: Outcome) -> None:
        """Fire on_error from the source; if the failing edge is the handler, take it without its actions."""
        on_error = self.spec.on_error
        handler = self.edges.get((inst.state, on_error)) if on_error is not None else None
        if handler is None:
            return
        if handler is failed:
            handler = _Edge(handler.source, handler.event, handler.target, (), bare=True)
        self._step(inst, handler, "on_error", out)

    def _arm(self, inst: _Instance) -> None:
        timed = self.after.get(inst.state)
        if timed is not None:
            self._seq += 1
            inst.due, inst.seq = self.now + timed[0], self._seq

    def _anomaly(self, kind: Literal["unknown", "forced"], key: str, event: str) -> None:
        self.counts[kind] += 1
        self.anomalies.append((kind, self.spec.key, key, event))
