"""Run an explorer trace (``kvfsm-trace/1``) on real Trackers and drivers, one per role instance, and say where they
part.

The explorer proves a violation on the spec model; running its trace shows it
on your code. Each role's instance (one per rank of a role with ranks:
``decode#0``, ``decode#1``) gets a Tracker over its spec, a driver from the
role's factory (or a :class:`~kvfsm.testing.ledger.LedgerDriver`) and a
virtual clock. Each step of the trace is performed the way a deployment
would make it happen:

- ``begin`` → ``tracker.begin(request)``;
- ``fire``, ``ignore`` or ``count`` → ``tracker.fire(request, event)``; a
  delivered message (a copy of it, from one sender rank to one receiver
  rank) fires the message's event on the receiving instance's tracker, with
  its sending instance as the ``sender`` a count tells apart. A ``timeout`` step moves
  that role's clock to the instance's deadline that fires the step's event
  (its state's own, or a phase's it is in: due at the phase's entry plus its
  ``after``, whatever moves inside the phase came since) and calls
  ``poll()``, which must fire exactly that timeout; when another deadline
  would fall due at the same time or first (another instance's, or another
  of this instance's: the explorer is untimed, a clock is not), the
  timeout's event is fired directly instead, and the step says so;
- ``reject`` → ``fire`` must raise :class:`~kvfsm.errors.IllegalTransition`;
- ``reply`` → the finished instance's server answers; no tracker is called;
- ``crash`` → the role instance's process dies: its tracker and driver are
  dropped as they are (no release runs; what they held is lost with them)
  and a new tracker and a new driver from the role's factory stand in for
  the process that comes back. The request's instance is then ``crashed``:
  unknown to the new tracker, nothing observed; a message that reaches it
  is dropped, no tracker called. A crash loses every request of the
  process, so one is refused while another request is live there.

A family (``owns:``) runs as it does in one process: the ranks of a child
role are keys of one tracker (``r0#1``) attached to the parent's
(``parent=``), each child's begin names its parent, and the children's
factory gets the parent's driver. An ``owner`` step (``ended``, ``failed``,
a forwarded event) is not performed: the engine fired it in the call of the
step before, and the run checks where it left the instance. What a trace
run cannot perform yet is refused before any driver is made
(:func:`check_replayable`): a parent role with ranks, and a crash in a
system with a family.

After every step the instance's state must be the step's ``to``, and both the
Tracker's ledger and ``driver.observe(request)`` must equal its ``holds``;
nothing may raise that the step does not call for. The first difference stops
the run (:class:`Mismatch`). A run that matches to the end then checks the
violation the trace ends in on the real objects: it builds the
:class:`~kvfsm.spec.system.Snapshot` the explorer judged, from the trackers'
states, the drivers' ``observe`` and the messages in flight, and asks the
properties' one evaluator (:func:`~kvfsm.spec.system.violation`). Reading and
checking the trace is the trace format's (:mod:`kvfsm.explore.trace`).

Beyond the spec's actions and ``observe``, drivers follow the protocol of
:mod:`kvfsm.testing.contract` (``before_begin``), plus ``before_fire(key, event,
resources)`` for a transition into a state that holds resources no acquire
action takes: what your code takes before calling ``fire`` (prefill's own KV
pages, once decode's page indices are in).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import Tracker
from ..errors import ActionError, BindingError, IllegalTransition, KvfsmError
from ..explore.trace import Step, Trace, TraceError, TraceSource, as_trace, carry, check_trace
from ..spec import Spec
from ..spec.system import LastStep, Snapshot, System, load_system, violation
from ..spec.system.channel import Traffic
from .calls import CallTimeout, CallTimer, Factory
from .clock import VirtualClock
from .contract import DriverFactory
from .cover import caller_taken
from .ledger import LedgerDriver
from .machine import begin_resources, check_driver
from .oracle import SpecModel


def _held(names: Collection[str]) -> str:
    return ", ".join(sorted(names)) or "nothing"


# -- what a trace run returns --------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """The first place where the real trackers and drivers part from the trace."""

    index: int
    """Position of the step in ``trace.steps``."""
    label: str
    """``step 3`` (the chart's numbering) or ``begin r0 on decode``."""
    what: str
    """``state``, ``holds`` (the Tracker's ledger), ``observe`` (the driver), ``raised``, ``hung`` (a driver call
    did not return within the call timeout), ``timeout``, ``ignore``, ``transition``, ``reject``, ``crash`` (another
    request was live in the process that dies) or ``violation`` (the steps matched, the violation did not show)."""
    expected: str
    actual: str

    def __str__(self) -> str:
        return f"{self.label}: {self.what}: expected {self.expected}, got {self.actual}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "label": self.label,
            "what": self.what,
            "expected": self.expected,
            "actual": self.actual,
        }


