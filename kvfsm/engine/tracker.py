"""The Tracker: every live instance of one machine, moved by checked events.

An instance is nothing but its key's entry in ``_live``, mapping to its
compiled state. Resources held are never stored: they are ``state.holds`` by
definition, so the ledger cannot drift from the state. Generations, links and
deadlines live in side tables that only the instances using them touch.

One re-entrant lock (:class:`~kvfsm.engine.mutex.Mutex`) makes every public
call atomic (``threadsafe=False`` drops it for a tracker used by one thread
only). Driver actions run inside a call,
and what they may call back is settled by one rule per method (see
:class:`Tracker`): nothing an action does can make the Tracker see an
instance in the middle of a transition.
"""

from __future__ import annotations

import difflib
import heapq
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from functools import partial
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from threading import get_ident
from typing import Any, Final, cast

from ..errors import (
    ActionError,
    Anomaly,
    AnomalyKind,
    DuplicateKey,
    Failure,
    IllegalTransition,
    KvfsmError,
    PayloadError,
    Phase,
    ReentrantCall,
    TrackerClosed,
)
from ..spec import Spec, load
from ..spec.model import ABORT
from .deadlines import Deadlines
from .mutex import Mutex
from .owners import Owner
from .params import log_once, resolve
from .program import SENDER, Action, CEdge, CState, checked, compile_program, whole
from .retired import RetiredIds

Observer = Callable[[Hashable, int, str, str, str, float], None]
"""Called after each transition with (key, generation, event, from, to, time); ``begin`` has from ``""``."""

LOGGER = logging.getLogger("kvfsm.anomalies")

ANOMALY_LIMIT = 10_000
"""Anomaly records kept between drains; older ones are dropped (the counts keep counting)."""

DRAIN_SLACK = 65_536
"""Dead deadline entries ``finished()`` leaves for ``poll`` to sweep before sweeping them itself."""

RETIRED_LIMIT = 100_000
"""Drained ids remembered per space, so that a late message is told from one naming an id never seen."""

ID_LIMIT = 256
"""Characters of an id kept in an anomaly record: a flood of huge ids cannot grow memory without bound."""

_BEGIN: Final[Any] = object()
"""Queue entry kind: a ``begin`` an action asked for."""
_RETIRE: Final[Any] = object()
"""Queue entry kind: instances ``finished()`` drained while a transition was running, retired once it is over."""

_AT_ONCE: Final[Any] = object()
"""The queue entry of a count with K = 0: the counted event fires as the instance enters the state."""

_WHEN_TAKEN: Final[Any] = object()
"""Queue entry kind: an event the children's ends fire (``owns:``), taken only if the state has a transition on it."""

_NOBODY: Final[Any] = object()
"""No sender (the at-once firing of a count with K = 0), or no value given."""

_EMPTY: frozenset[str] = frozenset()

