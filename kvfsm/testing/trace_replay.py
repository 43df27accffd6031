"""Replay an explorer trace (``kvfsm-trace/1``) on real Trackers and drivers, one per role, and say where they part.

The explorer proves a violation on the spec model; a replay shows it on your
code. Each role gets a Tracker over its spec, a driver from your factory (or a
:class:`~kvfsm.testing.ledger.LedgerDriver`) and a virtual clock. Each step of
the trace is performed the way a deployment would make it happen:

- ``begin`` → ``tracker.begin(request)``;
- ``fire`` or ``ignore`` → ``tracker.fire(request, event)``; a delivered
  message is fired on the receiving role's tracker. A ``timeout`` step moves
  that role's clock to the instance's deadline and calls ``poll()``, which
  must fire exactly that timeout; when another instance's deadline would fall
  due first (the explorer is untimed, a clock is not), the timeout's event is
  fired directly instead, and the step says so;
- ``reject`` → ``fire`` must raise :class:`~kvfsm.errors.IllegalTransition`;
- ``reply`` → the finished instance's server answers; no tracker is called.

After every step the instance's state must be the step's ``to``, and both the
Tracker's ledger and ``driver.observe(request)`` must equal its ``holds``;
nothing may raise that the step does not call for. The first difference stops
the replay (:class:`Mismatch`). A replay that matches to the end then checks
the violation the trace ends in on the real objects: a ``never`` property
against the trackers' states and the drivers' ``observe``, a message property
against the ``IllegalTransition`` raised, ``overflow``, ``deadlock`` and ``leak``
against the channel and what the stuck instances really hold.

Beyond the spec's actions and ``observe``, drivers follow the protocol of
:mod:`kvfsm.testing.machine` (``before_begin``), plus ``before_fire(key, event,
resources)`` for a transition into a state that holds resources no acquire
action takes: what your code takes before calling ``fire`` (prefill's own KV
pages, once decode's page indices are in).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import Tracker
from ..errors import ActionError, BindingError, IllegalTransition, KvfsmError
from ..explore.trace import Step, Trace, TraceError, read_trace
from ..spec import Spec
from ..spec.system import BUILTINS, System, load_system
from .ledger import LedgerDriver
from .machine import DriverFactory, VirtualClock, begin_resources, check_driver
from .model import SpecModel
from .runner import FactoryError

TraceSource = Trace | Mapping[str, Any] | str | Path
"""A trace, its JSON document, or the path of its file."""


def as_trace(source: TraceSource) -> Trace:
    """Read ``source`` into a :class:`Trace`; raises :class:`TraceError` naming the field that is wrong."""
    if isinstance(source, Trace):
        return source
    if isinstance(source, Mapping):
        return Trace.from_dict(source)
    return read_trace(source)


def taken_by_caller(spec: Spec, source: str, target: str) -> frozenset[str]:
    """Resources a ``source → target`` transition enters with no acquire action: the caller takes them."""
    return frozenset(r for r in spec.acquires(source, target) if not spec.resources[r].acquire)


def _held(names: Collection[str]) -> str:
    return ", ".join(sorted(names)) or "nothing"


# -- what a replay returns --------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """The first place where the real trackers and drivers part from the trace."""

    index: int
    """Position of the step in ``trace.steps``."""
    label: str
    """``step 3`` (the chart's numbering) or ``begin r0 on decode``."""
    what: str
    """``state``, ``holds`` (the Tracker's ledger), ``observe`` (the driver), ``raised``, ``timeout``, ``ignore``,
    ``transition``, ``reject`` or ``violation`` (the steps matched, the violation did not show)."""
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
class StepReplay:
    """One step as replayed: what was called, and what the tracker and the driver said afterwards."""

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
class ReplayResult:
    """The whole replay: each step, the first mismatch, and whether the trace's violation showed on the real drivers."""

    trace: Trace
    system: str
    drivers: Mapping[str, str]
    """role → what drove it (the driver's class, or the built-in ledger)."""
    steps: tuple[StepReplay, ...]
    mismatch: Mismatch | None
    reproduced: bool
    summary: str
    """One sentence: ``step 4: prefill transferring while decode lacks kv_pages — reproduced on the real drivers``."""

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


# -- checking a trace against the system -------------------------------------------------


class _Channel:
    """The messages in flight per request, as the trace's sends and deliveries leave them."""

    def __init__(self) -> None:
        self.flight: Counter[tuple[str, str]] = Counter()

    def total(self) -> int:
        return self.flight.total()

    def of(self, request: str) -> int:
        return sum(n for (r, _m), n in self.flight.items() if r == request)

    def apply(self, step: Step) -> None:
        """Deliver the step's message (``message`` cause), then add what it sent and the channel kept."""
        if step.cause == "message" and step.event is not None and not step.duplicate:
            self.flight[step.request, step.event] -= 1
        for sent in step.sent:
            if not sent.lost:
                self.flight[step.request, sent.message] += 1
        self.flight = +self.flight


def check_trace(trace: Trace, system: System) -> None:
    """Raise :class:`TraceError` unless every name in ``trace`` exists in ``system`` and its steps can happen in order.

    Checks roles, requests (begun before they move), states, events (a
    message step names a message its role receives, a timeout step the event
    its state's deadline fires), sends (declared, from that role, to their
    receiver), resources, and the channel: a message is delivered only while
    in flight, and the channel never holds more than its capacity (except in
    the very step an ``overflow`` trace ends with).
    """
    roles = ", ".join(system.roles)
    for r in trace.roles:
        if r.name not in system.roles:
            raise TraceError(f"roles.{r.name}", f"{system.name} has no role {r.name!r} (its roles: {roles})")
    if trace.prop not in system.properties:
        raise TraceError(
            "property", f"{trace.prop!r} is not a property of {system.name} (it checks {', '.join(system.properties)})"
        )
    begun: set[tuple[str, str]] = set()
    channel = _Channel()
    for i, step in enumerate(trace.steps):
        at = f"steps[{i}]"
        role = system.roles.get(step.role)
        if role is None:
            raise TraceError(f"{at}.role", f"{system.name} has no role {step.role!r} (its roles: {roles})")
        spec = role.spec
        for name, state in (("to", step.target), ("from", step.source)):
            if state is not None and state not in spec.states:
                raise TraceError(
                    f"{at}.{name}", f"{step.role} has no state {state!r} (its states: {', '.join(spec.states)})"
                )
        unknown = [r for r in step.holds if r not in spec.resources]
        if unknown:
            raise TraceError(
                f"{at}.holds",
                f"{step.role} has no resource {unknown[0]!r} (it declares {', '.join(spec.resources) or 'none'})",
            )
        if step.action == "begin":
            if (step.request, step.role) in begun:
                raise TraceError(f"{at}.request", f"{step.request} is begun twice on {step.role}")
            begun.add((step.request, step.role))
        else:
            _check_move(system, step, at, begun, channel)
        channel.apply(step)
        last = i == len(trace.steps) - 1
        if channel.total() > system.channel.capacity and not (last and trace.prop == "overflow"):
            raise TraceError(
                f"{at}.sent",
                f"the channel would hold {channel.total()} messages, more than its capacity of "
                f"{system.channel.capacity} (a send that does not fit is lost, or breaks 'overflow')",
            )
    if trace.steps and all(s.request != trace.request for s in trace.steps):
        raise TraceError("request", f"no step names {trace.request!r}")


def _check_move(system: System, step: Step, at: str, begun: set[tuple[str, str]], channel: _Channel) -> None:
    """The checks of one step after the begins: request, event, cause and sends."""
    spec = system.roles[step.role].spec
    if (step.request, step.role) not in begun:
        raise TraceError(f"{at}.request", f"{step.request} was never begun on {step.role} before this step")
    assert step.event is not None  # Step.from_dict: only a begin has no event
    inbox = system.inbox(step.role)
    known = set(spec.events) | {e for rule in spec.ignore for e in rule.events}
    if step.event not in known and step.event not in inbox:
        raise TraceError(
            f"{at}.event", f"{step.role} has no event {step.event!r} (its events: {', '.join(sorted(known))})"
        )
    if step.cause == "message":
        if step.event not in inbox:
            raise TraceError(f"{at}.event", f"{step.event!r} is not a message {step.role} receives")
        if channel.flight[step.request, step.event] < 1:
            raise TraceError(
                f"{at}.event", f"delivers {step.event} to {step.role} for {step.request}, but none is in flight"
            )
    elif step.event in inbox:
        raise TraceError(
            f"{at}.cause", f"{step.event!r} is a message: it happens only when delivered (cause 'message')"
        )
    if step.cause == "timeout":
        timeout = spec.states[step.source].timeout if step.source is not None else None
        if timeout is None or timeout.fire != step.event:
            fires = f"fires {timeout.fire!r}" if timeout is not None else "has no timeout"
            raise TraceError(
                f"{at}.event", f"a timeout step in {step.source!r} fires {step.event!r}, but that state {fires}"
            )
    if step.action == "reply":
        reply = system.messages[step.event].reply_if_finished if step.event in system.messages else None
        if reply is None or [s.message for s in step.sent] != [reply]:
            raise TraceError(
                f"{at}.sent",
                f"a reply to {step.event} sends the message's reply_if_finished ({reply or 'none declared'})",
            )
        return
    for j, sent in enumerate(step.sent):
        msg = system.messages.get(sent.message)
        if msg is None or msg.sender != step.role or msg.receiver != sent.to:
            raise TraceError(
                f"{at}.sent[{j}]",
                f"{system.name} declares no message {sent.message!r} from {step.role} to {sent.to}",
            )


# -- the replay ---------------------------------------------------------------------


class _Diverged(Exception):
    """Raised inside a step to stop at its first mismatch."""

    def __init__(self, what: str, expected: str, actual: str) -> None:
        super().__init__(what)
        self.what, self.expected, self.actual = what, expected, actual


def _failures(exc: ActionError) -> str:
    return "; ".join(f"{f.action}() raised {type(f.error).__name__}: {f.error}" for f in exc.failures)


def _make(role: str, factory: DriverFactory) -> object:
    try:
        return factory()
    except Exception as exc:
        name = getattr(factory, "__qualname__", repr(factory))
        raise FactoryError(f"driver factory {name}() for role {role!r} raised {type(exc).__name__}: {exc}") from None


class Replay:
    """A trace being replayed, one step at a time: ``step()`` until it returns ``None``, then ``result()``.

    ``trackers``, ``drivers`` and ``clocks`` (per role) stay as the trace left
    them, to look at between and after steps. Roles with no factory in
    ``drivers`` get a :class:`LedgerDriver`.
    """

    def __init__(
        self,
        system: System | str | Path,
        trace: TraceSource,
        drivers: Mapping[str, DriverFactory] | None = None,
    ) -> None:
        self.system = system if isinstance(system, System) else load_system(system)
        self.trace = as_trace(trace)
        check_trace(self.trace, self.system)
        factories = dict(drivers or {})
        unknown = sorted(set(factories) - set(self.system.roles))
        if unknown:
            raise KvfsmError(
                f"no role {unknown[0]!r} in {self.system.name} for a driver; its roles are {', '.join(self.system.roles)}"
            )
        self.drivers: dict[str, object] = {}
        self.driven_by: dict[str, str] = {}
        for name, role in self.system.roles.items():
            if name in factories:
                driver = _make(name, factories[name])
                check_driver(role.spec, driver)
                _check_before_fire(role.spec, driver)
                self.driven_by[name] = type(driver).__name__
            else:
                driver = LedgerDriver(role.spec)
                self.driven_by[name] = "ledger (built in)"
            self.drivers[name] = driver
        self.clocks = {name: VirtualClock() for name in self.system.roles}
        self.trackers = {
            name: Tracker(role.spec, self.drivers[name], clock=self.clocks[name], threadsafe=False)
            for name, role in self.system.roles.items()
        }
        self._models = {name: SpecModel(role.spec) for name, role in self.system.roles.items()}
        """The spec's own view of each role: where its deadlines stand, which transition an event takes."""
        self._channel = _Channel()
        self._done: list[StepReplay] = []
        self._numbers: list[int | None] = []
        n = 0
        for s in self.trace.steps:
            n += s.action != "begin"
            self._numbers.append(n if s.action != "begin" else None)
        self._rejected = False

    @property
    def done(self) -> tuple[StepReplay, ...]:
        return tuple(self._done)

    @property
    def finished(self) -> bool:
        """Every step was replayed, or one did not match."""
        return len(self._done) == len(self.trace.steps) or any(s.mismatch for s in self._done)

    def __iter__(self) -> Iterator[StepReplay]:
        while (done := self.step()) is not None:
            yield done

    def step(self) -> StepReplay | None:
        """Replay the next step and check it; ``None`` once the replay is over."""
        if self.finished:
            return None
        index = len(self._done)
        step = self.trace.steps[index]
        number = self._numbers[index]
        label = f"step {number}" if number is not None else f"begin {step.request} on {step.role}"
        call, state, observed, mismatch = "", None, None, None
        try:
            call = self._perform(step)
            self._channel.apply(step)
            state, observed = self._check(step)
        except _Diverged as d:
            mismatch = Mismatch(index, label, d.what, d.expected, d.actual)
            state = self.trackers[step.role].state(step.request)
            try:
                observed = self._observe(step.role, step.request)
            except _Diverged:
                observed = None
        done = StepReplay(index, number, step, call, state, observed, mismatch)
        self._done.append(done)
        return done

    def run(self) -> ReplayResult:
        """Replay every step that is left and return the result."""
        for _ in self:
            pass
        return self.result()

    # -- performing a step -------------------------------------------------------

    def _perform(self, step: Step) -> str:
        """Make the step happen on the role's tracker; returns what was called."""
        role, req = step.role, step.request
        tracker, model = self.trackers[role], self._models[role]
        if step.action == "reply":
            return f"none (the server answers with {', '.join(s.message for s in step.sent)})"
        if step.action == "begin":
            given = begin_resources(model.spec)
            if given:
                self._hook(role, "before_begin", req, given)
            self._call(lambda: tracker.begin(req), step)
            model.begin(req)
            return "begin"
        event = step.event
        assert event is not None  # check_trace
        edge = model.edges.get((tracker.state(req) or "", event))
        if step.action == "fire" and edge is not None:
            given = taken_by_caller(model.spec, edge.source, edge.target)
            if given:
                self._hook(role, "before_fire", req, event, given)
        why = ""
        if step.cause == "timeout":
            polled, why = self._timeout(step, event)
            if polled:
                return polled
        ignored = tracker.counts["ignored"]
        got = self._call(lambda: tracker.fire(req, event), step)
        model.fire(req, event)
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

    def _timeout(self, step: Step, event: str) -> tuple[str, str]:
        """Let the instance's deadline pass and ``poll()``: (what was called, "") or ("", why the event is fired instead)."""
        role, req = step.role, step.request
        model, clock, tracker = self._models[role], self.clocks[role], self.trackers[role]
        mine = model.live.get(req)
        if mine is None or mine.due is None:
            return "", f"no deadline armed for {req} in {model.state(req)}"
        earlier = sorted(str(k) for k, i in model.live.items() if k != req and i.due is not None and i.due <= mine.due)
        if earlier:
            return "", f"{', '.join(earlier)} would fall due first"
        clock.now = model.now = max(clock.now, mine.due)
        fired = self._call(tracker.poll, step)
        model.poll()
        if fired != [(req, event, step.target)]:
            raise _Diverged("timeout", f"poll() fires [({req!r}, {event!r}, {step.target!r})]", f"{fired}")
        return f"poll at t={clock.now:g}", ""

    def _hook(self, role: str, name: str, *args: Any) -> None:
        hook: Callable[..., object] = getattr(self.drivers[role], name)
        try:
            hook(*args)
        except Exception as exc:
            raise _Diverged("raised", "nothing raised", f"{name}() raised {type(exc).__name__}: {exc}") from None

    def _call(self, call: Callable[[], Any], step: Step) -> Any:
        """One Tracker call; only an IllegalTransition that a reject step calls for may come out of it."""
        self._rejected = False
        try:
            return call()
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
        tracker = self.trackers[step.role]
        state = tracker.state(step.request)
        if state != step.target:
            raise _Diverged("state", repr(step.target), repr(state))
        want = set(step.holds)
        if set(tracker.held(step.request)) != want:
            raise _Diverged("holds", _held(want), f"the Tracker's ledger says {_held(tracker.held(step.request))}")
        seen = self._observe(step.role, step.request)
        if set(seen) != want:
            raise _Diverged("observe", _held(want), f"{self.driven_by[step.role]}.observe says {_held(seen)}")
        return state, seen

    def _observe(self, role: str, request: str) -> tuple[str, ...]:
        observe: Callable[[str], Collection[str]] = getattr(self.drivers[role], "observe")  # noqa: B009
        try:
            return tuple(sorted(observe(request)))
        except Exception as exc:
            raise _Diverged(
                "raised", "nothing raised", f"observe({request!r}) raised {type(exc).__name__}: {exc}"
            ) from None

    # -- the end -------------------------------------------------------------------

    def result(self) -> ReplayResult:
        """What the replay found so far: the steps, the first mismatch, and (at the end) the violation checked."""
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
        return ReplayResult(
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

    def _violation(self) -> str | None:
        """The trace's violation as it shows on the real trackers and drivers, in words; ``None`` if it does not."""
        prop, req = self.trace.prop, self.trace.request
        if prop not in BUILTINS:
            never = next(p for p in self.system.never if p.name == prop)
            met, missed = [], []
            for c in never.when:
                state = self.trackers[c.role].state(req)
                held = self._observe(c.role, req)
                if c.matches(state, held):
                    words = [str(state)] if c.states else []
                    words += [f"holds {', '.join(c.holds)}"] if c.holds else []
                    words += [f"lacks {', '.join(c.lacks)}"] if c.lacks else []
                    met.append(f"{c.role} {' and '.join(words)}")
                else:
                    missed.append(f"{c.role} is in {state} holding {_held(held)}")
            if missed:
                raise _Diverged("violation", never.describe(), "; ".join(missed))
            return " while ".join(met)
        last = self.trace.steps[-1] if self.trace.steps else None
        if prop in ("late_message", "unexpected_message"):
            if last is None or last.action != "reject":
                raise _Diverged("violation", "the trace to end with a rejected message", "another ending")
            return f"{last.event} reaches {last.role} in {last.target}: IllegalTransition"
        if prop == "overflow":
            total, cap = self._channel.total(), self.system.channel.capacity
            if total <= cap:
                raise _Diverged("violation", f"more than {cap} message(s) in flight", str(total))
            sent = ", ".join(s.message for s in last.sent) if last is not None else ""
            return f"{last.role if last else '?'} sends {sent} with {total} message(s) for a channel of capacity {cap}"
        # deadlock, leak: nothing in flight for the request, and its live instances stuck where the trace leaves them
        if self._channel.of(req):
            raise _Diverged("violation", f"nothing in flight for {req}", f"{self._channel.of(req)} message(s)")
        stuck = {
            name: state
            for name, t in self.trackers.items()
            if (state := t.state(req)) is not None and not t.spec.states[state].is_final
        }
        holding = {name: self._observe(name, req) for name in stuck}
        if not stuck or (prop == "leak" and not any(holding.values())):
            want = "a live instance holding resources" if prop == "leak" else "a live instance"
            raise _Diverged("violation", want, "none")
        where = ", ".join(f"{n} in {s} (observe: {_held(holding[n])})" for n, s in stuck.items())
        return f"nothing in flight for {req}; {where}"


def _check_before_fire(spec: Spec, driver: object) -> None:
    """A spec that enters a resource with no acquire action needs the driver's ``before_fire``."""
    given = sorted({r for e in spec.edges() for r in taken_by_caller(spec, e.source, e.target)})
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
) -> ReplayResult:
    """Replay ``trace`` on one Tracker and one driver per role (a ledger where ``drivers`` has no factory).

    >>> result = replay_trace("specs/pd_abort/merged_fix.yaml", "trace.json", {"decode": make_decode})
    >>> result.summary
    'step 4: prefill transferring while decode lacks kv_pages — reproduced on the real drivers'
    """
    return Replay(system, trace, drivers).run()


__all__ = [
    "Mismatch",
    "Replay",
    "ReplayResult",
    "StepReplay",
    "TraceError",
    "as_trace",
    "check_trace",
    "replay_trace",
    "taken_by_caller",
]