@dataclass(frozen=True)
class TraceStepResult:
    """One step of a trace as run: what was called, and what the tracker and the driver said afterwards."""

    index: int
    number: int | None
    """The chart's step number; ``None`` for a begin."""
    step: Step
    call: str
    """The Tracker call that made it happen: ``begin``, ``fire``, ``poll at t=300``, ``none (…)`` for a reply."""
    state: str | None
    observed: tuple[str, ...] | None
    """``driver.observe(request)`` after the step (``None`` if it raised)."""
    mismatch: Mismatch | None = None

    @property
    def label(self) -> str:
        s = self.step
        return f"step {self.number}" if self.number is not None else f"begin {s.request} on {s.role}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "number": self.number,
            "step": self.step.as_dict(),
            "call": self.call,
            "state": self.state,
            "observed": list(self.observed) if self.observed is not None else None,
            "matched": self.mismatch is None,
        }


@dataclass(frozen=True)
class TraceResult:
    """A whole trace run: each step, the first mismatch, and whether the trace's violation showed on the real drivers."""

    trace: Trace
    system: str
    drivers: Mapping[str, str]
    """role → what drove it (the driver's class, or the built-in ledger)."""
    steps: tuple[TraceStepResult, ...]
    mismatch: Mismatch | None
    reproduced: bool
    summary: str
    """One sentence: ``step 4: prefill is in transferring while decode lacks kv_pages — reproduced on the real drivers``."""

    @property
    def verdict(self) -> str:
        """``reproduced``, ``diverged`` (a step did not match), or ``not reproduced`` (all did; the violation did not show)."""
        if self.reproduced:
            return "reproduced"
        return "not reproduced" if self.mismatch is None or self.mismatch.what == "violation" else "diverged"

    @property
    def passed(self) -> bool:
        return self.reproduced

    def as_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "trace_system": self.trace.system,
            "property": self.trace.prop,
            "request": self.trace.request,
            "drivers": dict(self.drivers),
            "verdict": self.verdict,
            "reproduced": self.reproduced,
            "summary": self.summary,
            "mismatch": self.mismatch.as_dict() if self.mismatch is not None else None,
            "steps": [s.as_dict() for s in self.steps],
        }


# -- the run ---------------------------------------------------------------------


class _Diverged(Exception):
    """Raised inside a step to stop at its first mismatch."""

    def __init__(self, what: str, expected: str, actual: str) -> None:
        super().__init__(what)
        self.what, self.expected, self.actual = what, expected, actual


def _failures(exc: ActionError) -> str:
    return "; ".join(f"{f.action}() raised {type(f.error).__name__}: {f.error}" for f in exc.failures)


