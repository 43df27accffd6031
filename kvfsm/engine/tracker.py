"""The Tracker: every live instance of one machine, moved by checked events.

Per instance it keeps a four-slot record (state, deadline, serial, links);
resources held are never stored, they are ``state.holds`` by definition, so the
ledger cannot drift from the state. One re-entrant lock makes every public call
atomic; an event fired from inside a driver action is queued and runs after the
current transition (run to completion).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import ActionError, Anomaly, DuplicateKey, Failure, IllegalTransition, KvfsmError, Phase, TrackerClosed
from ..spec import Spec, load
from ..spec.model import ABORT
from .deadlines import DeadlineHeap
from .program import IGNORED, CEdge, CState, compile_program

Observer = Callable[[Hashable, int, str, str, str, float], None]
"""Called after each transition with (key, generation, event, from, to, time)."""

ANOMALY_LIMIT = 10_000


class Instance:
    """One request's place in the machine. ``serial`` is its generation, unique per tracker."""

    __slots__ = ("deadline", "key", "links", "serial", "state")

    def __init__(self, key: Hashable, state: CState, serial: int) -> None:
        self.key = key
        self.state = state
        self.deadline: Any = None
        self.serial = serial
        self.links: list[tuple[str, Hashable]] | None = None


class Tracker:
    """Tracks every instance of one machine and runs its driver's actions.

    >>> tracker = Tracker(kvfsm.load("specs/kv_request.yaml"), driver)
    >>> tracker.begin("req-1")
    >>> tracker.fire("req-1", "enqueue")
    'queued'
    """

    def __init__(
        self,
        spec: Spec | str | Path,
        driver: object,
        *,
        clock: Callable[[], float] = time.monotonic,
        params: Mapping[str, float] | None = None,
        spaces: Iterable[str] = (),
        observer: Observer | None = None,
    ) -> None:
        if not isinstance(spec, Spec):
            spec = load(spec)
        self.spec = spec
        self.driver = driver
        self._program = compile_program(spec, driver, params)
        self._by_name = self._program.by_name
        self._begin_edge = self._program.begin
        self._clock = clock
        self._observer = observer
        self._lock = threading.RLock()
        self._live: dict[Hashable, Instance] = {}
        self._links: dict[str, dict[Hashable, Instance]] = {space: {} for space in spaces}
        self._deadlines = DeadlineHeap()
        self._finished: list[Instance] = []
        self._population = [0] * len(self._program.states)
        self._queue: deque[tuple[Instance | None, Hashable, str, dict[str, Any]]] = deque()
        self._busy = False
        self._closed = False
        self._serial = 0
        self._failures: list[Failure] = []
        self._anomalies: deque[Anomaly] = deque(maxlen=ANOMALY_LIMIT)
        self.counts = dict.fromkeys(
            ("transitions", "ignored", "illegal", "unknown", "stale", "timeouts", "action_errors", "release_errors"), 0
        )
        """Running totals; ``unknown`` and ``stale`` count events that were dropped, not raised."""

    # -- lifecycle ---------------------------------------------------------

    def begin(self, key: Hashable, /, **payload: Any) -> int:
        """Start an instance in the initial state, acquiring what it holds; returns its generation.

        A key whose earlier instance has finished may be reused: the new
        instance is a new generation and late events for the old one are stale.
        """
        with self._lock:
            if self._closed:
                raise TrackerClosed(f"tracker for {self.spec.name!r} is closed; begin({key!r}) refused")
            old = self._live.get(key)
            if old is not None and not old.state.final:
                raise DuplicateKey(
                    f"{key!r} is already live in state {old.state.name!r}; finish it before beginning it again"
                )
            edge = self._begin_edge
            self._serial += 1
            inst = Instance(key, edge.target, self._serial)
            if edge.acquires:
                self._busy = True
                try:
                    failed = self._acquire(inst, edge, payload)
                finally:
                    self._busy = False
                if failed >= 0:
                    self._failures[failed] = replace(self._failures[failed], state="(not begun)")
                    self._raise_failures()
            self._live[key] = inst
            self._population[edge.target.index] += 1
            if edge.target.after is not None:
                self._deadlines.arm(inst, self._clock() + edge.target.after)
            if self._observer is not None:
                self._observer(key, inst.serial, "begin", "", edge.target.name, self._clock())
            return inst.serial

    def fire(self, key: Hashable, event: str, /, **payload: Any) -> str | None:
        """Apply ``event`` to ``key``'s instance; returns its state afterwards.

        Raises :class:`IllegalTransition` (nothing changed) for an event the
        state neither handles nor ignores, and :class:`ActionError` after a
        driver action raised (the instance is already in a defined state).
        An unknown key is counted and reported by :meth:`anomalies`, and
        ``None`` is returned; so is an event fired from inside an action, which
        is queued and runs once the current transition is complete.
        """
        with self._lock:
            if self._busy:
                self._queue.append((None, key, event, payload))
                return None
            inst = self._live.get(key)
            if inst is None:
                self._anomaly("unknown", self.spec.key, key, event)
                return None
            return self._dispatch(inst, event, payload)

    def fire_by(self, space: str, ident: Hashable, event: str, /, **payload: Any) -> str | None:
        """Like :meth:`fire`, for the instance linked to ``ident`` in id space ``space``.

        An id of an instance whose key has since been reused is reported as
        ``stale`` and not applied; an id never linked (or long retired) as
        ``unknown``.
        """
        if space == self.spec.key:
            return self.fire(ident, event, **payload)
        with self._lock:
            inst = self._space(space).get(ident)
            if inst is None:
                self._anomaly("unknown", space, ident, event)
                return None
            if self._live.get(inst.key) is not inst:
                self._anomaly("stale", space, ident, event)
                return None
            if self._busy:
                self._queue.append((inst, inst.key, event, payload))
                return None
            return self._dispatch(inst, event, payload)

    def link(self, key: Hashable, space: str, ident: Hashable) -> None:
        """Let ``ident`` in id space ``space`` name ``key``'s current instance."""
        with self._lock:
            inst = self._live.get(key)
            if inst is None:
                raise KvfsmError(f"cannot link {space}={ident!r}: {key!r} has no instance")
            table = self._space(space)
            other = table.get(ident)
            if other is not None and other is not inst and self._live.get(other.key) is other and not other.state.final:
                raise KvfsmError(
                    f"{space}={ident!r} already names live {other.key!r}; an id may name one live instance"
                )
            table[ident] = inst
            if inst.links is None:
                inst.links = []
            inst.links.append((space, ident))

    def route(self, space: str, ident: Hashable) -> Hashable | None:
        """The key ``ident`` names in ``space`` (its current generation only), or None."""
        with self._lock:
            if space == self.spec.key:
                return ident if ident in self._live else None
            inst = self._space(space).get(ident)
            return inst.key if inst is not None and self._live.get(inst.key) is inst else None

    def poll(self, now: float | None = None) -> list[tuple[Hashable, str, str]]:
        """Fire every timeout due at ``now`` (default: the clock); returns (key, event, new state)."""
        with self._lock:
            if now is None:
                now = self._clock()
            fired: list[tuple[Hashable, str, str]] = []
            self._busy = True
            try:
                for inst in self._deadlines.pop_due(now):
                    state = inst.state
                    event = state.timeout_event
                    assert event is not None  # armed only for states with a timeout
                    self.counts["timeouts"] += 1
                    self._step(inst, state.row[event], {})
                    self._drain()
                    fired.append((inst.key, event, inst.state.name))
            finally:
                self._busy = False
            if self._failures:
                self._raise_failures()
            return fired

    def close(self) -> None:
        """Shut down: abort every live instance and release all it holds, then refuse new work.

        An instance that abort cannot finish (its abort leads to a live state,
        or abort's action fails and on_error keeps it live) has its resources
        released directly and is reported as a ``forced`` anomaly.
        """
        with self._lock:
            if self._closed:
                return
            self._busy = True
            try:
                for inst in [i for i in self._live.values() if not i.state.final]:
                    edge = inst.state.row.get(ABORT)
                    if isinstance(edge, CEdge):
                        self._step(inst, edge, {})
                        self._drain()
                    if not inst.state.final:
                        self._force_release(inst)
            finally:
                self._busy = False
                self._closed = True
            if self._failures:
                self._raise_failures()

    # -- queries -------------------------------------------------------------

    def state(self, key: Hashable) -> str | None:
        """The state of ``key``'s current instance, or None if it has none (never begun, or drained)."""
        inst = self._live.get(key)
        return inst.state.name if inst is not None else None

    def held(self, key: Hashable) -> tuple[str, ...]:
        """Resources the spec says ``key`` holds now (none for finished or unknown keys)."""
        inst = self._live.get(key)
        return inst.state.holds if inst is not None else ()

    def generation(self, key: Hashable) -> int | None:
        inst = self._live.get(key)
        return inst.serial if inst is not None else None

    def finished(self) -> list[tuple[Hashable, str]]:
        """Drain ``(key, final state)`` for every instance finished since the last call.

        Drained instances are retired: their key and linked ids stop naming them.
        """
        with self._lock:
            done, self._finished = self._finished, []
            live, links, population = self._live, self._links, self._population
            out = []
            for inst in done:
                key = inst.key
                if live.get(key) is inst:
                    del live[key]
                if inst.links is not None:
                    for space, ident in inst.links:
                        table = links[space]
                        if table.get(ident) is inst:
                            del table[ident]
                population[inst.state.index] -= 1
                out.append((key, inst.state.name))
            return out

    def census(self) -> dict[str, int]:
        """Instances per state (finished ones count until drained)."""
        return {s.name: self._population[s.index] for s in self._program.states}

    def holding(self) -> dict[str, int]:
        """How many instances hold each resource now — the ledger, derived from the census."""
        out = dict.fromkeys(self.spec.resources, 0)
        for s in self._program.states:
            for r in s.holds:
                out[r] += self._population[s.index]
        return out

    def live(self) -> int:
        """Instances not yet in a final state."""
        return sum(self._population[s.index] for s in self._program.states if not s.final)

    def next_deadline(self) -> float | None:
        with self._lock:
            return self._deadlines.next_due()

    def anomalies(self) -> list[Anomaly]:
        """Drain the events that were dropped (unknown or stale ids) since the last call."""
        with self._lock:
            out = list(self._anomalies)
            self._anomalies.clear()
            return out

    # -- the transition itself ----------------------------------------------

    def _dispatch(self, inst: Instance, event: str, payload: dict[str, Any]) -> str:
        """Check and apply one external event, then everything it queued."""
        edge = inst.state.row.get(event)
        if edge is None:
            self.counts["illegal"] += 1
            raise IllegalTransition(inst.key, event, inst.state.name, list(inst.state.row))
        if edge is IGNORED:
            self.counts["ignored"] += 1
            return inst.state.name
        self._busy = True
        try:
            self._step(inst, edge, payload)
            if self._queue:
                self._drain()
        finally:
            self._busy = False
        if self._failures:
            self._raise_failures()
        return inst.state.name

    def _step(self, inst: Instance, edge: CEdge, payload: dict[str, Any]) -> None:
        """do → acquires → state change → releases; on a raise before the change, on_error instead."""
        key = inst.key
        if edge.prepare:
            try:
                if edge.do is not None:
                    edge.do(key, **payload)
            except Exception as exc:
                self._on_error(inst, edge, self._record(inst, edge.event, edge.do_name or "", "do", exc))
                return
            if edge.acquires:
                failed = self._acquire(inst, edge, payload)
                if failed >= 0:
                    self._on_error(inst, edge, failed)
                    return
        self._commit(inst, edge, payload)

    def _commit(self, inst: Instance, edge: CEdge, payload: dict[str, Any]) -> None:
        source, target = inst.state, edge.target
        inst.state = target
        population = self._population
        population[source.index] -= 1
        population[target.index] += 1
        self.counts["transitions"] += 1
        if inst.deadline is not None:
            self._deadlines.disarm(inst)
        if target.after is not None:
            self._deadlines.arm(inst, self._clock() + target.after)
        if target.final:
            self._finished.append(inst)
        key = inst.key
        for name, release in edge.releases:
            try:
                release(key, **payload)
            except Exception as exc:
                self.counts["release_errors"] += 1
                self._failures.append(Failure(key, edge.event, name, "release", exc, target.name))
        if self._observer is not None:
            self._observer(key, inst.serial, edge.event, source.name, target.name, self._clock())

    def _acquire(self, inst: Instance, edge: CEdge, payload: dict[str, Any]) -> int:
        """Run the edge's acquires; if one raises, undo those done. Returns the failure's index, or -1."""
        key = inst.key
        for done, (name, acquire, _undo) in enumerate(edge.acquires):
            try:
                acquire(key, **payload)
            except Exception as exc:
                index = self._record(inst, edge.event, name, "acquire", exc)
                for uname, _a, undo in edge.acquires[:done]:
                    try:
                        undo(key, **payload)
                    except Exception as uexc:
                        self.counts["release_errors"] += 1
                        self._failures.append(Failure(key, edge.event, uname, "release", uexc, inst.state.name))
                return index
        return -1

    def _record(self, inst: Instance, event: str, action: str, phase: Phase, exc: BaseException) -> int:
        """Keep a failure for the caller; returns its index so its end state can be filled in."""
        self.counts["action_errors"] += 1
        self._failures.append(Failure(inst.key, event, action, phase, exc, inst.state.name))
        return len(self._failures) - 1

    def _on_error(self, inst: Instance, edge: CEdge, failure: int) -> None:
        """An action on ``edge`` raised before the state changed: fire on_error from the source.

        If the failing edge is the on_error path itself, it is committed without
        its actions, so an error while handling an error still ends in the
        state the spec names for it, with its resources released.
        """
        handler = inst.state.error_edge
        if handler is edge:
            self._commit(inst, edge, {})
        elif handler is not None:
            self._step(inst, handler, {})
        self._failures[failure] = replace(self._failures[failure], state=inst.state.name)

    def _drain(self) -> None:
        """Run events queued from inside actions, oldest first, until none remain."""
        queue = self._queue
        while queue:
            target, key, event, payload = queue.popleft()
            inst = target if target is not None else self._live.get(key)
            if inst is None:
                self._anomaly("unknown", self.spec.key, key, event)
                continue
            edge = inst.state.row.get(event)
            if edge is None:
                self.counts["illegal"] += 1
                self._record(
                    inst,
                    event,
                    "<queued event>",
                    "do",
                    IllegalTransition(key, event, inst.state.name, list(inst.state.row)),
                )
            elif edge is IGNORED:
                self.counts["ignored"] += 1
            else:
                self._step(inst, edge, payload)

    def _force_release(self, inst: Instance) -> None:
        """Release everything ``inst`` holds without a transition (close() of an unfinishable instance)."""
        self._anomaly("forced", self.spec.key, inst.key, ABORT)
        for r in inst.state.holds:
            res = self.spec.resources[r]
            try:
                getattr(self.driver, res.release)(inst.key)
            except Exception as exc:
                self.counts["release_errors"] += 1
                self._failures.append(Failure(inst.key, ABORT, res.release, "release", exc, inst.state.name))
        self._population[inst.state.index] -= 1
        if inst.deadline is not None:
            self._deadlines.disarm(inst)
        if self._live.get(inst.key) is inst:
            del self._live[inst.key]

    # -- reporting -------------------------------------------------------------

    def _space(self, space: str) -> dict[Hashable, Instance]:
        table = self._links.get(space)
        if table is None:
            known = ", ".join([self.spec.key, *self._links]) or "none"
            raise KvfsmError(
                f"id space {space!r} is not declared for this tracker (declared: {known}); pass spaces=[{space!r}, ...] to Tracker()"
            )
        return table

    def _anomaly(self, kind: Any, space: str, ident: Hashable, event: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self._anomalies.append(Anomaly(kind, space, ident, event))

    def _raise_failures(self) -> None:
        failures, self._failures = self._failures, []
        if len(failures) == 1 and isinstance(failures[0].error, IllegalTransition):
            raise failures[0].error
        raise ActionError(failures)
