"""Counterexample traces: the steps from the start to a violation, as JSON and as a message-sequence chart.

The JSON form (``format: kvfsm-trace/1``, documented in docs/pd_abort.md) is
what a replayer drives real trackers and drivers with: every step names the
request (the instance key on every role), the role, the event and the state
it must lead to, the resources the role must hold afterwards, and the
messages sent with their fate. Reading one checks it field by field
(:meth:`Trace.from_dict`, :func:`read_trace`); :func:`check_trace` checks it
against a system: every name exists and the steps can happen in that order.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import KvfsmError
from ..spec.loader import InputError, read_input
from ..spec.system import System
from ..spec.system.channel import Traffic
from ..spec.system.model import CRASH, CRASHED
from .clocks import Clocks
from .entry import entering
from .limits import check_sizes

FORMAT = "kvfsm-trace/1"

ACTIONS = ("begin", "fire", "ignore", "count", "reply", "reject")
"""begin: the instance starts; fire: a transition; ignore: a legal no-op; count: a
counted message remembered until the last sender rank's copy fires the transition;
reply: a finished instance's server answers without moving it; reject: the
event is neither handled nor ignored (the violating step of a message property)."""

CAUSES = ("begin", "local", "timeout", "abort", "error", "environment", "crash", "message", "owner")


class TraceError(KvfsmError, ValueError):
    """A document that is not a usable kvfsm-trace/1 trace; ``field`` names the offending field (``steps[3].event``)."""

    def __init__(self, field: str, problem: str, source: str = "") -> None:
        self.field, self.problem, self.source = field, problem, source
        super().__init__(": ".join(part for part in (source, field, problem) if part))


T = TypeVar("T")


def _field(d: Mapping[str, Any], name: str, at: str, kind: type[T], *, default: T | None = None) -> T:
    """``d[name]`` checked to be a ``kind``; missing is an error unless a ``default`` is given."""
    where = f"{at}.{name}" if at else name
    if name not in d:
        if default is not None:
            return default
        raise TraceError(where, f"missing (a {FORMAT} trace gives every step its {name!r})" if at else "missing")
    value = d[name]
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise TraceError(where, f"must be {_KINDS.get(kind, kind.__name__)}, not {type(value).__name__} {value!r}")
    return value


def _optional_str(d: Mapping[str, Any], name: str, at: str) -> str | None:
    """A string or null; a missing one is null."""
    value = d.get(name)
    if value is not None and not isinstance(value, str):
        raise TraceError(f"{at}.{name}", f"must be a string or null, not {type(value).__name__} {value!r}")
    return value


def _names(d: Mapping[str, Any], name: str, at: str, *, required: bool) -> tuple[str, ...]:
    values = _field(d, name, at, list, default=None if required else [])
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TraceError(f"{at}.{name}[{i}]", f"must be a name (a string), not {type(v).__name__} {v!r}")
    return tuple(values)


def _mapping(value: Any, at: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TraceError(at, f"must be an object, not {type(value).__name__}")
    return value


_KINDS: dict[type, str] = {str: "a string", bool: "true or false", list: "a list", dict: "an object"}


@dataclass(frozen=True, slots=True)
class Sent:
    """A message sent by a step, and whether the channel lost it."""

    message: str
    to: str
    lost: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """One thing that happened to one role's instance of one request."""

    request: str
    role: str
    action: str
    cause: str
    event: str | None
    source: str | None
    target: str
    sent: tuple[Sent, ...] = ()
    duplicate: bool = False
    """A delivered message that the channel also left in flight (it may arrive again)."""
    holds: tuple[str, ...] = ()
    """What the role's instance holds after the step."""
    in_flight: tuple[str, ...] = ()
    """The request's messages in flight after the step."""
    note: str = ""
    """Resources taken and freed, in words."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "role": self.role,
            "action": self.action,
            "cause": self.cause,
            "event": self.event,
            "from": self.source,
            "to": self.target,
            "sent": [{"message": s.message, "to": s.to, "lost": s.lost} for s in self.sent],
            "duplicate": self.duplicate,
            "holds": list(self.holds),
            "in_flight": list(self.in_flight),
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], at: str = "step") -> Step:
        """Read one step; raises :class:`TraceError` naming the field (``at`` is where the step sits)."""
        d = _mapping(d, at)
        action = _field(d, "action", at, str)
        if action not in ACTIONS:
            raise TraceError(f"{at}.action", f"{action!r} is not one of {', '.join(ACTIONS)}")
        cause = _field(d, "cause", at, str)
        if cause not in CAUSES:
            raise TraceError(f"{at}.cause", f"{cause!r} is not one of {', '.join(CAUSES)}")
        if "event" not in d:
            raise TraceError(f"{at}.event", "missing (null for a begin step)")
        event = _optional_str(d, "event", at)
        if event is None and action != "begin":
            raise TraceError(f"{at}.event", f"a {action} step names the event it fires")
        source = _optional_str(d, "from", at)
        if source is None and action != "begin":
            raise TraceError(f"{at}.from", f"a {action} step names the state it starts from")
        sent = []
        for i, item in enumerate(_field(d, "sent", at, list, default=[])):
            here = f"{at}.sent[{i}]"
            m = _mapping(item, here)
            sent.append(
                Sent(
                    _field(m, "message", here, str),
                    _field(m, "to", here, str),
                    _field(m, "lost", here, bool, default=False),
                )
            )
        return cls(
            request=_field(d, "request", at, str),
            role=_field(d, "role", at, str),
            action=action,
            cause=cause,
            event=event,
            source=source,
            target=_field(d, "to", at, str),
            sent=tuple(sent),
            duplicate=_field(d, "duplicate", at, bool, default=False),
            holds=_names(d, "holds", at, required=True),
            in_flight=_names(d, "in_flight", at, required=False),
            note=_field(d, "note", at, str, default=""),
        )


@dataclass(frozen=True, slots=True)
class TraceRole:
    """Where a role's machine comes from, so a replayer can build its tracker."""

    name: str
    spec: str
    machine: str
    key: str