class TraceRun:
    """A trace being run, one step at a time: ``step()`` until it returns ``None``, then ``result()``.

    ``trackers``, ``drivers`` and ``clocks`` (per role) stay as the trace left
    them, to look at between and after steps. Roles with no factory in
    ``drivers`` get a :class:`LedgerDriver`.

    ``timer`` times every call into a driver (the factories included); a call
    that does not return in time is a ``hung`` mismatch and ends the run. A
    factory that raises (or hangs) raises
    :class:`~kvfsm.testing.calls.DriverError`, naming the role, the call and
    ``purpose``; pass :class:`~kvfsm.testing.calls.Factory` objects to count
    calls across runs.
    """

    def __init__(
        self,
        system: System | str | Path,
        trace: TraceSource,
        drivers: Mapping[str, DriverFactory | Factory] | None = None,
        *,
        timer: CallTimer | None = None,
        purpose: str = "",
    ) -> None:
        self.system = system if isinstance(system, System) else load_system(system)
        self.trace = as_trace(trace)
        check_replayable(self.trace, self.system)
        self._wide = self.system.expanded()
        """The system with one role per rank's instance, as the trace names them (``decode#1``)."""
        factories = dict(drivers or {})
        unknown = sorted(set(factories) - set(self.system.roles))
        if unknown:
            raise KvfsmError(
                f"no role {unknown[0]!r} in {self.system.name} for a driver; its roles are {', '.join(self.system.roles)}"
            )
        self.timer = timer
        self.hung = ""
        """What a call that did not return in time was (the run ends there); "" if none did."""
        self.drivers: dict[str, object] = {}
        """Per role instance (``decode``, or ``decode#0``, ``decode#1`` for a role with ranks): its own driver."""
        self.driven_by: dict[str, str] = {}
        """Per declared role: what drove its instances."""
        self._made = {
            name: given if isinstance(given, Factory) else Factory(given, timer, role=name)
            for name, given in factories.items()
        }
        self._purpose = purpose
        self._parent: dict[str, tuple[str, str]] = {
            child: (name, rule.by)
            for name, role in self._wide.roles.items()
            for rule in role.spec.owns.values()
            for child, other in self._wide.roles.items()
            if other.spec.name == rule.machine
        }
        """A family's child role instance → (its parent role instance, the begin payload key that names the parent)."""
        self._host: dict[str, str] = {}
        """Role instance → the one whose tracker, driver, clock and model it shares: a family lives in one process,
        so the ranks of a child role are keys of one tracker (``r0#1``), attached to the parent's (``parent=``)."""
        for name in self._wide.roles:
            base = self._wide.base_of(name)
            self._host[name] = self._wide.instances_of(base)[0] if name in self._parent else name
        self.clocks: dict[str, VirtualClock] = {}
        self.trackers: dict[str, Tracker] = {}
        for name in sorted(self._wide.roles, key=lambda n: n in self._parent):  # parents first
            host = self._host[name]
            if host != name:
                self.drivers[name], self.clocks[name] = self.drivers[host], self.clocks[host]
                self.trackers[name] = self.trackers[host]
                continue
            self.drivers[name] = self._driver(name)
            parent = self._parent.get(name)
            self.clocks[name] = self.clocks[parent[0]] if parent else VirtualClock()
            self.trackers[name] = self._tracker(name)
        self._loop_start: tuple[object, ...] | None = None
        """A lasso's request as it stood before the cycle's first move (:meth:`_where`)."""
        self._crashed: set[tuple[str, str]] = set()
        """(role instance, request) of every instance whose process died (the ``crash`` steps so far)."""
        models = {name: SpecModel(role.spec) for name, role in self._wide.roles.items() if self._host[name] == name}
        self._models = {name: models[self._host[name]] for name in self._wide.roles}
        """The spec's own view of each role: where its deadlines stand, which transition an event takes."""
        self._traffic = Traffic(self._wide.wire)
        self._done: list[TraceStepResult] = []
        self._numbers: list[int | None] = []
        n = 0
        for s in self.trace.steps:
            n += s.action != "begin"
            self._numbers.append(n if s.action != "begin" else None)
        self._rejected = False

    def _driver(self, name: str) -> object:
        """A driver for role instance ``name``: from its role's factory, else the built-in ledger."""
        spec, base = self._wide.roles[name].spec, self._wide.base_of(name)
        if base not in self._made:
            self.driven_by[base] = "ledger (built in)"
            return LedgerDriver(spec)
        parent = self._parent.get(name)  # an owned machine's factory gets its parent's driver (what they share)
        driver = self._made[base].make(self._purpose, *([self.drivers[parent[0]]] if parent else []))
        check_driver(spec, driver)
        _check_before_fire(spec, driver)
        self.driven_by[base] = type(driver).__name__
        return driver

    def _tracker(self, name: str) -> Tracker:
        parent = self._parent.get(name)
        return Tracker(
            self._wide.roles[name].spec, self.drivers[name], clock=self.clocks[name], threadsafe=False,
            parent=self.trackers[parent[0]] if parent else None,
        )  # fmt: skip

    def _key(self, role: str, request: str) -> str:
        """The key ``role``'s instance of ``request`` has in its tracker: the request, or ``r0#1`` for a rank of a
        family's child role (its ranks share one tracker)."""
        base = self._wide.base_of(role)
        return f"{request}{role[len(base) :]}" if role in self._parent and role != base else request

    @property
    def done(self) -> tuple[TraceStepResult, ...]:
        return tuple(self._done)

    @property
    def finished(self) -> bool:
        """Every step was run, or one did not match."""
        return len(self._done) == len(self.trace.steps) or any(s.mismatch for s in self._done)

    def __iter__(self) -> Iterator[TraceStepResult]:
        while (done := self.step()) is not None:
            yield done

    def step(self) -> TraceStepResult | None:
        """Run the next step and check it; ``None`` once the run is over."""
        if self.finished:
            return None
        index = len(self._done)
        step = self.trace.steps[index]
        number = self._numbers[index]
        label = f"step {number}" if number is not None else f"begin {step.request} on {step.role}"
        call, state, observed, mismatch = "", None, None, None
        try:
            if number is not None and number - 1 == self.trace.loop:
                self._loop_start = self._where()  # where the cycle begins: it must come back here
            call = self._perform(step)
            carry(self._traffic, step)
            if self._moved_on(index):
                state = self._state(step.role, step.request)
                observed = self._observe(step.role, step.request)
                call += " (the engine moves it on in the same call: checked at its own step below)"
            else:
                state, observed = self._check(step)
        except _Diverged as d:
            mismatch = Mismatch(index, label, d.what, d.expected, d.actual)
            state = self._state(step.role, step.request)
            try:
                observed = None if self.hung else self._observe(step.role, step.request)
            except _Diverged:
                observed = None
        done = TraceStepResult(index, number, step, call, state, observed, mismatch)
        self._done.append(done)
        return done

    def run(self) -> TraceResult:
        """Run every step that is left and return the result."""
        for _ in self:
            pass
        return self.result()

    # -- performing a step -------------------------------------------------------

    def _moved_on(self, index: int) -> bool:
        """Whether an ``owner`` step the engine fires in the same call as step ``index`` (the steps right after it
        with that cause) moves the same instance on: its state is checked there, not here."""
        me = self.trace.steps[index]
        for later in self.trace.steps[index + 1 :]:
            if later.cause != "owner":
                return False
            if (later.role, later.request) == (me.role, me.request):
                return True
        return False

    def _event(self, step: Step) -> str:
        """The event a step fires on its role's tracker: a delivered copy of a message (``read@prefill#1``) fires
        the message's event (``read``)."""
        assert step.event is not None  # check_trace: only a begin has no event
        message = self._wide.messages.get(step.event) if step.cause == "message" else None
        return message.event if message is not None else step.event

    def _counted(self, step: Step, event: str) -> dict[str, Any]:
        """Who sent a message the role's spec counts: its sending role's instance (one per rank), and K where the
        arrival gives it: the senders the system counts (``count:``), else 1."""
        role, key = step.role, self._key(step.role, step.request)
        message = self._wide.messages.get(step.event or "") if step.cause == "message" else None
        sender = message.sender if message is not None else role
        need = max(message.count, 1) if message is not None else 1
        return self._models[role].count_payload(self.trackers[role].state(key), event, sender, need)

    def _perform(self, step: Step) -> str:
        """Make the step happen on the role's tracker; returns what was called."""
        role, req = step.role, self._key(step.role, step.request)
        tracker, model = self.trackers[role], self._models[role]
        self._rejected = False
        if step.action == "reply":
            return f"none (the server answers with {', '.join(s.message for s in step.sent)})"
        if step.cause == "crash":
            return self._crash(step)
        if (role, step.request) in self._crashed:
            return "none (its process died: what reaches it there is dropped)"
        if step.action == "begin":
            given = begin_resources(model.spec)
            payload: dict[str, Any] = {}
            if given or (model.spec.begin_payload and hasattr(self.drivers[role], "before_begin")):
                payload.update(self._hook(role, "before_begin", req, given))
            parent = self._parent.get(role)
            if parent:
                payload[parent[1]] = self._key(parent[0], step.request)
            self._call(lambda: tracker.begin(req, **payload), step)
            model.begin(req)
            return "begin"
        event = self._event(step)
        if step.cause == "owner":  # the engine fired it for the family, in the call of the step before
            model.fire(req, event, {})
            return "none (the engine fired it for the family, in the call above)"
        edge = model.edges.get((tracker.state(req) or "", event))
        given_payload: Mapping[str, Any] = {}
        if step.action == "fire" and edge is not None:
            given = caller_taken(model.spec, edge.source, edge.target)
            declared = model.spec.table[(edge.source, event)].transition.payload
            if given or (declared and hasattr(self.drivers[role], "before_fire")):
                given_payload = self._hook(role, "before_fire", req, event, given)
        why = ""
        if step.cause == "timeout":
            polled, why = self._timeout(step, event)
            if polled:
                return polled
        ignored = tracker.counts["ignored"]
        payload = {**given_payload, **self._counted(step, event)}
        got = self._call(lambda: tracker.fire(req, event, **payload), step)
        model.fire(req, event, payload)
        call = f"fire ({why})" if why else "fire"
        if step.action == "reject":
            if not self._rejected:
                raise _Diverged("reject", "IllegalTransition", f"fire() returned {got!r}")
            return "fire → IllegalTransition"
        was_ignored = tracker.counts["ignored"] > ignored
        if step.action == "ignore" and not was_ignored:
            raise _Diverged("ignore", f"{event} ignored in {step.target}", f"a transition to {got}")
        if step.action == "fire" and was_ignored:
            raise _Diverged("transition", f"{event}: {step.source} → {step.target}", f"{event} ignored in {got}")
        return call

    def _crash(self, step: Step) -> str:
        """The process of ``step.role``'s instance dies and comes back: a new tracker and driver, nothing kept."""
        role, req = step.role, step.request
        model = self._models[role]
        others = [k for k in model.live if k != req and not model.is_final(k)]
        if others:
            raise _Diverged(
                "crash", f"{req} the only request live in {role}'s process",
                f"{', '.join(map(str, others))} live there too: a real crash loses them all",
            )  # fmt: skip
        now = model.now
        self.drivers[role] = self._driver(role)
        self.trackers[role] = self._tracker(role)
        self._models[role] = SpecModel(self._wide.roles[role].spec)
        self._models[role].now = now
        self._crashed.add((role, req))
        return "crash (a new tracker and driver stand in for the process that died; nothing of it is released)"

    def _timeout(self, step: Step, event: str) -> tuple[str, str]:
        """Let the instance's deadline that fires ``event`` pass (its state's own, else a phase's it is in) and
        ``poll()``: (what was called, "") or ("", why the event is fired instead)."""
        role, req = step.role, self._key(step.role, step.request)
        model, clock, tracker = self._models[role], self.clocks[role], self.trackers[role]
        armed = model.deadlines()
        mine = next((d for d in armed if d[0] == req and d[3] == event), None)
        if mine is None:
            return "", f"no deadline that fires {event} armed for {req} in {model.state(req)}"
        due = mine[1]

        def named(key: object, phase: str) -> str:
            if phase:
                return f"{key}'s deadline of phase {phase}"
            return f"{key}'s own deadline" if key == req else str(key)

        earlier = sorted(named(k, p) for k, when, p, _e in armed if (k, when, p, _e) != mine and when <= due)
        if earlier:
            return "", f"{', '.join(earlier)} would fall due first"
        clock.now = max(clock.now, due)
        for name, other in self.clocks.items():  # a family shares its process's clock: each model reads it
            if other is clock:
                self._models[name].now = clock.now
        fired = self._call(tracker.poll, step)
        model.poll()
        if fired != [(req, event, step.target)]:
            raise _Diverged("timeout", f"poll() fires [({req!r}, {event!r}, {step.target!r})]", f"{fired}")
        return f"poll at t={clock.now:g}", ""

    def _named(self, role: str) -> str:
        """What drives a role's instance (its driver's class, or the built-in ledger)."""
        return self.driven_by[self._wide.base_of(role)]

    def _timed(self, role: str, what: str) -> AbstractContextManager[None]:
        """The call timer's guard for one call into ``role``'s driver (nothing when calls are not timed)."""
        return self.timer.call(what, self.drivers[role]) if self.timer is not None else nullcontext()

    def _hook(self, role: str, name: str, *args: Any) -> Mapping[str, Any]:
        """Call the driver's ``before_begin``/``before_fire``; what it returns, if a mapping, is the call's payload."""
        hook: Callable[..., object] = getattr(self.drivers[role], name)
        try:
            with self._guard(role, f"{self._named(role)}.{name}{args!r}"):
                got = hook(*args)
                return got if isinstance(got, Mapping) else {}
        except _Diverged:
            raise
        except Exception as exc:
            raise _Diverged("raised", "nothing raised", f"{name}() raised {type(exc).__name__}: {exc}") from None

    @contextmanager
    def _guard(self, role: str, what: str) -> Iterator[None]:
        """Time a call into ``role``'s driver; one that does not return in time is a ``hung`` mismatch."""
        try:
            with self._timed(role, what):
                yield
        except CallTimeout as exc:
            self.hung = str(exc)
            raise _Diverged("hung", f"a return within {exc.seconds:g} s", self.hung) from None

    def _call(self, call: Callable[[], Any], step: Step) -> Any:
        """One Tracker call; only an IllegalTransition that a reject step calls for may come out of it."""
        self._rejected = False
        try:
            with self._guard(step.role, "a Tracker call of this step (it runs the driver's actions)"):
                return call()
        except _Diverged:
            raise
        except IllegalTransition as exc:
            if step.action == "reject":
                self._rejected = True
                return None
            raise _Diverged("raised", "nothing raised", f"IllegalTransition: {exc}") from None
        except ActionError as exc:
            raise _Diverged("raised", "nothing raised", f"ActionError: {_failures(exc)}") from None
        except Exception as exc:
            raise _Diverged("raised", "nothing raised", f"{type(exc).__name__}: {exc}") from None

    def _check(self, step: Step) -> tuple[str | None, tuple[str, ...]]:
        """State, the Tracker's ledger, then the driver's real resources, against the step."""
        tracker, key = self.trackers[step.role], self._key(step.role, step.request)
        state = self._state(step.role, step.request)
        if state != step.target:
            raise _Diverged("state", repr(step.target), repr(state))
        want = set(step.holds)
        if set(tracker.held(key)) != want:
            raise _Diverged("holds", _held(want), f"the Tracker's ledger says {_held(tracker.held(key))}")
        seen = self._observe(step.role, step.request)
        if set(seen) != want:
            raise _Diverged("observe", _held(want), f"{self._named(step.role)}.observe says {_held(seen)}")
        return state, seen

    def _state(self, role: str, request: str) -> str | None:
        """The instance's state as the trace names it: ``crashed`` once its process died."""
        if (role, request) in self._crashed:
            return "crashed"
        return self.trackers[role].state(self._key(role, request))

    def _observe(self, role: str, request: str) -> tuple[str, ...]:
        observe: Callable[[str], Collection[str]] = getattr(self.drivers[role], "observe")  # noqa: B009
        key = self._key(role, request)
        try:
            with self._guard(role, f"{self._named(role)}.observe({key!r})"):
                return tuple(sorted(observe(key)))
        except _Diverged:
            raise
        except Exception as exc:
            raise _Diverged(
                "raised", "nothing raised", f"observe({key!r}) raised {type(exc).__name__}: {exc}"
            ) from None

    # -- the end -------------------------------------------------------------------

    def result(self) -> TraceResult:
        """What the run found so far: the steps, the first mismatch, and (at the end) the violation checked."""
        mismatch = next((s.mismatch for s in self._done if s.mismatch is not None), None)
        label = self._done[-1].label if self._done else "before any step"
        if mismatch is not None:
            reproduced, summary = False, f"diverged at {mismatch}"
        elif len(self._done) < len(self.trace.steps):
            reproduced, summary = (
                False,
                f"stopped after {label}: {len(self.trace.steps) - len(self._done)} step(s) left",
            )
        else:
            found: str | None
            try:
                found = self._violation()
            except _Diverged as d:
                mismatch = Mismatch(len(self._done), label, d.what, d.expected, d.actual)
                found = None
            reproduced = found is not None
            if found is not None:
                summary = f"{label}: {found} — reproduced on {self._on_what()}"
            else:
                summary = f"every step matched, but {self.trace.prop} did not show at the end"
                if mismatch is not None:
                    summary += f": {mismatch.actual}"
        return TraceResult(
            self.trace, self.system.name, dict(self.driven_by), tuple(self._done), mismatch, reproduced, summary
        )

    def _on_what(self) -> str:
        """``the real drivers``, or which roles ran on real ones and which on the ledger."""
        ledger = [n for n, d in self.drivers.items() if isinstance(d, LedgerDriver)]
        real = [n for n in self.drivers if n not in ledger]
        if not ledger:
            return "the real drivers"
        if not real:
            return "real trackers with ledger drivers"
        return f"the real {' and '.join(real)} driver{'s' if len(real) > 1 else ''} (ledger for {', '.join(ledger)})"

    def _where(self, snap: Snapshot | None = None) -> tuple[object, ...]:
        """The request's instances (states and what the drivers observe) and its messages in flight (of ``snap``, or
        as they are now)."""
        snap = snap if snap is not None else self._snapshot()
        return tuple(sorted(snap.states.items())), tuple(sorted(snap.held.items())), snap.in_flight

    def _violation(self) -> str:
        """The trace's violation as it shows on the real trackers and drivers, in words; diverges if it does not."""
        prop = self._wide.property_named(self.trace.prop)
        if prop.liveness:
            return self._lasso()
        snap = self._snapshot()
        found = violation(self._wide, prop, snap)
        if found is None:
            raise _Diverged("violation", prop.describe(), _describe(snap))
        return found

    def _lasso(self) -> str:
        """An ``eventually`` broken by a lasso: after the cycle ran once the request is where the cycle began (so it
        can run forever), and, there, an instance is live (``final``) or holds something (``released``)."""
        snap = self._snapshot()
        where = self._where(snap)
        start = self._loop_start if self._loop_start is not None else where  # a cycle of no moves: it stays put
        if where != start:
            raise _Diverged("violation", "the cycle to end where it began", f"began at {start}, ended at {where}")
        if self.trace.prop == "released":
            stuck = [f"{r} keeps {_held(h)}" for r, h in snap.held.items() if h]
        else:
            stuck = [
                f"{r} in {st}" for r, st in snap.states.items()
                if st is not None and st != "crashed" and not self._wide.roles[r].spec.states[st].is_final
            ]  # fmt: skip
        if not stuck:
            raise _Diverged("violation", self.trace.violation, _describe(snap))
        return f"{self.trace.violation} (the cycle came back to where it began: {'; '.join(stuck)})"

    def _snapshot(self) -> Snapshot:
        """The trace's request as the properties see it: trackers' states, drivers' observe, messages in flight."""
        req = self.trace.request
        states = {name: self._state(name, req) for name in self.trackers}
        held = {name: self._observe(name, req) for name, state in states.items() if state is not None}
        last = self.trace.steps[-1] if self.trace.steps else None
        step = None
        if last is not None and last.event is not None:
            kept = tuple(s.message for s in last.sent if not s.lost)
            step = LastStep(last.role, last.event, rejected=self._rejected, sent=kept)
        return Snapshot(states, held, self._traffic.of(req), self._traffic.total(), step)


