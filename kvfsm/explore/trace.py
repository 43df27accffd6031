"""Counterexample traces: the steps from the start to a violation, as JSON and as a message-sequence chart.

The JSON form (``format: kvfsm-trace/1``, documented in docs/pd_abort.md) is
what a replayer drives real trackers and drivers with: every step names the
request (the instance key on every role), the role, the event and the state
it must lead to, the resources the role must hold afterwards, and the
messages sent with their fate.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..errors import KvfsmError

FORMAT = "kvfsm-trace/1"

ACTIONS = ("begin", "fire", "ignore", "reply", "reject")
"""begin: the instance starts; fire: a transition; ignore: a legal no-op;
reply: a finished instance's server answers without moving it; reject: the
event is neither handled nor ignored (the violating step of a message property)."""

CAUSES = ("begin", "local", "timeout", "abort", "error", "message")


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
    """The shortest run from the initial state to a violation of ``prop``."""

    system: str
    path: str
    prop: str
    violation: str
    """What is wrong at the end, in one sentence."""
    request: str
    """The request that breaks the property."""
    roles: tuple[TraceRole, ...]
    steps: tuple[Step, ...]

    @property
    def moves(self) -> tuple[Step, ...]:
        """The steps after the instances began."""
        return tuple(s for s in self.steps if s.action != "begin")

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
        )


def read_trace(path: str | Path) -> Trace:
    """Read a kvfsm-trace/1 JSON file (as ``kvfsm explore --trace`` writes); raises :class:`TraceError`."""
    shown = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError("", "no such trace file; write one with 'kvfsm explore SYSTEM --trace FILE'", shown) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError("", f"cannot read the trace file: {exc}", shown) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {exc.lineno} column {exc.colno}", f"not JSON: {exc.msg}", shown) from None
    try:
        return Trace.from_dict(doc)
    except TraceError as exc:
        raise TraceError(exc.field, exc.problem, shown) from None


# -- the message-sequence chart ------------------------------------------------------

LANE = 40


def describe_step(step: Step) -> str:
    """What one step does, in words: ``abort: waiting → aborted``, ``metadata arrives: ignored in failed``."""
    moved = f"{step.source} → {step.target}" if step.source != step.target else f"stays in {step.target}"
    if step.action == "fire":
        why = {"timeout": " (timeout)", "abort": "", "error": " (an action raised)", "message": " arrives"}.get(
            step.cause, ""
        )
        return f"{step.event}{why}: {moved}"
    if step.action == "ignore":
        return f"{step.event} arrives: ignored in {step.target}"
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
    out = [f"{trace.prop}: {trace.violation}", f"shortest trace: {len(trace.moves)} steps ({trace.system})", ""]
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
        number += 1
        lane = lanes.index(step.role)
        text = describe_step(step)
        out.append(f"{number:>3}  {step.request:<5}" + " " * (LANE * lane) + text)
        extra = [x for x in (step.note, "a copy stays in flight" if step.duplicate else "") if x]
        for e in extra:
            out.append(pad + " " * (LANE * lane) + f"  ({e})")
        for sent in step.sent:
            out.append(pad + _arrow(lanes, step.role, sent))
    out.append("")
    out.append(f"  ✗ {trace.prop} ({trace.request}): {trace.violation}")
    return "\n".join(out)