_NOT_BEGUN = CState("(not begun)", -1, False, ())
"""Where a key is before its begin: the source a failed begin is recorded in (it has no on_error to take)."""


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
      ``_phase_deadlines.armed`` holds ``(key, p)`` iff key's instance
      entered phase p and has not left it, nor had p's deadline fire since;
    - ``_links[space][id] == (key, generation)``, and ``_linked[key]`` lists
      the ``(space, id)`` pairs to forget when key's instance is drained;
    - ``_busy`` is true exactly while a call is running driver actions or the
      observer; ``_queue`` is empty whenever no call is running;
    - ``_heard[key]`` holds the senders of a counted event heard since key's
      instance entered its current state (a self-loop keeps it; leaving the
      state, retiring or a forced release drops it); ``_need[key]`` the K its
      ``begin`` payload gave;
    - ``_early[(space, id)]`` holds the messages of ``early:`` events kept for
      an id not yet known in that space, each also in ``_early_order`` until
      it is applied (the id appeared) or dropped (due, bound, close);
    - ``fire`` and ``begin``, the calls made per request, inline the lock's
      fast path (:meth:`Mutex.enter <kvfsm.engine.mutex.Mutex.enter>` and
      ``exit``: the two calls cost 3% of ``kvfsm bench``'s locked lifecycle),
      in one form that ``tests/test_mutex.py`` holds them to; the rest hold
      the lock with ``with``; every other call that fires one key
      goes through ``fire`` (poll, close and the queue's events through
      ``_fire_inner``, with ``_inner`` set so that the outer call drains and
      raises); every begin but ``begin``'s plain path (one that runs nothing
      that could call back) is ``_begin_batch``, for one key or many;
    - the step (do and acquires, on_error if one raised; the state change,
      deadlines, releases and taps) has two forms, per key in ``fire`` and per
      group in ``_step_many`` (``fire_many``'s groups, and on_error's edge),
      which differ only in how they store and call: what a failure, a
      deadline or a tap means is one method both call (``_before_failed``,
      ``_release_failed``, ``_refuse``, ``Deadlines``, ``_link_carried``, the
      edges' taps; ``fire`` inlines ``Deadlines.arm``), and
      ``tests/test_batch_twin.py`` holds the two forms to each other.

    Calls made from inside a driver action or the observer (re-entrant calls):

    - ``begin``, ``fire`` and ``fire_by`` are queued and run, in order, once
      the current transition is complete (run to completion); they return
      ``None``, and what goes wrong in them (an action raising, an illegal
      event, a duplicate key, a closed tracker) is reported by the
      :class:`ActionError` of the outermost call, as a failure of phase
      ``queued`` where no action raised;
    - ``finished()`` returns what finished as usual; those instances are
      retired once the running transition is complete, never during it;
    - ``poll()`` and ``close()`` raise :class:`ReentrantCall` (nothing
      changed): they belong to the loop that owns the tracker;
    - every query (``state``, ``held``, ``accepts``, ``route``,
      ``generation``, ``census``, ``holding``, ``live``, ``next_deadline``,
      ``anomalies``) and ``link`` are safe and answer at once.

    A driver action that raises a ``BaseException`` that is not an
    ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) is handled like any
    failure first (the other releases run, on_error fires), then re-raised by
    the outermost call with the :class:`ActionError` as its cause.
    """

    __slots__ = (
        "spec", "driver", "counts", "_program", "_begin_edge", "_payloads", "_clock", "_observers", "_owner", "_children", "_mutex", "_guard",
        "_live", "_gens", "_links", "_linked", "_deadlines", "_finished", "_queue", "_busy", "_closed", "_failures",
        "_anomalies", "_armed", "_phase_rules", "_phase_deadlines", "_serial", "_begin_taps", "params", "_retired", "_on_anomaly", "_plain_begin", "_inner",
        "_epoch", "_heard", "_need", "_early_rules", "_early", "_early_order", "_early_held",
    )  # fmt: skip

    def __init__(
        self,
        spec: Spec | str | Path,
        driver: object,
        *,
        clock: Callable[[], float] = time.monotonic,
        params: Mapping[str, float] | None = None,
        spaces: Iterable[str] = (),
        observer: Observer | Sequence[Observer] | None = None,
        on_anomaly: Callable[[Anomaly], None] | None = None,
        threadsafe: bool = True,
        parent: Tracker | None = None,
    ) -> None:
        """Bind ``driver`` to ``spec`` (a model or a path to load and check).

        ``spec`` must pass the static checks (a model built in code is checked
        here). Each param is taken from ``params``, else from the environment
        variable ``KVFSM_<MACHINE>_<PARAM>``, else from the spec; the values
        and their sources are logged once (logger ``kvfsm.params``) and kept
        in :attr:`params`, and every relation the spec declares between them
        must hold. ``clock`` should be monotonic; one that is not is held at its
        latest reading whenever it runs backwards (counted as
        ``clock_backwards``), so deadlines stay in order. ``params`` override
        the spec's; ``spaces`` declares the id spaces that :meth:`link` and
        :meth:`fire_by` accept besides the spec's key. ``observer`` may be one
        callable or several (a metrics exporter and a journal), each told of
        every transition in order; one that raises does not stop the others.
        ``parent`` is the tracker whose spec ``owns:`` this machine's
        instances: each ``begin`` here names a live instance there, whose
        spec hears when its children end; the two share one lock.
        ``threadsafe=False``
        skips the lock every call takes (55–60 ns a call here, a sixth of
        a ``fire``): only for a tracker that one thread alone ever calls.
        """
        if not isinstance(spec, Spec):
            spec = load(spec)
        self.spec = spec
        self.driver = driver
        resolved = resolve(spec, dict(params or {}))
        values = {name: r.value for name, r in resolved.items()}
        self._program = compile_program(spec, driver, values)
        self.params = resolved
        """Every param's value and its source (``Tracker(params=...)``, ``environment KVFSM_...``, ``spec``)."""
        log_once(spec, resolved)
        self._begin_edge = self._program.begin
        self._begin_taps: tuple[Callable[[Hashable], object], ...] = ()
        self._payloads = self._program.payloads
        self.counts: dict[str, int] = dict.fromkeys(
            (
                "ignored",
                "illegal",
                "unknown",
                "late",
                "stale",
                "forced",
                "misaddressed",
                "timeouts",
                "action_errors",
                "release_errors",
                "observer_errors",
                "queued_errors",
                "clock_backwards",
                "counted",
                "duplicate",
                "kept_early",
                "early",
            ),
            0,
        )
        """Running totals; ``unknown`` and ``stale`` count events that were dropped, not raised; ``counted`` the
        arrivals of a counted event that did not complete its count, ``duplicate`` repeats from one sender;
        ``kept_early`` messages kept for an id not yet known (``early:``), ``early`` those dropped unapplied."""
        self._clock = clock if clock is time.monotonic else self._held_back(clock)
        self._observers: tuple[Observer, ...] = (
            () if observer is None else (observer,) if callable(observer) else tuple(observer)
        )
        for each in self._observers:
            if not callable(each):
                raise TypeError(f"observer {each!r} is not callable; pass a callable or a list of callables")
        self._mutex: Mutex | None = parent._mutex if parent is not None else Mutex() if threadsafe else None
        self._guard: AbstractContextManager[Any] = (
            parent._guard if parent is not None else (self._mutex if self._mutex is not None else nullcontext())
        )
        """What the non-hot methods hold; ``fire`` inlines the mutex's fast path, ``begin`` calls it."""
        self._live: dict[Hashable, CState] = {}
        self._gens: dict[Hashable, int] = {}
        self._links: dict[str, dict[Hashable, tuple[Hashable, int]]] = {space: {} for space in (*spec.spaces, *spaces)}
        self._retired = {space: RetiredIds(RETIRED_LIMIT) for space in (spec.key, *self._links)}
        """Ids of drained instances, per space (the newest ``RETIRED_LIMIT``): a message naming one is late."""
        self._on_anomaly = on_anomaly
        self._plain_begin: CState | None = None
        """The initial state while ``begin`` runs nothing that could call back (its plain path); else None."""
        self._linked: dict[Hashable, list[tuple[str, Hashable]]] = {}
        self._deadlines = Deadlines(len(self._program.states))
        self._armed = self._deadlines.armed
        self._finished: list[tuple[Hashable, str]] = []
        """``(key, final state)`` since the last drain: what :meth:`finished` returns as it is."""
        self._queue: deque[tuple[Hashable, Any, dict[str, Any]]] = deque()
        self._busy = False
        self._inner = False
        """True while :meth:`_fire_inner` runs a step through ``fire``: the outer call drains and raises."""
        self._closed = False
        self._epoch = 0
        """Bumped whenever queued calls ran or an id was linked: a batch grouped at an older epoch reads its keys again."""
        self._serial = 0
        self._failures: list[Failure] = []
        self._anomalies: deque[Anomaly] = deque(maxlen=ANOMALY_LIMIT)
        self._heard: dict[Hashable, set[Hashable]] = {}
        """Key → the senders of a counted event heard during its instance's stay in the counting state."""
        self._need: dict[Hashable, dict[str, int]] = {}
        """Key → the K its ``begin`` payload gave each count (``count: <begin payload key>``), by key name."""
        self._install_counts()
        self._phase_rules = tuple((spec.param(p.timeout.after, values), p.timeout.fire) for p in spec.phases.values())
        """Per phase, in declaration order: (seconds its deadline is armed for, the event it fires)."""
        self._phase_deadlines = Deadlines(len(self._phase_rules))
        """Phase deadlines, keyed ``(key, phase index)``: armed and disarmed by taps on the edges that enter and
        leave each phase, so a transition that stays inside one pays nothing."""
        self._install_phases()
        self._early_rules: dict[str, tuple[int, float]] = {
            name: (decl.early.keep, spec.param(decl.early.within, values))
            for name, decl in spec.event_decls.items()
            if decl.early is not None
        }
        """Event → (how many may wait, seconds each may wait) for the events declared ``early:``."""
        self._early: dict[tuple[str, Hashable], list[tuple[str, dict[str, Any]]]] = {}
        """(space, id) → the messages kept for that id, in arrival order, until it appears."""
        self._early_order: list[tuple[float, int, str, Hashable, tuple[str, dict[str, Any]]]] = []
        """A heap of (due, arrival number, space, id, entry) per kept message: what ``poll`` drops when due."""
        self._early_held: Counter[str] = Counter()
        if self._observers:  # compiled into every transition, after its releases: the step has no check
            for edge in self._program.edges():
                source = edge.source.name if edge.source is not None else ""
                edge.add_tap(partial(self._notify, event=edge.event, source=source, target=edge.target.name))
        self._children: list[Owner] = []
        """One per child tracker attached to this one (``owns:``)."""
        self._owner: Owner | None = None
        """This machine's link to the tracker that owns its instances (``parent=``), if any."""
        if parent is not None:
            with parent._guard:
                self._owner = Owner.attach(parent, self)
                self._install_child(self._owner)
                parent._install_owner(self._owner)
        self._settle_begin()

    # -- lifecycle ---------------------------------------------------------

    def begin(self, key: Hashable, /, **payload: Any) -> None:
        """Start an instance in the initial state, acquiring what it holds.

        A key whose earlier instance has finished may be begun again: the new
        instance is a new generation, and ids linked to the old one go stale.
        Raises :class:`DuplicateKey` while the earlier instance is still live,
        :class:`PayloadError` for payload the spec's ``begin`` does not
        declare, and :class:`ActionError` if an acquire raised (nothing is
        then held).
        """
        mutex = self._mutex
        if mutex is not None:  # Mutex.enter, inlined: the form fire has (see the class docstring)
            try:
                mutex.tokens.pop()
                mutex.owner = get_ident()
            except IndexError:  # the token is out
                if not mutex.take_late():
                    mutex = None  # held by this thread already (an action calling back): not ours to give back
        try:
            if self._busy:
                self._enqueue(key, _BEGIN, payload)
                return
            target = self._plain_begin
            if target is not None and not payload and key not in self._live:
                # Nothing runs that could call back (no acquire, link or observer; taps may not call): the plain
                # path, _begin's work for one fresh key without the frame a call back needs.
                self._live[key] = target
                if target.after is not None:
                    self._deadlines.arm(key, target.index, self._clock() + target.after)
                if self._begin_taps:
                    for tap in self._begin_taps:
                        tap(key)
                return
            self._run(partial(self._begin, key, payload))  # partial, not a lambda: a closure slows the path above
        finally:
            if mutex is not None:  # Mutex.exit, inlined
                mutex.owner = 0
                mutex.tokens.append(None)
                if mutex.waiters:
                    mutex.hand_over()

    def _settle_begin(self) -> None:
        """Decide, once per change of what begin runs, whether it can take the plain path (nothing that calls back)."""
        edge = self._begin_edge
        plain = not (edge.acquire_fns or edge.links or self._observers or self._closed)
        plain = plain and edge.target.name not in self._program.entry_counts
        plain = plain and not any(self.spec.routed_by(e) == self.spec.key for e in self._early_rules)
        self._plain_begin = edge.target if plain else None

    def fire(self, key: Hashable, event: str, /, **payload: Any) -> str | None:
        """Apply ``event`` to ``key``'s instance; returns its state afterwards.

        Raises :class:`IllegalTransition` (nothing changed) for an event the
        state neither handles nor ignores, :class:`PayloadError` (nothing
        changed) for payload keys the spec does not declare for the event, and
        :class:`ActionError` after a driver action raised (the instance is
        already in a defined state). An unknown key is counted and reported by
        :meth:`anomalies`, and ``None`` is returned; so is an event fired from
        inside an action, which is queued and runs once the current transition
        is complete.
        """
        mutex = self._mutex
        if mutex is not None:  # Mutex.enter, inlined: the form begin has (see the class docstring)
            try:
                mutex.tokens.pop()
                mutex.owner = get_ident()
            except IndexError:  # the token is out
                if not mutex.take_late():
                    mutex = None  # held by this thread already (an action calling back): not ours to give back
        try:
            if self._busy:
                self._enqueue(key, event, payload)
                return None
            source = self._live.get(key)
            if source is None:
                return self._refuse(key, None, event, payload)
            if payload and not payload.keys() <= self._payloads.get(event, _EMPTY):
                raise self._payload_error(event, payload)
            edge = source.row.get(event)
            if edge is None:  # ignored, or illegal
                return self._refuse(key, source, event, payload)
            if edge.count is not None or (payload and SENDER in payload):
                counted = self._count(key, edge, payload)
                if counted is None:  # heard, and the count not complete: the instance stays, its deadline too
                    return source.name
                payload = counted
            # The step for one key (every other caller comes through _fire_inner; fire_many's groups
            # through _step_many, its form for a group): do and acquires; the state change, deadlines
            # and releases; on_error if an action before the change raised.
            self._busy = True
            try:
                for action in edge.before:
                    try:
                        action(key, **payload) if payload else action(key)
                    except BaseException as exc:
                        target = self._before_failed(key, source, edge, _position(edge.before, action), exc)
                        break
                else:
                    target = self._live[key] = edge.target
                    if source.after is not None:
                        self._armed.pop(key, None)  # disarm (poll may have already): see Deadlines
                    if target.after is not None:  # Deadlines.arm, inlined: its one copy (a call here shows in bench)
                        entry = (self._clock() + target.after, key)
                        self._armed[key] = entry
                        self._deadlines.queues[target.index].append(entry)
                    if target.final:
                        self._finished.append((key, target.name))
                    if payload and edge.links:  # no payload, no id to link
                        self._link_carried(key, edge, payload)
                    for release in edge.release_fns:
                        try:
                            release(key)
                        except BaseException as exc:
                            self._release_failed(key, edge, _position(edge.release_fns, release), exc, target)
                if self._queue and not self._inner:
                    self._drain()
                    target = self._live.get(key, target)  # retired meanwhile: it ended where the step left it
            except BaseException:
                self._queue.clear()  # never let what an action queued run inside a later call
                raise
            finally:
                self._busy = False
            if self._failures and not self._inner:
                self._raise_failures(target.name)
            return target.name
        finally:
            if mutex is not None:  # Mutex.exit, inlined
                mutex.owner = 0
                mutex.tokens.append(None)
                if mutex.waiters:
                    mutex.hand_over()

    def begin_many(self, keys: Iterable[Hashable], /, **payload: Any) -> None:
        """:meth:`begin` for every key, under one lock, each acquire called once for the batch (see :meth:`fire_many`).

        A key that cannot begin (live already, or named twice) is a failure of
        phase ``refused`` carrying its :class:`DuplicateKey`, as the second of
        two ``begin`` calls would be; keys an acquire
        failed for are not begun and hold nothing. All are raised together as
        one :class:`ActionError` once every other key has begun.
        """
        with self._guard:
            if self._closed and not self._busy:
                raise TrackerClosed(f"tracker for {self.spec.name!r} is closed; begin_many refused")
            self._batched(_BEGIN, keys, payload, lambda batch: self._begin_batch(batch, payload))

    def _batched(
        self, event: Any, keys: Iterable[Hashable], payload: dict[str, Any], run: Callable[[list[Hashable]], None]
    ) -> None:
        """What ``begin_many`` (``event`` is ``_BEGIN``) and ``fire_many`` share.

        From inside an action, each key is queued as the one-key call would be.
        Otherwise the payload is checked once, then ``run`` takes rounds of
        distinct keys (a key named twice goes again in the next round) with the
        tracker busy, what actions queued is drained after each, and what
        failed is raised at the end.
        """
        if self._busy:
            for key in keys:
                self._enqueue(key, event, payload)
            return
        name = "begin" if event is _BEGIN else event
        allowed = self._program.begin_payload if event is _BEGIN else self._payloads.get(event, _EMPTY)
        if payload and not payload.keys() <= allowed:
            raise self._payload_error(name, payload)
        keys = keys if isinstance(keys, list) else list(keys)

        def rounds() -> None:
            for batch in [keys] if len(set(keys)) == len(keys) else _rounds(keys):
                run(batch)
                if self._queue:
                    self._drain()

        self._run(rounds)

    def _begin_batch(
        self, keys: list[Hashable], payload: dict[str, Any], parents: dict[Hashable, Hashable] | None = None
    ) -> None:
        """The begin step for distinct keys: each acquire once for the batch, the bookkeeping in bulk.

        A key live already, or naming no live parent (unless ``parents`` gives
        each key's), is a ``refused`` failure; a key an acquire failed for
        holds nothing and is not begun.
        """
        live, edge = self._live, self._begin_edge
        need = self._begin_need(payload)
        fresh = keys if live.keys().isdisjoint(keys) else self._beginnable(keys)
        if parents is None and self._owner is not None:
            parents = self._parents(fresh, payload)
        if parents is not None:
            fresh = [key for key in fresh if key in parents]
        for position, acquire in enumerate(edge.batch_before):  # begin's acquires, failing as a step's do
            if not fresh:
                return
            fresh = self._prepare_many(fresh, _NOT_BEGUN, edge, acquire, position, payload)
        target = edge.target
        regen = [] if fresh is keys else [key for key in fresh if key in live]  # begun again before the drain
        live.update(zip(fresh, repeat(target)))
        if need is not None:
            self._need.update(zip(fresh, repeat(need)))
        if parents is not None:
            assert self._owner is not None
            for key in fresh:
                self._owner.adopt(key, parents[key])
        if regen or self._observers:
            for key in fresh if self._observers else regen:
                self._gens[key] = self._serial = self._serial + 1
        if target.after is not None:
            self._deadlines.arm_many(fresh, target.index, self._clock() + target.after)
        if edge.links:
            for key in fresh:
                self._link_carried(key, edge, payload)
        for tap in self._begin_taps:
            for key in fresh:
                tap(key)
        if self._observers:
            for key in fresh:
                self._notify(key, "begin", "", target.name)
        if self._early:
            for key in fresh:
                if (self.spec.key, key) in self._early:
                    self._release_early(self.spec.key, key, key)

    def _parents(self, keys: list[Hashable], payload: dict[str, Any]) -> dict[Hashable, Hashable]:
        """Each key's live parent (``owns:``); a key naming none is a ``refused`` failure and left out."""
        assert self._owner is not None
        parents = {}
        for key in keys:
            try:
                parents[key] = self._owner.parent_for(key, payload)
            except KvfsmError as exc:
                self._refused(key, "begin", exc, "(not begun)")
        return parents

    def _beginnable(self, keys: list[Hashable]) -> list[Hashable]:
        """The keys that may begin; each that is live already is a ``refused`` failure."""
        fresh = []
        for key in keys:
            old = self._live.get(key)
            if old is not None and not old.final:
                self._refused(key, "begin", _duplicate(key, old), old.name)
                continue
            fresh.append(key)
        return fresh

    def fire_many(self, event: str, keys: Iterable[Hashable], /, **payload: Any) -> None:
        """Apply ``event`` to every key, under one lock, with each driver action called once per group.

        Keys are grouped by the state they are in; for each group the edge's
        ``do``, acquires and releases run once with the group's keys when the
        driver marks them :func:`~kvfsm.batch` (per key otherwise), and every
        key then gets what :meth:`fire` would give it: the legality and
        ignore rules of its own state, on_error for the keys an action failed
        for, derived releases, deadlines, the observer's lines. Events that
        actions fire are queued and run after each group (run to completion);
        a key they moved (or began) is stepped from where it is when its
        group's turn comes, never from the state it was grouped by. A key
        named twice is fired again after every key was fired once.

        One bad key does not stop the batch: an unknown key is counted and
        reported by :meth:`anomalies`; an event a key's state neither handles
        nor ignores is a failure of phase ``refused`` carrying its
        :class:`IllegalTransition`; both, and failed actions, are raised
        together as one :class:`ActionError` once every key is done.
        Undeclared payload raises :class:`PayloadError` before anything runs.
        From inside an action, each key's event is queued as :meth:`fire` would.
        """
        with self._guard:
            self._batched(event, keys, payload, lambda batch: self._fire_batch(event, batch, payload))

    def _fire_batch(self, event: str, keys: list[Hashable], payload: dict[str, Any], via: _Via | None = None) -> None:
        """One round of ``fire_many``: distinct keys, grouped by state, each group stepped at once.

        Groups are formed once, from the states at the round's start, and
        taken in order of first appearance. What a group's actions queue runs
        before the next group, and may move keys of later groups (begin them,
        retire them, relink the ids that named them): a group whose turn
        comes after that is read again (``_epoch``), so no key is stepped from
        a state it has left. Its keys still in its state are stepped together;
        each other one after them, alone, from where it is now, as ``fire``
        (``fire_by``, with ``via``) would. Without calls back, nothing is read twice.
        """
        live = self._live
        since = self._epoch if via is None else via.since
        states = list(map(live.get, keys))
        first = states[0] if states else None
        if first is not None and states.count(first) == len(states):
            groups: Iterable[tuple[CState | None, list[Hashable]]] = ((first, keys),)  # the usual batch: one state
        else:
            groups = self._group(keys, states).items()
        for state, group in groups:
            if state is None:
                self._fire_unknown(event, group, payload, via, since)
                continue
            moved: list[Hashable] = []
            if self._epoch != since:  # calls ran since the grouping: read the group again
                group, moved = self._recheck(state, group, via)
            if group:
                edge = state.row.get(event)
                if edge is None:
                    self._refuse_many(group, state, event)
                elif edge.count is not None or SENDER in payload:
                    for key in group:  # each arrival is counted on its own: fire's step, key by key
                        self._fire_inner(key, event, payload)
                else:
                    self._step_many(group, state, edge, payload)
                if self._queue:
                    self._drain()
            for key in moved:
                self._fire_moved(key, event, payload, via)

    def _group(self, keys: list[Hashable], states: list[CState | None]) -> dict[CState | None, list[Hashable]]:
        """Keys by the state they are in (None: no instance), in first-seen order."""
        groups: dict[CState | None, list[Hashable]] = {}
        for key, state in zip(keys, states, strict=True):
            group = groups.get(state)
            if group is None:
                groups[state] = [key]
            else:
                group.append(key)
        return groups

    def _recheck(self, state: CState, group: list[Hashable], via: _Via | None) -> tuple[list[Hashable], list[Hashable]]:
        """Split a group read before calls ran: the keys still in ``state`` (and still named by their ids), the rest."""
        live = self._live
        still: list[Hashable] = []
        moved: list[Hashable] = []
        if via is None:
            for key in group:
                (still if live.get(key) is state else moved).append(key)
        else:
            table, gens, at = self._links[via.space], self._gens, via.at
            for key in group:
                ident, entry = at[key]
                ok = live.get(key) is state and table.get(ident) is entry and gens.get(key) == entry[1]
                (still if ok else moved).append(key)
        return still, moved

    def _fire_unknown(
        self, event: str, group: list[Hashable], payload: dict[str, Any], via: _Via | None, since: int
    ) -> None:
        """The keys that had no instance at the grouping: each is reported, unless calls since began it.

        With ``via``, every one is looked up again by its id, as ``fire_by`` would: an id whose instance was
        drained between rounds is reported in its own space, not as its key.
        """
        for key in group:
            if via is not None or (self._epoch != since and key in self._live):
                self._fire_moved(key, event, payload, via)
                continue
            self._refuse(key, None, event, payload)

    def _fire_moved(self, item: Hashable, event: str, payload: dict[str, Any], via: _Via | None) -> None:
        """Step one key of a batch that is no longer where it was grouped, as ``fire`` (or ``fire_by``) would now."""
        key: Hashable | None = item
        if via is not None:
            ident = item.ident if isinstance(item, _Unresolved) else via.at[item][0]
            key = self._resolve(via.space, ident, event, payload)
            if key is None:
                return
        try:
            self._fire_inner(key, event, payload)
        except IllegalTransition as exc:
            self._refused(key, event, exc, exc.state)
        if self._queue:
            self._drain()

    def fire_by(self, space: str, ident: Hashable, event: str, /, **payload: Any) -> str | None:
        """Like :meth:`fire`, for the instance ``ident`` names in id space ``space``.

        An id linked to an earlier generation of a reused key is reported as
        ``stale`` and not applied; an id never linked (or retired by a drain)
        as ``unknown``.
        """
        if space == self.spec.key:
            return self.fire(ident, event, **payload)
        with self._guard:
            key = self._resolve(space, ident, event, payload)
            return None if key is None else self.fire(key, event, **payload)

    def deliver(self, event: str, ident: Hashable, /, **payload: Any) -> str | None:
        """Apply ``event`` to the instance ``ident`` names in the id space the spec routes ``event`` by.

        What a listener calls with a peer's message: the spec, not the caller,
        says which space the message's id belongs to (``events: {name: {by:
        <space>}}``; the key's space when undeclared), so a local id can never
        be taken for a remote one. A retired id is reported as ``late``, an id
        never seen as ``unknown``.
        """
        return self.fire_by(self.spec.routed_by(event), ident, event, **payload)

    def fire_many_by(self, space: str, event: str, ids: Iterable[Hashable], /, **payload: Any) -> None:
        """:meth:`fire_many` for the instances ``ids`` name in id space ``space``.

        Each id is looked up as :meth:`fire_by` looks it up when its turn
        comes (one naming no current instance is reported as ``stale``,
        ``late`` or ``unknown`` and left out); the rest are fired as one batch.
        """
        if space == self.spec.key:
            self.fire_many(event, ids, **payload)
            return
        with self._guard:
            ids = ids if isinstance(ids, list) else list(ids)
            if self._busy or not ids:  # from inside an action: looked up now, queued as fire_by would queue them
                resolve = self._resolve
                keys = [key for key in (resolve(space, ident, event, payload) for ident in ids) if key is not None]
                self.fire_many(event, keys, **payload)
                return
            table, live, gens = self._space(space), self._live, self._gens
            keys = []
            first: dict[Hashable, tuple[Hashable, tuple[Hashable, int]]] = {}
            again: dict[Hashable, deque[tuple[Hashable, tuple[Hashable, int]]]] = {}
            for ident in ids:
                entry = table.get(ident)
                if entry is None or entry[0] not in live or gens.get(entry[0]) != entry[1]:
                    keys.append(_Unresolved(ident))  # reported (or found, if calls before its turn link it) then
                    continue
                key = entry[0]
                keys.append(key)
                if key not in first:
                    first[key] = (ident, entry)
                else:
                    again.setdefault(key, deque()).append((ident, entry))
            since = self._epoch
            rounds = 0

            def run(batch: list[Hashable]) -> None:
                nonlocal rounds
                at = first if not rounds else {k: again[k].popleft() for k in batch if type(k) is not _Unresolved}
                rounds += 1
                self._fire_batch(event, batch, payload, _Via(space, since, at))

            self._batched(event, keys, payload, run)

    def deliver_many(self, event: str, ids: Iterable[Hashable], /, **payload: Any) -> None:
        """:meth:`deliver` for a batch of a peer's messages: ids in the space the spec routes ``event`` by."""
        self.fire_many_by(self.spec.routed_by(event), event, ids, **payload)

    def sent(self, key: Hashable, message: str, ident: Hashable, /) -> bool:
        """Hold an id ``key``'s instance put on the wire to the space the spec says ``message`` carries.

        The id must be the one linked for ``key`` in that space (``key``
        itself when it is the key's space); any other is a ``misaddressed``
        anomaly, counted, logged and journalled like the others, and False
        is returned. A driver calls this (or its
        :class:`~kvfsm.engine.outbox.Outbox`) once per message it sends.
        Raises :class:`KvfsmError` for a message the spec's ``outgoing:``
        does not declare.
        """
        carries = self.spec.carried_by(message)
        with self._guard:
            expected = key if carries == self.spec.key else self.ids(key).get(carries)
            if ident == expected:
                return True
            self._anomaly("misaddressed", carries, ident, message)
            return False

    def link(self, key: Hashable, space: str, ident: Hashable) -> None:
        """Let ``ident`` in id space ``space`` name ``key``'s current instance (linking it again changes nothing)."""
        with self._guard:
            if key not in self._live:
                raise KvfsmError(f"cannot link {space}={ident!r}: {key!r} has no instance")
            table = self._space(space)
            gen = self._generation(key)
            other = table.get(ident)
            if other == (key, gen):
                return
            if other is not None and self._current(*other) and not self._live[other[0]].final:
                raise KvfsmError(f"{space}={ident!r} already names live {other[0]!r}; an id may name one live instance")
            table[ident] = (key, gen)
            self._linked.setdefault(key, []).append((space, ident))
            self._epoch += 1
            if self._early and (space, ident) in self._early:
                self._release_early(space, ident, key)

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
        order within a state. If actions raised, the :class:`ActionError`
        carries what fired as its ``result``.
        """
        with self._guard:
            if self._busy:
                raise ReentrantCall(
                    "poll() called from inside a driver action or the observer; poll from the loop that owns "
                    "the tracker (a timeout that fired inside a transition would see it half done)"
                )
            if now is None:
                now = self._clock()
            elif isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
                raise ValueError(f"poll(now={now!r}): now must be a finite number of seconds on the tracker's clock")
            fired: list[tuple[Hashable, str, str]] = []
            if self._early_order:
                self._drop_early(now)
            self._deadlines.sweep()
            if self._phase_rules:
                self._phase_deadlines.sweep()
            self._run(lambda: self._fire_due(now, fired), fired)
            return fired

    def close(self) -> None:
        """Shut down: abort every live instance and release all it holds, then refuse new work.

        Each instance is aborted from the state it is in when its turn comes
        (an earlier abort's release may have moved it). A ``begin`` an action
        asks for while closing is refused (a ``queued`` failure). An instance
        that abort cannot finish (abort's action failed and on_error kept it
        live) has its resources released directly and is reported as a
        ``forced`` anomaly.
        """
        with self._guard:
            if self._busy:
                raise ReentrantCall(
                    "close() called from inside a driver action or the observer; close the tracker from the "
                    "thread that owns it, once the current call has returned"
                )
            if self._closed:
                return
            self._closed = True
            self._settle_begin()
            if self._early_order:
                self._drop_early(math.inf)
            self._run(self._abort_all)

    def _abort_all(self) -> None:
        """close()'s work: abort each live instance from its state at its turn, forcing what abort cannot end."""
        for key in list(self._live):
            state = self._live.get(key)
            if state is None or state.final:
                continue
            if state.row.get(ABORT) is not None:
                self._fire_inner(key, ABORT)
                if self._queue:
                    self._drain()
            state = self._live.get(key)
            if state is not None and not state.final:
                self._force_release(key, state)
                if self._queue:  # what a forced release asked for (a begin is refused: closed)
                    self._drain()

    # -- queries -------------------------------------------------------------

    def state(self, key: Hashable) -> str | None:
        """The state of ``key``'s current instance, or None if it has none (never begun, or drained)."""
        state = self._live.get(key)
        return state.name if state is not None else None

    def held(self, key: Hashable) -> tuple[str, ...]:
        """Resources the spec says ``key`` holds now (none for finished or unknown keys)."""
        state = self._live.get(key)
        return state.holds if state is not None else ()

    def accepts(self, key: Hashable, event: str) -> bool:
        """Whether ``fire(key, event)`` would take a transition now (an ignored event is not one).

        Lets code that must decide what to do next ask the spec instead of
        comparing state names it copied from it.
        """
        state = self._live.get(key)
        return state is not None and state.row.get(event) is not None

    def generation(self, key: Hashable) -> int | None:
        """The generation of ``key``'s current instance (unique in this tracker), or None if it has none."""
        with self._guard:
            return self._generation(key) if key in self._live else None

    def finished(self) -> list[tuple[Hashable, str]]:
        """Drain ``(key, final state)`` for every instance finished since the last call, in order.

        Drained instances are retired: their key and linked ids stop naming
        them (from inside an action: once the running transition is complete).
        """
        with self._guard:
            done, self._finished = self._finished, []
            if self._busy:
                self._queue.append((None, _RETIRE, {"done": done}))
                return list(done)
            self._retire(done)
            self._deadlines.sweep(DRAIN_SLACK)
            if self._phase_rules:
                self._phase_deadlines.sweep(DRAIN_SLACK)
            return done

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
            prune = not self._busy  # inside a call (an action asking mid-poll) the queues are poll's to walk
            deadlines = (self._deadlines, self._phase_deadlines)
            due = [d for d in (q.next_due(prune) for q in deadlines) if d is not None]
            return min(due, default=None)

    @property
    def clock(self) -> Callable[[], float]:
        """The clock deadlines read (a clock that ran backwards is held, see ``__init__``)."""
        return self._clock

    def timeout(self, state: str) -> float | None:
        """Seconds ``state``'s deadline is armed for, params resolved (None: it has no timeout)."""
        return self._program.by_name[state].after

    def entered(self, key: Hashable) -> float | None:
        """When ``key`` entered its state (tracker clock), known from its armed deadline; None for a state
        without a timeout (``kvfsm.observe.metrics`` times those)."""
        with self._guard:
            entry = self._armed.get(key)
            state = self._live.get(key)
            if entry is None or state is None or state.after is None:
                return None
            return entry[0] - state.after

    def ids(self, key: Hashable) -> dict[str, Hashable]:
        """The ids linked to ``key``'s current instance, by id space."""
        with self._guard:
            gen = self._gens.get(key)
            out: dict[str, Hashable] = {}
            for space, ident in self._linked.get(key, ()):
                if self._links[space].get(ident) == (key, gen):
                    out[space] = ident
            return out

    def snapshot(self) -> list[tuple[Hashable, str]]:
        """``(key, state)`` of every current instance, copied under the lock in one pass (for dumps and gauges)."""
        with self._guard:
            items = list(self._live.items())
        return [(key, state.name) for key, state in items]

    def anomalies(self) -> list[Anomaly]:
        """Drain the events that were dropped (unknown or stale ids) since the last call."""
        with self._guard:
            out = list(self._anomalies)
            self._anomalies.clear()
            return out

    def tap(
        self,
        on_edge: Callable[[str, str, str], Callable[[Hashable], object] | None],
        on_begin: Callable[[Hashable], object] | None = None,
    ) -> None:
        """Install taps: ``on_edge(source, event, target)`` returns what to call with each key that takes that
        transition (after its releases), ``on_begin`` is called with each key begun.

        A tap must not raise and must not call the tracker; it runs inside the
        call, under its lock. Taps are compiled into the transitions they
        watch, so a tracker without taps pays nothing for them: this is how
        :mod:`kvfsm.observe` counts transitions and times states.
        """
        with self._guard:
            for cedge in self._program.edges():
                made = on_edge(cedge.source.name if cedge.source else "", cedge.event, cedge.target.name)
                if made is not None:
                    cedge.add_tap(made)
            if on_begin is not None:
                self._begin_taps += (on_begin,)
            self._settle_begin()

    # -- the transition itself ----------------------------------------------

    def _run(self, work: Callable[[], object], result: Any = None) -> None:
        """Run ``work`` with the tracker busy (calls from actions are queued), then what they queued; raise failures.

        The frame of every call that runs actions except ``fire``, which
        keeps the same steps inline on its hot path. A raise clears the queue, so
        nothing an action queued runs inside a later call. ``result`` is what
        the :class:`ActionError` carries.
        """
        self._busy = True
        try:
            work()
            if self._queue:
                self._drain()
        except BaseException:
            self._queue.clear()  # never let what an action queued run inside a later call
            raise
        finally:
            self._busy = False
        if self._failures:
            self._raise_failures(result)

    def _fire_due(self, now: float, fired: list[tuple[Hashable, str, str]]) -> None:
        """poll()'s work: fire each due timeout, run what it queued, and record ``(key, event, new state)``."""
        states = self._program.states
        phases = self._phase_deadlines
        ends = phases.ends()  # a phase armed by a state's timeout below waits for the next poll
        for key, index in self._deadlines.pop_due(now):
            event = states[index].timeout_event
            assert event is not None, "armed only in states with a timeout"
            self._fire_timeout(key, event, fired)
        if self._phase_rules:
            for slot, index in phases.pop_due(now, ends):
                self._fire_timeout(cast(tuple[Hashable, int], slot)[0], self._phase_rules[index][1], fired)

    def _fire_timeout(self, key: Hashable, event: str, fired: list[tuple[Hashable, str, str]]) -> None:
        self.counts["timeouts"] += 1
        end = self._fire_inner(key, event)
        assert end is not None, "a due key is live"
        if self._queue:
            self._drain()
        state = self._live.get(key)
        fired.append((key, event, state.name if state is not None else end))

    def _fire_inner(self, key: Hashable, event: str, payload: dict[str, Any] | None = None) -> str | None:
        """Fire from inside a running call (poll, close, what actions queued) through ``fire``, so the step is
        written once; what it queues and what fails wait for the outer call. Returns what ``fire`` returns."""
        self._busy, self._inner = False, True
        try:
            end = self.fire(key, event, **payload) if payload else self.fire(key, event)
        finally:
            self._busy, self._inner = True, False
        return end

    def _step_many(self, keys: list[Hashable], source: CState, edge: CEdge, payload: dict[str, Any]) -> None:
        """The step of :meth:`fire` for keys all in ``source``: each action once for the batch, the bookkeeping in bulk.

        Keys an action failed for leave the batch there: their earlier
        acquires are undone and on_error fires for each, as in ``fire``.
        """
        for position, action in enumerate(edge.batch_before):  # what can raise before the state changes
            keys = self._prepare_many(keys, source, edge, action, position, payload)
            if not keys:
                return
        target = edge.target
        self._live.update(zip(keys, repeat(target)))
        armed = self._armed
        if source.after is not None:
            for key in keys:
                armed.pop(key, None)
        if target.after is not None:
            self._deadlines.arm_many(keys, target.index, self._clock() + target.after)
        if target.final:
            self._finished.extend(zip(keys, repeat(target.name)))
        if edge.links:
            for key in keys:
                self._link_carried(key, edge, payload)
        for index, release in enumerate(edge.batch_releases):
            try:
                failed = release(keys)
            except BaseException as exc:
                failed = dict.fromkeys(keys, exc)
            else:
                if failed is None:
                    continue
                failed = checked(failed, keys, _release_name(edge, index))
            for key, error in failed.items():
                self._release_failed(key, edge, index, error, target)

    def _prepare_many(
        self,
        keys: list[Hashable],
        source: CState,
        edge: CEdge,
        action: Callable[..., Mapping[Hashable, BaseException] | None],
        position: int,
        payload: dict[str, Any],
    ) -> list[Hashable]:
        """Run ``edge.batch_before[position]`` for the batch; the keys it failed for take on_error (if ``source`` has
        one). Returns the rest."""
        try:
            failed = action(keys, **payload) if payload else action(keys)
        except BaseException as exc:
            failed = dict.fromkeys(keys, exc)
        else:
            if failed is None:
                return keys
            failed = checked(failed, keys, _before_name(edge, position))
        if not failed:
            return keys
        for key, error in failed.items():
            self._before_failed(key, source, edge, position, error)
        return [key for key in keys if key not in failed]

    def _refuse_many(self, keys: list[Hashable], state: CState, event: str) -> None:
        """:meth:`_refuse` for each key of a group in ``state``, which has no transition on ``event``; an
        :class:`IllegalTransition` is that key's ``refused`` failure, not the batch's end."""
        for key in keys:
            try:
                self._refuse(key, state, event, {})
            except IllegalTransition as exc:
                self._refused(key, event, exc, state.name)

    def _refused(self, key: Hashable, event: str, exc: KvfsmError, where: str) -> None:
        """A batch's key that could not be stepped at all (illegal event, live key, no parent): its failure."""
        self._failures.append(Failure(key, event, "<none>", "refused", exc, where))

    def _begin(self, key: Hashable, payload: dict[str, Any]) -> None:
        """Begin one key (``begin``, or a begin an action queued); the caller has set ``_busy``.

        What stops it before anything runs is raised (nothing changed): a
        closed tracker, a live key, undeclared payload, a count or a parent
        the payload does not give. The rest is :meth:`_begin_batch` for a
        batch of one, so a begin is written once.
        """
        if self._closed:
            raise TrackerClosed(f"tracker for {self.spec.name!r} is closed; begin({key!r}) refused")
        old = self._live.get(key)
        if old is not None and not old.final:
            raise _duplicate(key, old)
        if payload and not payload.keys() <= self._program.begin_payload:
            raise self._payload_error("begin", payload)
        self._begin_need(payload)
        parents = {key: self._owner.parent_for(key, payload)} if self._owner is not None else None
        self._begin_batch([key], payload, parents)

    def _notify(self, key: Hashable, event: str, source: str, target: str) -> None:
        """Tell each observer; one that raises is reported like a failed action and changes nothing."""
        gen, now = self._gens[key], self._clock()
        for observer in self._observers:
            try:
                observer(key, gen, event, source, target, now)
            except BaseException as exc:
                self.counts["observer_errors"] += 1
                name = getattr(observer, "__name__", type(observer).__name__)
                self._failures.append(Failure(key, event, name, "observer", exc, target))

    def _release_failed(self, key: Hashable, edge: CEdge, position: int, exc: BaseException, target: CState) -> None:
        """Release number ``position`` of ``edge`` (one of its own, or a tap after them) raised for ``key``."""
        self._release_error(key, edge.event, _release_name(edge, position), exc, target.name)

    def _release_error(self, key: Hashable, event: str, action: str, exc: BaseException, where: str) -> None:
        """Every raising release is recorded here: counted, and kept for the caller with the state it left."""
        self.counts["release_errors"] += 1
        self._failures.append(Failure(key, event, action, "release", exc, where))

    def _release_each(self, key: Hashable, event: str, releases: Iterable[tuple[str, Action]], where: str) -> None:
        """Call each ``(name, release)`` for ``key`` outside a step (undoing a failed acquire, a forced release)."""
        for name, release in releases:
            try:
                release(key)
            except BaseException as exc:
                self._release_error(key, event, name, exc, where)

    def _before_failed(self, key: Hashable, source: CState, edge: CEdge, position: int, exc: BaseException) -> CState:
        """``edge.before[position]`` (the do, then the acquires) raised for ``key``, in either step: record it,
        undo the acquires before it and take on_error from ``source``. Returns the state key's instance is in."""
        if position == 0 and edge.do is not None:
            index = self._record(key, edge.event, _before_name(edge, position), "do", exc, source.name)
        else:
            index = self._acquire_failed(key, edge, position - (edge.do is not None), exc, source.name)
        return self._on_error(key, source, edge, index)

    def _acquire_failed(self, key: Hashable, edge: CEdge, done: int, exc: BaseException, where: str) -> int:
        """Acquire number ``done`` raised: record it, undo the ones before (and, at begin, release
        what the initial state holds without an acquire). Returns the failure's index."""
        index = self._record(key, edge.event, edge.acquires[done][0], "acquire", exc, where)
        undo = [(name, fn) for _a, _fn, name, fn in edge.acquires[:done]]
        if edge.source is None:
            undo.extend(edge.releases)
        self._release_each(key, edge.event, undo, where)
        return index

    def _record(self, key: Hashable, event: str, action: str, phase: Phase, exc: BaseException, where: str) -> int:
        """Keep a failure for the caller; returns its index so its end state can be filled in."""
        self.counts["queued_errors" if phase == "queued" else "action_errors"] += 1
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
        state = source
        if handler is not None:
            self._step_many([key], source, handler, {})  # the batch step for one key: this path is rare
            state = self._live[key]
        for i in range(failure, handled):
            self._failures[i] = replace(self._failures[i], state=state.name)
        return state

    def _refuse(self, key: Hashable, state: CState | None, event: str, payload: dict[str, Any]) -> str | None:
        """An event with no transition for ``key`` now (``state``: its instance's; None: it has none), in either
        step: refused by a closed tracker; for no instance, kept if ``early:``, else an ``unknown`` anomaly;
        a legal no-op if the state ignores it (in the row as None); else :class:`IllegalTransition`."""
        if self._closed and not self._inner:  # after close() every instance is final: only this path sees it
            raise TrackerClosed(f"tracker for {self.spec.name!r} is closed; {event!r} for {key!r} refused")
        if state is None:
            if not (self._early_rules and self._keep_early(self.spec.key, key, event, payload)):
                self._anomaly("unknown", self.spec.key, key, event)
            return None
        if event not in state.row:
            self.counts["illegal"] += 1
            raise IllegalTransition(key, event, state.name, list(state.row))
        self.counts["ignored"] += 1
        return state.name

    # -- owned instances (``owns:``) ------------------------------------------------

    def _install_owner(self, owner: Owner) -> None:
        """Tap this (parent) machine's edges: a forwarded event reaches the children, entering a state that takes
        ``ended`` fires it if none is live, a final state detaches them (in that order, on one edge)."""
        self._children.append(owner)
        ended = owner.rule.ended
        for edge in self._program.edges():
            if edge.event in owner.rule.forward:
                edge.add_tap(partial(owner.pass_on, event=edge.event))
            if edge.target.row.get(ended) is not None and edge.target is not edge.source:
                edge.add_tap(owner.entered)
            if edge.target.final:
                edge.add_tap(owner.detach)
        if self._begin_edge.target.row.get(ended) is not None:
            self._begin_taps += (owner.entered,)
        self._settle_begin()

    def _install_child(self, owner: Owner) -> None:
        """Tap this (child) machine's edges into final states: each tells the owner a child ended."""
        for edge in self._program.edges():
            if edge.target.final:
                failed = self.spec.states[edge.target.name].final == "failure"
                edge.add_tap(partial(owner.ended, failed=failed))

    def _poke(self, key: Hashable, event: str, owner: Owner | None) -> None:
        """Fire ``event`` on ``key`` if its state has a transition on it (and, for ``ended``, no child is live):
        queued behind the running call if there is one, else run now, raising what failed."""
        self._queue.append((key, _WHEN_TAKEN, {"event": event, "owner": owner}))
        if not self._busy:
            self._run(_nothing)

    def owned(self, key: Hashable) -> frozenset[Hashable]:
        """The keys of ``key``'s children (``owns:``) not yet in a final state."""
        with self._guard:
            kids: frozenset[Hashable] = frozenset()
            for child in self._children:
                kids |= child.live(key)
            return kids

    # -- counted events ----------------------------------------------------------

    def _install_counts(self) -> None:
        """Tap the edges around each counting state: leaving it forgets who was heard; entering it with K = 0
        fires the counted event at once (queued, as a call from an action would be)."""
        counting = {e.source for e in self._program.edges() if e.count is not None and e.source is not None}
        entry = self._program.entry_counts
        for edge in self._program.edges():
            if edge.source in counting and edge.target is not edge.source:
                edge.add_tap(self._forget_heard)
            if edge.target.name in entry and edge.target is not edge.source:
                edge.add_tap(partial(self._entered_counting, state=edge.target))
        initial = self._begin_edge.target
        if initial.name in entry:
            self._begin_taps += (partial(self._entered_counting, state=initial),)

    def _install_phases(self) -> None:
        """Tap the edges that enter or leave a phase (and ``begin``, if the initial state is in one): entering
        arms the phase's deadline, leaving disarms it, moving inside it or a self-loop touches nothing."""
        if not self._phase_rules:
            return
        index = {name: i for i, name in enumerate(self.spec.phases)}
        for edge in self._program.edges():
            entered, left = self.spec.phase_moves(edge.source.name if edge.source else None, edge.target.name)
            if entered or left:
                enter, leave = tuple(index[p] for p in entered), tuple(index[p] for p in left)
                edge.add_tap(partial(self._move_phases, enter=enter, leave=leave))
        entered, _left = self.spec.phase_moves(None, self._begin_edge.target.name)
        if entered:
            self._begin_taps += (partial(self._move_phases, enter=tuple(index[p] for p in entered), leave=()),)

    def _move_phases(self, key: Hashable, enter: tuple[int, ...], leave: tuple[int, ...]) -> None:
        deadlines = self._phase_deadlines
        for phase in leave:
            deadlines.armed.pop((key, phase), None)  # disarm (poll may have already)
        if enter:
            now = self._clock()
            for phase in enter:
                deadlines.arm((key, phase), phase, now + self._phase_rules[phase][0])

    def _forget_phases(self, key: Hashable) -> None:
        armed = self._phase_deadlines.armed
        for phase in range(len(self._phase_rules)):
            armed.pop((key, phase), None)

    def _forget_heard(self, key: Hashable) -> None:
        self._heard.pop(key, None)

    def _entered_counting(self, key: Hashable, state: CState) -> None:
        for event, count in self._program.entry_counts[state.name]:
            need = count.value if count.kind == "number" else self._need.get(key, {}).get(count.name, 0)
            if need == 0:
                self._queue.append((key, _AT_ONCE, {"state": state, "event": event}))

    def _begin_need(self, payload: Mapping[str, Any]) -> dict[str, int] | None:
        """The K a ``begin`` payload gives each of its instance's counts (None: the spec counts nothing by begin)."""
        names = self._program.begin_counts
        if not names:
            return None
        return {name: self._whole(name, payload, "begin") for name in names}

    def _whole(self, name: str, payload: Mapping[str, Any], event: str) -> int:
        value = payload.get(name, _NOBODY)
        need = whole(value)
        if need is None:
            given = "nothing" if value is _NOBODY else repr(value)
            raise PayloadError(
                f"{'begin' if event == 'begin' else f'event {event!r}'} of machine {self.spec.name!r} must carry "
                f"{name!r}, the number of distinct senders its count waits for (a whole number, 0 or more), not "
                f"{given}; nothing changed"
            )
        return need

    def _count(self, key: Hashable, edge: CEdge, payload: dict[str, Any]) -> dict[str, Any] | None:
        """Count one arrival of a counted event; the payload to step with (without ``sender``) once K distinct
        senders were heard in this stay, else None. A sender heard before is a ``duplicate``, never counted."""
        rest = dict(payload)
        sender = rest.pop(SENDER, _NOBODY)
        count = edge.count
        if count is None:  # a sender for an edge that counts nothing: who sent it does not matter here
            return rest
        if sender is _NOBODY and SENDER not in payload:
            raise PayloadError(
                f"event {edge.event!r} of machine {self.spec.name!r} is counted in state {edge.source.name if edge.source else None!r} "
                f"(count: {count.name or count.value}): pass who sent it, fire(key, {edge.event!r}, sender=...); "
                "nothing changed"
            )
        if count.kind == "number":
            need = count.value
        elif count.kind == "begin":
            need = self._need.get(key, {}).get(count.name, 0)
        else:
            need = self._whole(count.name, rest, edge.event)
        heard = self._heard.get(key)
        if heard is None:
            heard = self._heard[key] = set()
        if sender is not _NOBODY:
            try:
                repeat_ = sender in heard
            except TypeError as exc:
                raise PayloadError(f"sender={sender!r} must be hashable (it is told apart from the others)") from exc
            if repeat_:
                self._anomaly("duplicate", self.spec.key, key, edge.event)
                return None
            heard.add(sender)
        if len(heard) < need:
            self.counts["counted"] += 1
            return None
        return rest

    # -- early events ------------------------------------------------------------

    def _keep_early(self, space: str, ident: Hashable, event: str, payload: Mapping[str, Any]) -> bool:
        """Keep a message of an ``early:`` event naming an id not yet known in its space; False if the event is not
        early there, or the id is one this tracker retired (then it is late). A full bound drops it (``early``)."""
        rule = self._early_rules.get(event)
        if rule is None or self.spec.routed_by(event) != space:
            return False
        try:
            retired = self._retired.get(space)
            if retired is not None and ident in retired:
                return False
            hash(ident)
        except TypeError:
            return False
        allowed = self._payloads.get(event, _EMPTY)
        if payload and not payload.keys() <= allowed:
            raise self._payload_error(event, payload)
        if SENDER in allowed and SENDER not in payload:
            raise PayloadError(
                f"event {event!r} of machine {self.spec.name!r} is counted: pass who sent it, "
                f"deliver({event!r}, id, sender=...), also for an id not yet known; nothing changed"
            )
        keep, within = rule
        if self._early_held[event] >= keep:
            self._anomaly("early", space, ident, event)
            return True
        entry = (event, dict(payload))
        self._early.setdefault((space, ident), []).append(entry)
        self._early_held[event] += 1
        heapq.heappush(self._early_order, (self._clock() + within, self.counts["kept_early"], space, ident, entry))
        self.counts["kept_early"] += 1
        return True

    def _release_early(self, space: str, ident: Hashable, key: Hashable) -> None:
        """The id appeared: what was kept for it runs once the current call's step is done, oldest first."""
        for event, payload in self._early.pop((space, ident)):
            self._early_held[event] -= 1
            self._queue.append((key, event, payload))
        if not self._busy:  # link() from the owner's loop: nothing else will drain
            self._run(self._drain)

    def _drop_early(self, now: float) -> None:
        """Drop, as ``early`` anomalies, the kept messages whose window has passed by ``now``."""
        order = self._early_order
        while order and order[0][0] <= now:
            _due, _n, space, ident, entry = heapq.heappop(order)
            kept = self._early.get((space, ident))
            if kept is None or not any(e is entry for e in kept):
                continue  # applied already
            kept.remove(entry)
            if not kept:
                del self._early[(space, ident)]
            self._early_held[entry[0]] -= 1
            self._anomaly("early", space, ident, entry[0])
        if len(order) > 2 * sum(self._early_held.values()) + 1024:  # applied entries linger until due: compact
            live = {id(e) for kept in self._early.values() for e in kept}
            self._early_order = [x for x in order if id(x[4]) in live]
            heapq.heapify(self._early_order)

    # -- calls made from inside actions ------------------------------------------

    def _enqueue(self, key: Hashable, event: Any, payload: dict[str, Any]) -> None:
        """Queue a call an action made; a key or event that could never run is refused to the action now."""
        hash(key)  # an unhashable key raises TypeError into the action that passed it, not into a later call
        if event is not _BEGIN and type(event) is not str:
            raise TypeError(f"an event is a name (str), not {event!r}")
        self._queue.append((key, event, payload))

    def _drain(self) -> None:
        """Run what actions queued, oldest first, until none remain; each entry's failure is its own.

        Runs with ``_busy`` set and no transition in progress, so retiring
        instances here is safe.
        """
        self._epoch += 1
        queue = self._queue
        while queue:
            key, event, payload = queue.popleft()
            if event is _RETIRE:
                self._retire(payload["done"])
                continue
            if event is _WHEN_TAKEN:  # an event for the children's ends, if the instance still takes it
                state, owner, name = self._live.get(key), payload["owner"], payload["event"]
                if state is not None and state.row.get(name) is not None and (owner is None or owner.idle(key)):
                    self._fire_inner(key, name)
                continue
            if event is _AT_ONCE:  # a count with K = 0, if the instance is still where it was entered
                state, counted = payload["state"], payload["event"]
                if self._live.get(key) is state:
                    self._fire_inner(key, counted, {SENDER: _NOBODY})
                continue
            try:
                if event is _BEGIN:
                    self._begin(key, payload)
                else:
                    self._fire_inner(key, event, payload)  # an unknown key is fire's anomaly (no TrackerClosed inside)
            except KvfsmError as exc:
                name = "begin" if event is _BEGIN else event
                current = self._live.get(key)
                self._record(key, name, f"<queued {name}>", "queued", exc, current.name if current else "(none)")

    def _retire(self, done: list[tuple[Hashable, str]]) -> None:
        """Forget drained instances: their keys (unless begun again since) and their linked ids.

        A key is still its drained instance if it is in the final state it was
        drained in (state names are unique, so the name tells).
        """
        live, gens, linked = self._live, self._gens, self._linked
        retired = self._retired[self.spec.key]
        if not gens and not linked:  # the usual drain: no key was begun again since it finished (that takes a gen)
            keys = list(map(_first, done))
            retired.add(keys)
            pop = live.pop
            for key in keys:
                pop(key, None)
            if self._need:
                for key in keys:
                    self._need.pop(key, None)
            return
        gone = []
        for key, name in done:
            current = live.get(key)
            if current is not None and current.name == name:
                del live[key]
                gone.append(key)
                self._need.pop(key, None)
                if gens:
                    gens.pop(key, None)
                if linked and key in linked:
                    self._unlink(key, keep_from=None)
                continue
            if linked and key in linked:  # key begun again since: its new instance stays
                self._unlink(key, keep_from=gens.get(key))
        retired.add(gone)

    def _force_release(self, key: Hashable, state: CState) -> None:
        """Release everything ``key`` holds without a transition (close() of an unfinishable instance)."""
        del self._live[key]
        self._anomaly("forced", self.spec.key, key, ABORT)
        releases = self._program.releases  # as fire calls them: a batch release gets a one-key list
        self._release_each(key, ABORT, [releases[r] for r in state.holds], state.name)
        if state.after is not None:
            self._armed.pop(key, None)
        if self._phase_rules:
            self._forget_phases(key)
        self._gens.pop(key, None)
        self._heard.pop(key, None)
        self._need.pop(key, None)
        self._unlink(key, keep_from=None)
        if self._owner is not None:
            self._owner.ended(key, failed=True)

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

    def _link_carried(self, key: Hashable, edge: CEdge, payload: Mapping[str, Any]) -> None:
        """Link the ids the spec says this edge's payload carries; one naming another live instance is a failure."""
        for space in edge.links:
            if space not in payload:
                continue
            try:
                self.link(key, space, payload[space])
            except (KvfsmError, TypeError) as exc:
                self._record(key, edge.event, f"<link {space}>", "link", exc, edge.target.name)

    def _resolve(self, space: str, ident: Hashable, event: str, payload: dict[str, Any]) -> Hashable | None:
        entry = self._space(space).get(ident)
        if entry is None:
            if not (self._early_rules and self._keep_early(space, ident, event, payload)):
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
                self._retired[space].add([ident])
        if kept:
            self._linked[key] = kept
        else:
            del self._linked[key]

    # -- reporting -------------------------------------------------------------

    def _held_back(self, clock: Callable[[], float]) -> Callable[[], float]:
        """``clock``, held at its latest reading whenever it runs backwards (or reads NaN).

        Deadlines are kept per state in arming order, which a clock running
        backwards would break; held back, time stands still until the clock
        catches up, and the count says it happened.
        """
        latest = -math.inf
        counts = self.counts

        def now() -> float:
            nonlocal latest
            reading = clock()
            if reading >= latest:  # False for NaN too
                latest = reading
                return reading
            counts["clock_backwards"] += 1
            if latest == -math.inf:
                raise KvfsmError(f"the tracker's clock read {reading!r}: a clock must return seconds as a number")
            return latest

        return now

    def _anomaly(self, kind: AnomalyKind, space: str, ident: Hashable, event: str) -> None:
        """Count and keep a dropped event; an id this tracker retired is ``late``, not ``unknown``."""
        if kind == "unknown":
            try:
                retired = self._retired.get(space)
                if retired is not None and ident in retired:
                    kind = "late"
            except TypeError:  # an unhashable id can never have been retired
                pass
        count = self.counts[kind] = self.counts[kind] + 1
        anomaly = Anomaly(kind, space, _bounded(ident), _bounded(event))
        self._anomalies.append(anomaly)
        if count <= 10 or count % 1000 == 0:  # rate-limited: the first few, then every thousandth
            LOGGER.warning(
                "%s: %s %s for %s=%r dropped (%d so far)", self.spec.name, kind, event, space, anomaly.id, count
            )
        if self._on_anomaly is not None:
            try:
                self._on_anomaly(anomaly)
            except Exception:  # a reporting hook that fails must not fail the event it reports on
                self.counts["observer_errors"] += 1
                LOGGER.exception("%s: on_anomaly raised", self.spec.name)

    def _payload_error(self, event: str, payload: Mapping[str, Any]) -> PayloadError:
        allowed = self._program.begin_payload if event == "begin" else self._payloads.get(event, _EMPTY)
        unknown = sorted(set(payload) - allowed)
        declared = ", ".join(sorted(allowed)) or "nothing"
        hints = [f"{name!r} → {m[0]!r}" for name in unknown if (m := difflib.get_close_matches(name, allowed, n=1))]
        guess = f" Did you mean {'; '.join(hints)}?" if hints else ""
        where = "begin" if event == "begin" else f"event {event!r}"
        return PayloadError(
            f"{where} of machine {self.spec.name!r} carries {', '.join(map(repr, unknown))}, which the spec does not "
            f"declare (it declares: {declared}); nothing changed.{guess} Declare what an event carries with "
            f"'payload: [...]' on its transitions ('begin: {{payload: [...]}}' for begin)."
        )

    def _raise_failures(self, result: Any) -> None:
        failures, self._failures = self._failures, []
        error = ActionError(failures, result)
        fatal = next((f.error for f in failures if not isinstance(f.error, Exception)), None)
        if fatal is not None:
            raise fatal from error
        raise error


_first = itemgetter(0)


def _nothing() -> None:
    """The work of a call that only drains what is queued."""


def _rounds(keys: list[Hashable]) -> list[list[Hashable]]:
    """Split keys into rounds of distinct keys, in order: a key's n-th mention goes to round n. Linear in len(keys)."""
    rounds: list[list[Hashable]] = []
    mentions: dict[Hashable, int] = {}
    for key in keys:
        n = mentions.get(key, 0)
        mentions[key] = n + 1
        if n == len(rounds):
            rounds.append([key])
        else:
            rounds[n].append(key)
    return rounds


def _position(actions: tuple[Callable[..., object], ...], action: Callable[..., object]) -> int:
    """Where ``action`` stands in ``actions`` (each a distinct object): how a step that ran one by one names it."""
    return next(index for index, fn in enumerate(actions) if fn is action)


def _before_name(edge: CEdge, position: int) -> str:
    """The name of ``edge.before[position]``: its do, then its acquires."""
    if edge.do is not None:
        if position == 0:
            return edge.do_name or ""
        position -= 1
    return edge.acquires[position][0]


def _duplicate(key: Hashable, old: CState) -> DuplicateKey:
    return DuplicateKey(f"{key!r} is already live in state {old.name!r}; finish it before beginning it again")


def _release_name(edge: CEdge, index: int) -> str:
    """The name of ``edge.batch_releases[index]``: a release action, or a tap the tracker added after them."""
    return edge.releases[index][0] if index < len(edge.releases) else "<tap>"


class _Unresolved:
    """An id of ``fire_many_by`` that named no current instance when the batch was looked up; looked up at its turn."""

    __slots__ = ("ident",)

    def __init__(self, ident: Hashable) -> None:
        self.ident = ident


class _Via:
    """Where the keys of one round of ``fire_many_by`` came from: the space, when, and each key's id and link entry."""

    __slots__ = ("at", "since", "space")

    def __init__(self, space: str, since: int, at: Mapping[Hashable, tuple[Hashable, tuple[Hashable, int]]]) -> None:
        self.space = space
        self.since = since
        self.at = at


def _bounded(value: Any) -> Any:
    """``value`` if small; else a truncated text of it, so anomaly records stay small whatever ids arrive."""
    if value is None or isinstance(value, float) or (isinstance(value, int) and value.bit_length() <= 4 * ID_LIMIT):
        return value
    if isinstance(value, str):
        return value if len(value) <= ID_LIMIT else value[:ID_LIMIT] + "…"
    if isinstance(value, bytes):
        return value if len(value) <= ID_LIMIT else value[:ID_LIMIT] + b"..."
    try:
        text = repr(value)
    except Exception:
        return f"<unprintable {type(value).__name__}>"
    return value if len(text) <= ID_LIMIT else text[:ID_LIMIT] + "…"