def check_replayable(trace: Trace, system: System) -> None:
    """Raise :class:`TraceError` unless ``trace`` can happen in ``system`` (:func:`check_trace`) and a trace run
    can perform each of its steps: not yet a parent role (``owns:``) with ranks, nor a crash in a system with a
    family."""
    owners = [name for name, r in system.roles.items() if r.spec.owns]
    for name in owners:
        if system.roles[name].ranks > 1:
            raise TraceError(
                f"roles.{name}",
                f"{system.name}: role {name} owns instances of another machine (owns:) and has ranks; a trace run "
                "attaches a family's children to one parent tracker, so it cannot run a parent per rank yet",
            )
    crash = next((i for i, s in enumerate(trace.steps) if s.cause == "crash"), None)
    if owners and crash is not None:
        raise TraceError(
            f"steps[{crash}].cause",
            f"{system.name}: this step crashes {trace.steps[crash].role}'s process in a system with a family "
            "(owns:), and a trace run does not crash a family's linked trackers yet",
        )
    check_trace(trace, system)


def _describe(snap: Snapshot) -> str:
    """What a snapshot shows, for a violation that did not."""
    roles = [
        f"{role} is in {state} holding {_held(snap.held.get(role, ()))}" if state is not None else f"{role} has none"
        for role, state in snap.states.items()
    ]
    return "; ".join(roles) + f"; {snap.in_flight} message(s) in flight ({snap.load} in all)"


