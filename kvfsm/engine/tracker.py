"""The Tracker: every live instance of one machine, moved by checked events.

An instance is nothing but its key's entry in ``_live``, mapping to its
compiled state. Resources held are never stored: they are ``state.holds`` by
definition, so the ledger cannot drift from the state. Generations, links and
deadlines live in side tables that only the instances using them touch.

One re-entrant lock makes every public call atomic (``threadsafe=False`` drops
it for a tracker used by one thread only). An event fired from inside
a driver action is queued and runs once the current transition is complete
(run to completion).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import (
    ActionError,
    Anomaly,
    AnomalyKind,
    DuplicateKey,
    Failure,
    IllegalTransition,
    KvfsmError,
    Phase,
    TrackerClosed,
)
from ..spec import Spec, load
from ..spec.model import ABORT
from .deadlines import Deadlines
from .program import IGNORED, Action, CEdge, CState, compile_program

Observer = Callable[[Hashable, int, str, str, str, float], None]
"""Called after each transition with (key, generation, event, from, to, time); ``begin`` has from ``""``."""

ANOMALY_LIMIT = 10_000
"""Anomaly records kept between drains; older ones are dropped (the counts keep counting)."""


class Tracker:
    """Tracks every instance of one machine and runs its driver's actions.

    >>> tracker = Tracker(kvfsm.load("specs/kv_request.yaml"), driver)
    >>> tracker.begin("req-1")
    >>> tracker.fire("req-1", "enqueue")
    'queued'

    Invariants, kept by every method below:

    - ``_live[key]`` is the state of key's current instance, from ``begin``
      until ``finished()`` drains it (final states included until then);
    - ``_gens[key]`` is that instance's generation, a number unique in this
      tracker, assigned on first need (a link, the observer, ``generation()``,
      or the key being begun again before its previous instance was drained);
    - ``_deadlines.armed`` holds ``key`` iff ``_live[key]`` has a timeout;
    - ``_links[space][id] == (key, generation)``, and ``_linked[key]`` lists
      the ``(space, id)`` pairs to forget when key's instance is drained.
    """

    __slots__ = (
        "spec", "driver", "counts", "_program", "_begin_edge", "_clock", "_observer", "_lock", "_guard", "_live", "_gens",
        "_links", "_linked", "_deadlines", "_finished", "_queue", "_busy", "_closed", "_failures", "_anomalies",
        "_serial",
    )  # fmt: skip

    def __init__(
        self,
        spec: Spec | str | Path,
        driver: object,
        *,
        clock: Callable[[], float] = time.monotonic,
        params: Mapping[str, float] | None = None,
        spaces: Iterable[str] = (),
        observer: Observer | None = None,
        threadsafe: bool = True,
    ) -> None:
        """Bind ``driver`` to ``spec`` (a model or a path to load and check).

        ``clock`` must be monotonic (deadlines fire in arming order per state);
        ``params`` override the spec's; ``spaces`` declares the id spaces that
        :meth:`link` and :meth:`fire_by` accept besides the spec's key.
        ``threadsafe=False`` skips the lock every call takes (about a third of
        a ``fire`` here): only for a tracker that one thread alone ever calls.
        """
        if not isinstance(spec, Spec):
            spec = load(spec)
        self.spec = spec
        self.driver = driver
        self._program = compile_program(spec, driver, params)
        self._begin_edge = self._program.begin
        self._clock = clock
        self._observer = observer
        self._lock = threading.RLock() if threadsafe else None
        self._guard: AbstractContextManager[Any] = self._lock if self._lock is not None else nullcontext()
        """What the non-hot methods hold; ``begin`` and ``fire`` test ``_lock`` directly."""
        self._live: dict[Hashable, CState] = {}
        self._gens: dict[Hashable, int] = {}
        self._links: dict[str, dict[Hashable, tuple[Hashable, int]]] = {space: {} for space in spaces}
        self._linked: dict[Hashable, list[tuple[str, Hashable]]] = {}
        self._deadlines = Deadlines(len(self._program.states))
        self._finished: list[tuple[Hashable, CState]] = []
        self._queue: deque[tuple[Hashable, str, dict[str, Any]]] = deque()
        self._busy = False
        self._closed = False
        self._serial = 0
        self._failures: list[Failure] = []
        self._anomalies: deque[Anomaly] = deque(maxlen=ANOMALY_LIMIT)
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "ignored",
                "illegal",
                "unknown",
                "stale",
                "forced",
                "timeouts",
                "action_errors",
                "release_errors",
                "observer_errors",
            ),
            0,
        )
        """Running totals; ``unknown`` and ``stale`` count events that were dropped, not raised."""

    # -- lifecycle ---------------------------------------------------------

    def begin(self, key: Hashable, /, **payload: Any) -> None:
        """Start an instance in the initial state, acquiring what it holds.

        A key whose earlier instance has finished may be begun again: the new
        instance is a new generation, and ids linked to the old one go stale.
        Raises :class:`DuplicateKey` while the earlier instance is still live,
        and :class:`ActionError` if an acquire raised (nothing is then held).
        """
        lock = self._lock
        if lock is not None:
            lock.acquire()
        try:
            if self._closed:
                raise TrackerClosed(f"tracker for {self.spec.name!r} is closed; begin({key!r}) refused")
            live = self._live
            old = live.get(key)
            if old is not None and not old.final:
                raise DuplicateKey(
                    f"{key!r} is already live in state {old.name!r}; finish it before beginning it again"
                )
            edge = self._begin_edge
            outer = self._busy
            if edge.acquires:
                self._busy = True
                try:
                    for done, acquire in enumerate(edge.acquire_fns):
                        try:
                            acquire(key, **payload) if payload else acquire(key)
                        except Exception as exc:
                            self._acquire_failed(key, edge, payload, done, exc, "(not begun)")
                            if not outer:
                                self._raise_failures()
                            return
                finally:
                    self._busy = outer
            target = live[key] = edge.target
            if (old is not None and key in self._gens) or self._observer is not None:
                self._gens[key] = self._serial = self._serial + 1
            if target.after is not None:
                self._deadlines.arm(key, target.index, self._clock() + target.after)
            if self._observer is not None:
                self._notify(key, "begin", "", target.name)
            if not outer:
                if self._queue:
                    self._busy = True
                    try:
                        self._drain()
                    finally:
                        self._busy = False
                if self._failures:
                    self._raise_failures()
        finally:
            if lock is not None:
                lock.release()

    def fire(self, key: Hashable, event: str, /, **payload: Any) -> str | None:
        """Apply ``event`` to ``key``'s instance; returns its state afterwards.

        Raises :class:`IllegalTransition` (nothing changed) for an event the
        state neither handles nor ignores, and :class:`ActionError` after a
        driver action raised (the instance is already in a defined state).
        An unknown key is counted and reported by :meth:`anomalies`, and
        ``None`` is returned; so is an event fired from inside an action, which
        is queued and runs once the current transition is complete.
        """
        lock = self._lock
        if lock is not None:
            lock.acquire()
        try:
            if self._busy:
                self._queue.append((key, event, payload))
                return None
            state = self._live.get(key)
            if state is None:
                if self._closed:
                    raise TrackerClosed(f"tracker for {self.spec.name!r} is closed; {event!r} for {key!r} refused")
                self._anomaly("unknown", self.spec.key, key, event)
                return None
            edge = state.row.get(event)
            if edge is None or edge is IGNORED:
                if self._closed:  # after close() every instance is final, so only this path sees it
                    raise TrackerClosed(f"tracker for {self.spec.name!r} is closed; {event!r} for {key!r} refused")
                return self._refuse(key, state, event, edge)
            self._busy = True
            try:
                state = self._step(key, state, edge, payload)
                if self._queue:
                    self._drain()
                    state = self._live[key]
            finally:
                self._busy = False
            if self._failures:
                self._raise_failures()
            return state.name
        finally:
            if lock is not None:
                lock.release()

    def fire_by(self, space: str, ident: Hashable, event: str, /, **payload: Any) -> str | None:
        """Like :meth:`fire`, for the instance ``ident`` names in id space ``space``.

        An id linked to an earlier generation of a reused key is reported as
        ``stale`` and not applied; an id never linked (or retired by a drain)
        as ``unknown``.
        """
        if space == self.spec.key:
            return self.fire(ident, event, **payload)
        with self._guard:
            key = self._resolve(space, ident, event)
            return None if key is None else self.fire(key, event, **payload)

    def link(self, key: Hashable, space: str, ident: Hashable) -> None:
        """Let ``ident`` in id space ``space`` name ``key``'s current instance."""
        with self._guard:
            if key not in self._live:
                raise KvfsmError(f"cannot link {space}={ident!r}: {key!r} has no instance")
            table = self._space(space)
            gen = self._generation(key)
            other = table.get(ident)
            if other is not None and other != (key, gen) and self._current(*other) and not self._live[other[0]].final:
                raise KvfsmError(f"{space}={ident!r} already names live {other[0]!r}; an id may name one live instance")
            table[ident] = (key, gen)
            self._linked.setdefault(key, []).append((space, ident))

    def route(self, space: str, ident: Hashable) -> Hashable | None:
        """The key ``ident`` names in ``space`` (current generations only), or None."""
        with self._guard:
            if space == self.spec.key:
                return ident if ident in self._live else None
            entry = self._space(space).get(ident)
            return entry[0] if entry is not None and self._current(*entry) else None

    def poll(self, now: float | None = None) -> list[tuple[Hashable, str, str]]:
        """Fire every timeout due at ``now`` (default: the clock); returns ``(key, event, new state)``.

        Due timeouts fire state by state in declaration order, and in arming
        order within a state.
        """
        with self._guard:
            if now is None:
                now = self._clock()
            fired: list[tuple[Hashable, str, str]] = []
            states = self._program.states
            self._deadlines.sweep()
            outer = self._busy
            self._busy = True
            try:
                for key, index in self._deadlines.pop_due(now):
                    state = states[index]
                    event = state.timeout_event
                    assert event is not None, "armed only in states with a timeout"
                    self.counts["timeouts"] += 1
                    self._step(key, state, state.row[event], {})
                    if not outer:
                        self._drain()
                    fired.append((key, event, self._live[key].name))
            finally:
                self._busy = outer
            if self._failures and not outer:
                self._raise_failures()
            return fired

    def close(self) -> None:
        """Shut down: abort every live instance and release all it holds, then refuse new work.

        An instance that abort cannot finish (no abort edge, or abort's action
        failed and on_error kept it live) has its resources released directly
        and is reported as a ``forced`` anomaly.
        """
        with self._guard:
            if self._closed:
                return
            if self._busy:
                raise KvfsmError(
                    "close() called from inside a driver action; close the tracker from the thread that owns it"
                )
            self._busy = True
            try:
                for key, state in list(self._live.items()):
                    if state.final:
                        continue
                    edge = state.row.get(ABORT)
                    if isinstance(edge, CEdge):
                        self._step(key, state, edge, {})
                        self._drain()
                    if not self._live[key].final:
                        self._force_release(key)
            finally:
                self._busy = False
                self._closed = True
            if self._failures:
                self._raise_failures()

    # -- queries -------------------------------------------------------------

    def state(self, key: Hashable) -> str | None:
        """The state of ``key``'s current instance, or None if it has none (never begun, or drained)."""
        state = self._live.get(key)
        return state.name if state is not None else None

    def held(self, key: Hashable) -> tuple[str, ...]:
        """Resources the spec says ``key`` holds now (none for finished or unknown keys)."""
        state = self._live.get(key)
        return state.holds if state is not None else ()

    def generation(self, key: Hashable) -> int | None:
        """The generation of ``key``'s current instance (unique in this tracker), or None if it has none."""
        with self._guard:
            return self._generation(key) if key in self._live else None

    def finished(self) -> list[tuple[Hashable, str]]:
        """Drain ``(key, final state)`` for every instance finished since the last call, in order.

        Drained instances are retired: their key and linked ids stop naming them.
        """
        with self._guard:
            done, self._finished = self._finished, []
            live, gens, linked = self._live, self._gens, self._linked
            for key, state in done:
                current = live.pop(key, None)
                if current is state:
                    if gens:
                        gens.pop(key, None)
                    if linked and key in linked:
                        self._unlink(key, keep_from=None)
                    continue
                if current is not None:  # key begun again since: its new instance stays
                    live[key] = current
                if linked and key in linked:
                    self._unlink(key, keep_from=gens.get(key))
            return [(key, state.name) for key, state in done]

    def census(self) -> dict[str, int]:
        """Current instances per state; finished ones count until drained. O(instances)."""
        with self._guard:
            counts = Counter(self._live.values())
        return {s.name: counts[s] for s in self._program.states}

    def holding(self) -> dict[str, int]:
        """How many instances hold each resource now: the ledger, derived from the census."""
        out = dict.fromkeys(self.spec.resources, 0)
        with self._guard:
            counts = Counter(self._live.values())
        for state, count in counts.items():
            for r in state.holds:
                out[r] += count
        return out

    def live(self) -> int:
        """Instances not yet in a final state. O(instances)."""
        with self._guard:
            return sum(not state.final for state in self._live.values())

    def next_deadline(self) -> float | None:
        """When the earliest armed deadline is due, or None: how long a caller may sleep before ``poll``."""
        with self._guard:
            return self._deadlines.next_due()

    def anomalies(self) -> list[Anomaly]:
        """Drain the events that were dropped (unknown or stale ids) since the last call."""
        with self._guard:
            out = list(self._anomalies)
            self._anomalies.clear()
            return out

    # -- the transition itself ----------------------------------------------

    def _step(self, key: Hashable, source: CState, edge: CEdge, payload: dict[str, Any]) -> CState:
        """do → acquires → state change → releases (each on its own); returns the state it ends in.

        A raise before the state change fires on_error from ``source`` instead.
        Deliberately one flat function: it is the per-event path.
        """
        if edge.prepare:
            do = edge.do
            if do is not None:
                try:
                    do(key, **payload) if payload else do(key)
                except Exception as exc:
                    return self._on_error(
                        key, source, edge, self._record(key, edge.event, edge.do_name or "", "do", exc, source.name)
                    )
            done = 0
            for acquire in edge.acquire_fns:
                try:
                    acquire(key, **payload) if payload else acquire(key)
                except Exception as exc:
                    failure = self._acquire_failed(key, edge, payload, done, exc, source.name)
                    return self._on_error(key, source, edge, failure)
                done += 1  # noqa: SIM113 - enumerate() costs an object per event here
        target = self._live[key] = edge.target
        if source.after is not None:
            self._deadlines.armed.pop(key, None)  # disarm (poll may have already)
        if target.after is not None:  # arm, inlined: see Deadlines
            entry = (self._clock() + target.after, key)
            self._deadlines.armed[key] = entry
            self._deadlines.queues[target.index].append(entry)
        if target.final:
            self._finished.append((key, target))
        for release in edge.release_fns:
            try:
                release(key, **payload) if payload else release(key)
            except Exception as exc:
                self._release_failed(key, edge, release, exc, target)
        if self._observer is not None:
            self._notify(key, edge.event, source.name, target.name)
        return target

    def _notify(self, key: Hashable, event: str, source: str, target: str) -> None:
        """Tell the observer; one that raises is reported like a failed action and changes nothing."""
        assert self._observer is not None
        try:
            self._observer(key, self._gens[key], event, source, target, self._clock())
        except Exception as exc:
            self.counts["observer_errors"] += 1
            self._failures.append(
                Failure(key, event, getattr(self._observer, "__name__", "observer"), "observer", exc, target)
            )

    def _release_failed(self, key: Hashable, edge: CEdge, release: Action, exc: Exception, target: CState) -> None:
        name = next(n for n, fn in edge.releases if fn is release)
        self.counts["release_errors"] += 1
        self._failures.append(Failure(key, edge.event, name, "release", exc, target.name))

    def _acquire_failed(
        self, key: Hashable, edge: CEdge, payload: dict[str, Any], done: int, exc: Exception, where: str
    ) -> int:
        """Acquire number ``done`` raised: record it, undo the ones before (and, at begin, release
        what the initial state holds without an acquire). Returns the failure's index."""
        index = self._record(key, edge.event, edge.acquires[done][0], "acquire", exc, where)
        undo = [(name, fn) for _a, _fn, name, fn in edge.acquires[:done]]
        if edge.source is None:
            undo.extend(edge.releases)
        for name, release in undo:
            try:
                release(key, **payload) if payload else release(key)
            except Exception as uexc:
                self.counts["release_errors"] += 1
                self._failures.append(Failure(key, edge.event, name, "release", uexc, where))
        return index

    def _record(self, key: Hashable, event: str, action: str, phase: Phase, exc: BaseException, where: str) -> int:
        """Keep a failure for the caller; returns its index so its end state can be filled in."""
        self.counts["action_errors"] += 1
        self._failures.append(Failure(key, event, action, phase, exc, where))
        return len(self._failures) - 1

    def _on_error(self, key: Hashable, source: CState, edge: CEdge, failure: int) -> CState:
        """An action on ``edge`` raised before the state changed: fire on_error from ``source``.

        If the failing edge is the on_error path itself, it is taken without
        its actions, so an error while handling an error still ends in the
        state the spec names for it, with its resources released.
        """
        handler = source.error_edge
        if handler is edge:
            handler = edge.bare
        handled = len(self._failures)  # the failure and its undo failures come before this
        state = self._step(key, source, handler, {}) if handler is not None else source
        for i in range(failure, handled):
            self._failures[i] = replace(self._failures[i], state=state.name)
        return state

    def _refuse(self, key: Hashable, state: CState, event: str, edge: CEdge | None) -> str:
        """An event with no transition: a legal no-op if ignored, else IllegalTransition."""
        if edge is None:
            self.counts["illegal"] += 1
            raise IllegalTransition(key, event, state.name, list(state.row))
        self.counts["ignored"] += 1
        return state.name

    def _drain(self) -> None:
        """Run events queued from inside actions, oldest first, until none remain."""
        queue = self._queue
        while queue:
            key, event, payload = queue.popleft()
            state = self._live.get(key)
            if state is None:
                self._anomaly("unknown", self.spec.key, key, event)
                continue
            edge = state.row.get(event)
            if edge is None or edge is IGNORED:
                try:
                    self._refuse(key, state, event, edge)
                except IllegalTransition as exc:
                    self._record(key, event, "<queued event>", "do", exc, state.name)
            else:
                self._step(key, state, edge, payload)

    def _force_release(self, key: Hashable) -> None:
        """Release everything ``key`` holds without a transition (close() of an unfinishable instance)."""
        state = self._live.pop(key)
        self._anomaly("forced", self.spec.key, key, ABORT)
        for r in state.holds:
            action = self.spec.resources[r].release
            try:
                getattr(self.driver, action)(key)
            except Exception as exc:
                self.counts["release_errors"] += 1
                self._failures.append(Failure(key, ABORT, action, "release", exc, state.name))
        if state.after is not None:
            self._deadlines.armed.pop(key, None)
        self._gens.pop(key, None)
        self._unlink(key, keep_from=None)

    # -- ids -------------------------------------------------------------------

    def _space(self, space: str) -> dict[Hashable, tuple[Hashable, int]]:
        table = self._links.get(space)
        if table is None:
            known = ", ".join([self.spec.key, *self._links])
            raise KvfsmError(
                f"id space {space!r} is not declared for this tracker (declared: {known}); pass spaces=[{space!r}, ...] to Tracker()"
            )
        return table

    def _generation(self, key: Hashable) -> int:
        gen = self._gens.get(key)
        if gen is None:
            gen = self._gens[key] = self._serial = self._serial + 1
        return gen

    def _current(self, key: Hashable, gen: int) -> bool:
        return key in self._live and self._gens.get(key) == gen

    def _resolve(self, space: str, ident: Hashable, event: str) -> Hashable | None:
        entry = self._space(space).get(ident)
        if entry is None:
            self._anomaly("unknown", space, ident, event)
            return None
        if not self._current(*entry):
            self._anomaly("stale", space, ident, event)
            return None
        return entry[0]

    def _unlink(self, key: Hashable, keep_from: int | None) -> None:
        """Forget key's linked ids (only those of generations before ``keep_from``, if given)."""
        pairs = self._linked.get(key)
        if not pairs:
            return
        kept = []
        for space, ident in pairs:
            table = self._links[space]
            entry = table.get(ident)
            if entry is None or entry[0] != key:
                continue
            if keep_from is not None and entry[1] >= keep_from:
                kept.append((space, ident))
            else:
                del table[ident]
        if kept:
            self._linked[key] = kept
        else:
            del self._linked[key]

    # -- reporting -------------------------------------------------------------

    def _anomaly(self, kind: AnomalyKind, space: str, ident: Hashable, event: str) -> None:
        self.counts[kind] += 1
        self._anomalies.append(Anomaly(kind, space, ident, event))

    def _raise_failures(self) -> None:
        failures, self._failures = self._failures, []
        raise ActionError(failures)
