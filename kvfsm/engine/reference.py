"""The reference interpretation of a spec, built on the ``transitions`` library.

Why it exists: the compiled :class:`~kvfsm.engine.Tracker` earns its speed by
flattening a spec into tables of its own, and a fast engine that quietly
disagrees with its spec is the worst kind of bug. This module interprets the
same :class:`~kvfsm.spec.Spec` a second, independent way, and
``tests/test_differential.py`` drives both with the same random operations and
demands that they agree on every state, legality decision, timeout, held
resource and driver call.

The mapping onto ``transitions`` is direct, so the semantics can be read off it:

* every spec edge is a ``transitions`` transition; its ``do`` and its acquire
  actions are the transition's ``before`` callbacks, and the derived releases
  run in its ``after`` callback, once the state has changed;
* an ignore rule is an internal transition (``dest=None``): legal, no callbacks;
* an event with no transition from the state is ``transitions``' own
  ``MachineError``, turned into :class:`~kvfsm.IllegalTransition`;
* a raising action is routed by the machine's ``on_exception`` hook, which
  undoes the step's acquires and fires ``on_error`` from the source state; if
  the ``on_error`` edge's own action raises (a spec KVF109 rejects, but the
  engine still defines), a twin transition guarded by the ``bare`` condition
  commits that edge without its actions;
* deadlines are armed by the timed states' ``on_enter`` and disarmed by their
  ``on_exit``; final states are collected by ``on_final``;
* ``begin`` is a transition out of a pseudo-state, so the initial state's
  acquires run like any other edge's.

It is slow (``add_model`` per instance, a ``transitions`` event per step) and
belongs off the hot path. Not modelled: events fired from inside driver
actions (run to completion) and id spaces (``link``/``fire_by``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from transitions import Machine, MachineError, State
from transitions.core import EventData

from ..errors import (
    ActionError,
    Anomaly,
    BindingError,
    DuplicateKey,
    Failure,
    IllegalTransition,
    Phase,
    TrackerClosed,
)
from ..spec.model import ABORT, Spec

if TYPE_CHECKING:
    from transitions.core import CallbackList

NEW = "kvfsm:new"
"""Pseudo-state an instance sits in between ``add_model`` and a successful begin."""
BEGIN = "kvfsm:begin"
"""Pseudo-event moving an instance from :data:`NEW` into the initial state.

Failures at begin name the event ``"begin"``, as the Tracker's observer does."""
NOT_BEGUN = "(not begun)"
"""``Failure.state`` of an action that failed at begin: no instance was created."""
STATE_ATTR = "kvfsm_state"
"""The model attribute ``transitions`` keeps the state name in."""


class Deadline(NamedTuple):
    """One armed timeout: when, in which (declaration-ordered) state, armed when, firing what."""

    due: float
    state: int
    seq: int
    event: str


class _ActionRaised(Exception):
    """Carries a driver action's exception to ``on_exception`` with its name and phase."""

    def __init__(self, action: str, phase: Phase, error: Exception) -> None:
        super().__init__(action)
        self.action, self.phase, self.error = action, phase, error


class Instance:
    """A ``transitions`` model: one instance of the machine.

    ``held`` is this interpretation's own ledger, moved by the commit callback
    (the Tracker derives held resources from the state instead).
    """

    def __init__(self, key: Hashable, generation: int) -> None:
        self.key = key
        self.generation = generation
        self.held: list[str] = []
        self.deadline: Deadline | None = None
        self.acquired: list[str] = []
        """Acquire actions run in the current step, undone if a later action raises."""
        self.bare = False
        """Set while an on_error edge is committed without its (raising) actions."""

    @property
    def state(self) -> str:
        return str(getattr(self, STATE_ATTR))


def _model(event_data: EventData) -> Instance:
    return cast(Instance, event_data.model)