@dataclass(frozen=True)
class Trace:
    """The shortest run from the initial state to a violation of ``prop``, or a lasso for an ``eventually``.

    A lasso (``loop`` set) is an infinite run: the moves up to ``loop`` once,
    then the moves from ``loop`` on, repeated forever. ``loop`` equal to the
    number of moves means the run stays where the moves left it, forever.
    """

    system: str
    path: str
    prop: str
    violation: str
    """What is wrong at the end, in one sentence."""
    request: str
    """The request that breaks the property."""
    roles: tuple[TraceRole, ...]
    steps: tuple[Step, ...]
    loop: int | None = None
    """For a lasso: the index (among :attr:`moves`) of the first move of the cycle."""

    @property
    def moves(self) -> tuple[Step, ...]:
        """The steps after the instances began."""
        return tuple(s for s in self.steps if s.action != "begin")

    @property
    def cycle(self) -> tuple[Step, ...]:
        """The moves repeated forever (a lasso only; empty when the run stays put)."""
        return self.moves[self.loop :] if self.loop is not None else ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "system": self.system,
            "path": self.path,
            "property": self.prop,
            "violation": self.violation,
            "request": self.request,
            "roles": {r.name: {"spec": r.spec, "machine": r.machine, "key": r.key} for r in self.roles},
            "steps": [s.as_dict() for s in self.steps],
            **({"loop": self.loop} if self.loop is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trace:
        """Read a trace written by :meth:`as_dict`; raises :class:`TraceError` (a ``ValueError``) naming the field."""
        d = _mapping(d, "the trace")
        if d.get("format") != FORMAT:
            raise TraceError("format", f"not a {FORMAT} trace (format is {d.get('format')!r})")
        roles = []
        for name, r in _field(d, "roles", "", dict).items():
            at = f"roles.{name}"
            r = _mapping(r, at)
            roles.append(
                TraceRole(name, _field(r, "spec", at, str), _field(r, "machine", at, str), _field(r, "key", at, str))
            )
        return cls(
            system=_field(d, "system", "", str),
            path=_field(d, "path", "", str),
            prop=_field(d, "property", "", str),
            violation=_field(d, "violation", "", str),
            request=_field(d, "request", "", str),
            roles=tuple(roles),
            steps=tuple(Step.from_dict(s, f"steps[{i}]") for i, s in enumerate(_field(d, "steps", "", list))),
            loop=_loop(d),
        )


def _loop(d: Mapping[str, Any]) -> int | None:
    """The lasso's ``loop`` field: absent for a finite trace, else a move index."""
    if "loop" not in d:
        return None
    loop = d["loop"]
    if not isinstance(loop, int) or isinstance(loop, bool) or loop < 0:
        raise TraceError("loop", f"must be the index of the cycle's first move (0 or more), not {loop!r}")
    moves = sum(1 for s in d.get("steps", ()) if isinstance(s, Mapping) and s.get("action") != "begin")
    if loop > moves:
        raise TraceError("loop", f"the cycle starts at move {loop}, but the trace has {moves} moves")
    return loop


MAX_TRACE_BYTES = 4 << 20
"""Largest trace file read (4 MiB): a shortest counterexample is a few KiB; the bound keeps a wrong
path (a device, a log) from being read whole."""


def read_trace(path: str | Path) -> Trace:
    """Read a kvfsm-trace/1 JSON file (as ``kvfsm explore --trace`` writes); raises :class:`TraceError`.

    The file is read with a bound (:data:`MAX_TRACE_BYTES`); a device, a FIFO
    or a folder is refused before it is read.
    """
    shown = str(path)
    try:
        text = read_input(path, what="trace file", limit=MAX_TRACE_BYTES)
    except InputError as exc:
        if exc.problem.startswith("no such"):
            raise TraceError(
                "", "no such trace file; write one with 'kvfsm explore SYSTEM --trace FILE'", shown
            ) from None
        raise TraceError("", f"{exc.problem}; {exc.fix}", shown) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {exc.lineno} column {exc.colno}", f"not JSON: {exc.msg}", shown) from None
    except RecursionError:
        raise TraceError("", "not a trace: its JSON is nested too deeply to read", shown) from None
    try:
        return Trace.from_dict(doc)
    except TraceError as exc:
        raise TraceError(exc.field, exc.problem, shown) from None


TraceSource = Trace | Mapping[str, Any] | str | Path
"""A trace, its JSON document, or the path of its file."""


def as_trace(source: TraceSource) -> Trace:
    """Read ``source`` into a :class:`Trace`; raises :class:`TraceError` naming the field that is wrong."""
    if isinstance(source, Trace):
        return source
    if isinstance(source, Mapping):
        return Trace.from_dict(source)
    return read_trace(source)


# -- checking a trace against the system it claims to be of ---------------------------


def check_trace(trace: Trace, system: System) -> None:
    """Raise :class:`TraceError` unless every name in ``trace`` exists in ``system`` and its steps can happen in order.

    Checks roles, requests (begun before they move), states, events (a
    message step names a message its role receives, a timeout step the event
    a deadline armed in its state fires: the state's own or a phase's), sends (declared, from that role, to their
    receiver), resources, and the channel (:mod:`kvfsm.spec.system.channel`):
    a message is delivered only while it may arrive, lost or duplicated only
    where the channel may do so, and the channel never holds more than its
    capacity (except in the very step an ``overflow`` trace ends with); a
    timeout fires only in an order the system's relations allow; a lasso's
    cycle ends where it began. A system too big to explore is refused first
    (:class:`~kvfsm.explore.limits.ExploreError`), before its ranks are expanded.
    """
    check_sizes(system, 1)
    system = system.expanded()
    roles = ", ".join(system.roles)
    for r in trace.roles:
        if r.name not in system.roles:
            raise TraceError(f"roles.{r.name}", f"{system.name} has no role {r.name!r} (its roles: {roles})")
    if trace.prop not in system.names:
        raise TraceError(
            "property", f"{trace.prop!r} is not a property of {system.name} (it checks {', '.join(system.names)})"
        )
    begun: set[tuple[str, str]] = set()
    traffic = Traffic(system.wire)
    timing = _Timing(system)
    where: dict[tuple[str, str], str] = {}
    moves = 0
    mark: tuple[dict[tuple[str, str], str], dict[str, tuple[int, ...]]] | None = None
    for i, step in enumerate(trace.steps):
        at = f"steps[{i}]"
        if step.action != "begin":
            if moves == trace.loop:
                mark = (dict(where), {k: f for k, f in traffic.flights.items() if f})
            moves += 1
        where[(step.request, step.role)] = step.target
        role = system.roles.get(step.role)
        if role is None:
            raise TraceError(f"{at}.role", f"{system.name} has no role {step.role!r} (its roles: {roles})")
        spec = role.spec
        for name, state in (("to", step.target), ("from", step.source)):
            if state is not None and state not in spec.states and not (role.crash and state == CRASHED):
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
            _check_move(system, step, at, begun)
            timing.step(step, at)
        carry(traffic, step, at)
        last = i == len(trace.steps) - 1
        if traffic.total() > system.channel.capacity and not (last and trace.prop == "overflow"):
            raise TraceError(
                f"{at}.sent",
                f"the channel would hold {traffic.total()} messages, more than its capacity of "
                f"{system.channel.capacity} (a send that does not fit is lost, or breaks 'overflow')",
            )
    if trace.steps and all(s.request != trace.request for s in trace.steps):
        raise TraceError("request", f"no step names {trace.request!r}")
    if trace.loop is not None and trace.loop < moves:
        assert mark is not None  # set when the move numbered ``loop`` was read
        if mark != (where, {k: f for k, f in traffic.flights.items() if f}):
            raise TraceError("loop", f"the cycle from move {trace.loop} does not end where it began")


class _Timing:
    """The system's timeout relations over a trace: a timeout step only when no shorter deadline is due first."""

    def __init__(self, system: System) -> None:
        self.names = list(system.roles)
        self.specs = [r.spec for r in system.roles.values()]
        self.order = [[*r.spec.states, *([CRASHED] if r.crash else [])] for r in system.roles.values()]
        self.start = [
            self.order[k].index(self._landing(k, r.spec.initial.name)[-1]) for k, r in enumerate(system.roles.values())
        ]
        self.clocks = Clocks(system, self.order)
        self.at: dict[str, tuple[list[int], int]] = {}
        """request → (state index per role, deadline order bits)."""

    def step(self, step: Step, at: str) -> None:
        """Check ``step`` against the deadline order, then apply it (see :mod:`kvfsm.explore.clocks`)."""
        if not self.clocks:
            return
        states, bits = self.at.get(step.request, (list(self.start), self.clocks.initial(self.start)))
        r = self.names.index(step.role)
        if step.cause == "timeout" and step.event is not None and self.clocks.blocked(bits, states, r, step.event):
            raise TraceError(
                f"{at}.cause",
                f"{step.role}'s timeout cannot fire yet: the relations make a deadline armed no later fall due first",
            )
        if step.action == "fire":
            source = states[r]
            for state in self._path(r, step):
                states = [*states[:r], self.order[r].index(state), *states[r + 1 :]]
                bits = self.clocks.fired(bits, r, source, states)
                source = states[r]
        self.at[step.request] = (states, bits)

    def _landing(self, r: int, state: str) -> list[str]:
        """``state``, then each state a count of 0 on entry moves the instance on to at once (:mod:`.entry`)."""
        return [state, *(e.target for e in entering(self.specs[r], state))]

    def _path(self, r: int, step: Step) -> list[str]:
        """The states a fired step enters in turn: its target, or, where the transition's own target counts to 0
        on entry and goes on at once to the step's target, each state on the way."""
        spec = self.specs[r]
        edge = spec.table.get((step.source or "", step.event or ""))
        if edge is not None and edge.target != edge.source:
            way = self._landing(r, edge.target)
            if len(way) > 1 and way[-1] == step.target:
                return way
        return [step.target]


def carry(traffic: Traffic, step: Step, at: str = "step") -> None:
    """What ``step`` does to the messages in flight: its delivery first, then what it sent and the channel kept.

    Raises :class:`TraceError` for a delivery of a message that may not
    arrive now, and for a loss or a duplicate the channel does not allow.
    """
    channel = traffic.wire.channel
    if step.cause == "message" and step.event is not None:
        if step.duplicate and not channel.duplicate:
            raise TraceError(f"{at}.duplicate", "the channel does not duplicate messages (channel: duplicate: false)")
        if not traffic.deliver(step.request, step.event, duplicate=step.duplicate):
            raise TraceError(
                f"{at}.event", f"delivers {step.event} to {step.role} for {step.request}, but none is in flight"
            )
    for j, sent in enumerate(step.sent):
        if sent.lost and not channel.loss:
            raise TraceError(f"{at}.sent[{j}].lost", "the channel does not lose messages (channel: loss: false)")
        if not sent.lost:
            traffic.send(step.request, sent.message)


def _check_move(system: System, step: Step, at: str, begun: set[tuple[str, str]]) -> None:
    """The checks of one step after the begins: request, event, cause and sends."""
    spec = system.roles[step.role].spec
    if (step.request, step.role) not in begun:
        raise TraceError(f"{at}.request", f"{step.request} was never begun on {step.role} before this step")
    assert step.event is not None  # Step.from_dict: only a begin has no event
    inbox = system.inbox(step.role)
    known = set(spec.events) | {e for rule in spec.ignore for e in rule.events}
    if system.roles[step.role].crash:
        known.add(CRASH)
    if step.event not in known and step.event not in inbox:
        raise TraceError(
            f"{at}.event", f"{step.role} has no event {step.event!r} (its events: {', '.join(sorted(known))})"
        )
    by_engine = step.event in spec.owned_events or step.event in _forwarded(system, spec.name)
    if step.cause == "owner" and not by_engine:
        raise TraceError(
            f"{at}.cause", f"the engine fires {step.event!r} on {step.role} for no family (owns:) of {system.name}"
        )
    if step.cause != "owner" and step.event in spec.owned_events:
        raise TraceError(f"{at}.cause", f"{step.event!r} is fired by the engine for {step.role}'s children (cause 'owner')")
    if step.cause == "message":
        if step.event not in inbox:
            raise TraceError(f"{at}.event", f"{step.event!r} is not a message {step.role} receives")
    elif step.event in inbox and step.cause != "owner":
        raise TraceError(
            f"{at}.cause", f"{step.event!r} is a message: it happens only when delivered (cause 'message')"
        )
    if step.cause == "timeout":
        armed = spec.timeouts(step.source) if step.source is not None else ()
        if not any(t.fire == step.event for t in armed):
            fires = (
                f"'s deadlines (its own timeout's, its phases') fire {' or '.join(sorted({repr(t.fire) for t in armed}))}"
                if armed
                else " has no timeout and is in no phase"
            )
            raise TraceError(
                f"{at}.event", f"a timeout step in {step.source!r} fires {step.event!r}, but that state{fires}"
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


def _forwarded(system: System, machine: str) -> frozenset[str]:
    """The events a parent's ``owns:`` passes on to instances of ``machine`` in ``system``."""
    return frozenset(
        e for r in system.roles.values() for o in r.spec.owns.values() if o.machine == machine for e in o.forward
    )


# -- the message-sequence chart ------------------------------------------------------

LANE = 40


def describe_step(step: Step) -> str:
    """What one step does, in words: ``abort: waiting → aborted``, ``metadata arrives: ignored in failed``."""
    moved = f"{step.source} → {step.target}" if step.source != step.target else f"stays in {step.target}"
    if step.action == "fire":
        why = {
            "timeout": " (timeout)",
            "abort": "",
            "error": " (an action raised)",
            "environment": " (from outside the system)",
            "crash": " (the process died; what it held is lost)",
            "message": " arrives",
            "owner": " (the engine, for the family)",
        }.get(step.cause, "")
        return f"{step.event}{why}: {moved}"
    if step.action == "ignore":
        return f"{step.event} arrives: ignored in {step.target}"
    if step.action == "count":
        return f"{step.event} arrives: counted in {step.target}, not yet every sender"
    if step.action == "reply":
        return f"{step.event} arrives: finished, the server answers"
    return f"{step.event} arrives: REJECTED in {step.target}"


def _arrow(lanes: list[str], sender: str, sent: Sent) -> str:
    """A line with an arrow from the sender's lane to the receiver's; a lost message ends in ╳."""
    a = lanes.index(sender) * LANE + 1
    b = lanes.index(sent.to) * LANE + 1 if sent.to in lanes else a + LANE
    lo, hi = min(a, b), max(a, b)
    label = f" {sent.message} "
    n = max(hi - lo - 1, len(label) + 4)
    left = (n - len(label)) // 2
    shaft = "─" * left + label + "─" * (n - left - len(label))
    if b > a:
        return " " * lo + shaft + ("╳ lost" if sent.lost else "▶")
    tip = "lost ╳" if sent.lost else "◀"
    return " " * max(lo - len(tip) + 1, 0) + tip + shaft


def format_trace(trace: Trace) -> str:
    """The trace as a message-sequence chart: one lane per role, arrows for messages, the violation last."""
    lanes = [r.name for r in trace.roles]
    width = LANE * len(lanes)
    head = "  #  req  "
    pad = " " * len(head)
    if trace.loop is None:
        size = f"shortest trace: {len(trace.moves)} steps"
    else:
        size = f"lasso: {trace.loop} steps, then {len(trace.cycle) or 'no'} steps repeated forever"
    out = [f"{trace.prop}: {trace.violation}", f"{size} ({trace.system})", ""]
    out.append(head + "".join(name.ljust(LANE) for name in lanes).rstrip())
    out.append(" " * len(head) + "─" * (width - 2))
    begun: dict[str, dict[str, str]] = {}
    for step in trace.steps:
        if step.action == "begin":
            begun.setdefault(step.request, {})[step.role] = step.target
    for req, roles in begun.items():
        cells = [roles.get(name, "") for name in lanes]
        out.append(f"     {req:<5}" + "".join(c.ljust(LANE) for c in cells).rstrip())
    number = 0
    for step in trace.steps:
        if step.action == "begin":
            continue
        if number == trace.loop:
            out.append(f"     ↻ {'─' * 8} from here on, forever {'─' * 8}")
        number += 1
        lane = lanes.index(step.role)
        text = describe_step(step)
        out.append(f"{number:>3}  {step.request:<5}" + " " * (LANE * lane) + text)
        extra = [x for x in (step.note, "a copy stays in flight" if step.duplicate else "") if x]
        for e in extra:
            out.append(pad + " " * (LANE * lane) + f"  ({e})")
        for sent in step.sent:
            out.append(pad + _arrow(lanes, step.role, sent))
    if trace.loop is not None:
        out.append(
            f"     ↻ {'─' * 8} back to move {trace.loop + 1}, forever {'─' * 8}"
            if trace.cycle
            else f"     ↻ {'─' * 8} nothing more happens, forever (nothing is owed) {'─' * 8}"
        )
    out.append("")
    out.append(f"  ✗ {trace.prop} ({trace.request}): {trace.violation}")
    return "\n".join(out)