def _check_before_fire(spec: Spec, driver: object) -> None:
    """A spec that enters a resource with no acquire action needs the driver's ``before_fire``."""
    given = sorted({r for e in spec.edges() for r in caller_taken(spec, e.source, e.target)})
    if given and not callable(getattr(driver, "before_fire", None)):
        raise BindingError(
            f"spec {spec.name!r}: a transition enters {', '.join(given)} with no acquire action, so your code takes "
            f"it before calling fire(); give driver {type(driver).__name__} a before_fire(key, event, resources) "
            "method that does the same, so observe() can see it"
        )


def replay_trace(
    system: System | str | Path,
    trace: TraceSource,
    drivers: Mapping[str, DriverFactory] | None = None,
    *,
    call_timeout: float | None = None,
    on_stuck: Callable[[str], None] | None = None,
) -> TraceResult:
    """Run ``trace`` on one Tracker and one driver per role (a ledger where ``drivers`` has no factory).

    ``call_timeout`` (seconds) bounds each call into a driver: one that does not
    return in time is a ``hung`` mismatch (see :class:`TraceRun`, and
    :class:`~kvfsm.testing.calls.CallTimer` for ``on_stuck``).

    >>> result = replay_trace("specs/pd_abort/merged_fix.yaml", "trace.json", {"decode": make_decode})
    >>> result.summary
    'step 4: prefill is in transferring while decode lacks kv_pages — reproduced on the real drivers'
    """
    return TraceRun(system, trace, drivers, timer=CallTimer(call_timeout, on_stuck=on_stuck)).run()


__all__ = [
    "Mismatch",
    "TraceError",
    "TraceResult",
    "TraceRun",
    "TraceStepResult",
    "check_replayable",
    "replay_trace",
]