class Reference:
    """A ``transitions``-based interpreter of a spec with the Tracker's public API.

    Same calls, same results, same driver calls in the same order: ``begin``,
    ``fire``, ``poll``, ``state``, ``held``, ``holding``, ``finished``,
    ``anomalies``, ``close`` (which visits keys in an order DESIGN.md leaves
    open). Not thread-safe; one instance per test.
    """

    def __init__(
        self,
        spec: Spec,
        driver: object,
        *,
        clock: Callable[[], float] = time.monotonic,
        params: Mapping[str, float] | None = None,
    ) -> None:
        self.spec = spec
        self.driver = driver
        self._clock = clock
        self._params = dict(params or {})
        unknown = sorted(set(self._params) - set(spec.params))
        if unknown:
            raise BindingError(f"params {unknown} are not declared by machine {spec.name!r}")
        self._actions: dict[str, Callable[..., Any]] = {}
        missing = []
        for name in spec.actions():
            method = getattr(driver, name, None)
            if callable(method):
                self._actions[name] = method
            else:
                missing.append(name)
        if missing:
            raise BindingError(f"driver {type(driver).__name__} lacks method(s) {', '.join(missing)}")
        self._live: dict[Hashable, Instance] = {}
        self._finished: list[Instance] = []
        self._failures: list[Failure] = []
        self._anomalies: list[Anomaly] = []
        self._seq = itertools.count()
        self._generations = itertools.count(1)
        self._closed = False
        self._machine = self._build()

    # -- the machine ---------------------------------------------------------

    def _build(self) -> Machine:
        spec = self.spec
        states = [State(NEW)]
        for order, s in enumerate(spec.states.values()):
            on_enter: CallbackList = []
            on_exit: CallbackList = []
            if s.timeout is not None:
                on_enter.append(partial(self._arm, spec.param(s.timeout.after, self._params), order, s.timeout.fire))
                on_exit.append(self._disarm)
            states.append(State(s.name, on_enter=on_enter, on_exit=on_exit, final=s.is_final))
        machine = Machine(
            model=None,
            states=states,
            initial=NEW,
            auto_transitions=False,
            send_event=True,
            ignore_invalid_triggers=False,
            model_attribute=STATE_ATTR,
            on_exception=self._on_exception,
            on_final=self._on_final,
        )
        initial = spec.initial.name
        machine.add_transition(
            BEGIN, NEW, initial, before=self._prepare(None, None, initial), after=partial(self._commit, None, initial)
        )
        for e in spec.edges():
            commit = partial(self._commit, e.source, e.target)
            machine.add_transition(
                e.event,
                e.source,
                e.target,
                unless=self._is_bare,
                before=self._prepare(e.do, e.source, e.target),
                after=commit,
            )
            if e.event == spec.on_error:
                machine.add_transition(e.event, e.source, e.target, conditions=self._is_bare, after=commit)
        for state, event, _rule in spec.ignored():
            machine.add_transition(event, state, None)
        return machine

    def _prepare(self, do: str | None, source: str | None, target: str) -> CallbackList:
        """The ``before`` callbacks of an edge: its ``do``, then an acquire per resource that has one."""
        out: CallbackList = []
        if do is not None:
            out.append(partial(self._do, do))
        for r in self.spec.acquires(source, target):
            acquire = self.spec.resources[r].acquire
            if acquire:
                out.append(partial(self._acquire, r, acquire))
        return out

    @staticmethod
    def _is_bare(event_data: EventData) -> bool:
        return _model(event_data).bare

    # -- callbacks -------------------------------------------------------------

    def _call(self, action: str, event_data: EventData) -> None:
        self._actions[action](_model(event_data).key, **event_data.kwargs)

    def _do(self, action: str, event_data: EventData) -> None:
        try:
            self._call(action, event_data)
        except Exception as exc:
            raise _ActionRaised(action, "do", exc) from exc

    def _acquire(self, resource: str, action: str, event_data: EventData) -> None:
        try:
            self._call(action, event_data)
        except Exception as exc:
            raise _ActionRaised(action, "acquire", exc) from exc
        _model(event_data).acquired.append(resource)

    def _commit(self, source: str | None, target: str, event_data: EventData) -> None:
        """After the state changed: move the ledger, then run each release on its own."""
        inst = _model(event_data)
        releases = self.spec.releases(source, target) if source is not None else ()
        inst.held = [r for r in inst.held if r not in releases] + list(self.spec.acquires(source, target))
        inst.acquired = []
        for r in releases:
            self._release(inst, r, event_data.event.name, event_data.kwargs, inst.state)

    def _release(self, inst: Instance, resource: str, event: str, payload: Mapping[str, Any], state: str) -> None:
        action = self.spec.resources[resource].release
        try:
            self._actions[action](inst.key, **payload)
        except Exception as exc:
            self._failures.append(Failure(inst.key, event, action, "release", exc, state))

    def _arm(self, after: float, state: int, event: str, event_data: EventData) -> None:
        _model(event_data).deadline = Deadline(self._clock() + after, state, next(self._seq), event)

    @staticmethod
    def _disarm(event_data: EventData) -> None:
        _model(event_data).deadline = None

    def _on_final(self, event_data: EventData) -> None:
        self._finished.append(_model(event_data))

    def _on_exception(self, event_data: EventData) -> None:
        """Route an exception raised inside a trigger: illegal event, or a driver action that raised."""
        err = event_data.error
        inst = _model(event_data)
        event = event_data.event.name
        source = event_data.state.name
        if isinstance(err, MachineError):
            accepted = self._machine.get_triggers(source)
            raise IllegalTransition(inst.key, event, source, accepted) from None
        if not isinstance(err, _ActionRaised):
            raise err if err is not None else AssertionError("on_exception without an error")
        reported = "begin" if event == BEGIN else event
        first = len(self._failures)
        self._failures.append(Failure(inst.key, reported, err.action, err.phase, err.error, source))
        undo, inst.acquired = inst.acquired, []
        if event == BEGIN:  # what the initial state holds with no acquire action was held since begin
            initial = self.spec.initial
            undo += [r for r in initial.holds if r not in undo and not self.spec.resources[r].acquire]
        for r in undo:
            self._release(inst, r, reported, event_data.kwargs, source)
        mine = len(self._failures)
        if event == BEGIN:
            ended = NOT_BEGUN
        else:
            on_error = self.spec.on_error
            if on_error is not None and self._handles(source, on_error):
                if event == on_error:
                    inst.bare = True
                    try:
                        self._machine.events[on_error].trigger(inst)
                    finally:
                        inst.bare = False
                else:
                    self._machine.events[on_error].trigger(inst)
            ended = inst.state
        for i in range(first, mine):
            self._failures[i] = replace(self._failures[i], state=ended)

    def _handles(self, state: str, event: str) -> bool:
        """Whether ``state`` has a real (not ignored) transition for ``event``."""
        return any(t.dest is not None for t in self._machine.get_transitions(trigger=event, source=state))

    def _trigger(self, inst: Instance, event: str, payload: Mapping[str, Any]) -> None:
        if event not in self._machine.events:
            raise IllegalTransition(inst.key, event, inst.state, self._machine.get_triggers(inst.state))
        self._machine.events[event].trigger(inst, **payload)

    def _raise_failures(self) -> None:
        failures, self._failures = self._failures, []
        raise ActionError(failures)

    def _is_final(self, inst: Instance) -> bool:
        return bool(self._machine.get_state(inst.state).final)

    # -- the Tracker's API -------------------------------------------------------

    def begin(self, key: Hashable, /, **payload: Any) -> None:
        """Start an instance; on a raising acquire, undo and raise with nothing begun."""
        if self._closed:
            raise TrackerClosed(f"reference for {self.spec.name!r} is closed")
        old = self._live.get(key)
        if old is not None and not self._is_final(old):
            raise DuplicateKey(f"{key!r} is already live in state {old.state!r}")
        inst = Instance(key, next(self._generations))
        self._machine.add_model(inst)
        self._machine.events[BEGIN].trigger(inst, **payload)
        if self._failures:
            self._machine.remove_model(inst)
            self._raise_failures()
        self._live[key] = inst

    def fire(self, key: Hashable, event: str, /, **payload: Any) -> str | None:
        """Apply ``event``; after :meth:`close` no event is accepted at all."""
        if self._closed:
            raise TrackerClosed(f"reference for {self.spec.name!r} is closed; {event!r} for {key!r} refused")
        inst = self._live.get(key)
        if inst is None:
            self._anomalies.append(Anomaly("unknown", self.spec.key, key, event))
            return None
        self._trigger(inst, event, payload)
        if self._failures:
            self._raise_failures()
        return inst.state

    def poll(self, now: float | None = None) -> list[tuple[Hashable, str, str]]:
        """Fire every timeout due at ``now``; deadlines armed during this poll wait for the next one.

        DESIGN.md leaves the order open; this follows the Tracker's documented
        one (state by state in declaration order, in arming order within a
        state) so that both call the driver in the same order.
        """
        if now is None:
            now = self._clock()
        armed_before = next(self._seq)
        due = sorted(
            (
                (inst.deadline, inst)
                for inst in self._live.values()
                if inst.deadline is not None and inst.deadline.due <= now and inst.deadline.seq < armed_before
            ),
            key=lambda pair: (pair[0].state, pair[0].seq),
        )
        fired: list[tuple[Hashable, str, str]] = []
        for deadline, inst in due:
            if inst.deadline != deadline:
                continue  # moved meanwhile (only events fired from actions could do that)
            self._trigger(inst, deadline.event, {})
            fired.append((inst.key, deadline.event, inst.state))
        if self._failures:
            self._raise_failures()
        return fired

    def close(self) -> None:
        """Abort every live instance; release directly what abort cannot finish (a ``forced`` anomaly)."""
        if self._closed:
            return
        try:
            for inst in [i for i in self._live.values() if not self._is_final(i)]:
                if self._handles(inst.state, ABORT):
                    self._trigger(inst, ABORT, {})
                if not self._is_final(inst):
                    self._anomalies.append(Anomaly("forced", self.spec.key, inst.key, ABORT))
                    for r in [r for r in self.spec.holds(inst.state) if r in inst.held]:
                        self._release(inst, r, ABORT, {}, inst.state)
                    inst.held = []
                    inst.deadline = None
                    del self._live[inst.key]
                    self._machine.remove_model(inst)
        finally:
            self._closed = True
        if self._failures:
            self._raise_failures()

    def state(self, key: Hashable) -> str | None:
        inst = self._live.get(key)
        return inst.state if inst is not None else None

    def held(self, key: Hashable) -> tuple[str, ...]:
        inst = self._live.get(key)
        return tuple(inst.held) if inst is not None else ()

    def generation(self, key: Hashable) -> int | None:
        inst = self._live.get(key)
        return inst.generation if inst is not None else None

    def holding(self) -> dict[str, int]:
        out = dict.fromkeys(self.spec.resources, 0)
        for inst in self._live.values():
            for r in inst.held:
                out[r] += 1
        return out

    def finished(self) -> list[tuple[Hashable, str]]:
        """Drain (key, final state) in the order instances finished, retiring them."""
        done, self._finished = self._finished, []
        for inst in done:
            if self._live.get(inst.key) is inst:
                del self._live[inst.key]
            self._machine.remove_model(inst)
        return [(inst.key, inst.state) for inst in done]

    def anomalies(self) -> list[Anomaly]:
        out, self._anomalies = self._anomalies, []
        return out
