"""Counterexample traces: the steps from the start to a violation, as JSON and as a message-sequence chart.

The JSON form (``format: kvfsm-trace/1``, documented in docs/pd_abort.md) is
what a replayer drives real trackers and drivers with: every step names the
request (the instance key on every role), the role, the event and the state
it must lead to, the resources the role must hold afterwards, and the
messages sent with their fate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FORMAT = "kvfsm-trace/1"

ACTIONS = ("begin", "fire", "ignore", "reply", "reject")
"""begin: the instance starts; fire: a transition; ignore: a legal no-op;
reply: a finished instance's server answers without moving it; reject: the
event is neither handled nor ignored (the violating step of a message property)."""

CAUSES = ("begin", "local", "timeout", "abort", "error", "message")


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
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        return cls(
            request=d["request"],
            role=d["role"],
            action=d["action"],
            cause=d["cause"],
            event=d.get("event"),
            source=d.get("from"),
            target=d["to"],
            sent=tuple(Sent(s["message"], s["to"], bool(s.get("lost", False))) for s in d.get("sent", ())),
            duplicate=bool(d.get("duplicate", False)),
            holds=tuple(d.get("holds", ())),
            in_flight=tuple(d.get("in_flight", ())),
            note=str(d.get("note", "")),
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
        """Read a trace written by :meth:`as_dict`; raises ``ValueError`` on another format."""
        if d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} trace (format is {d.get('format')!r})")
        return cls(
            system=d["system"],
            path=d["path"],
            prop=d["property"],
            violation=d["violation"],
            request=d["request"],
            roles=tuple(TraceRole(n, r["spec"], r["machine"], r["key"]) for n, r in d["roles"].items()),
            steps=tuple(Step.from_dict(s) for s in d["steps"]),
        )


# -- the message-sequence chart ------------------------------------------------------

LANE = 40


def _describe(step: Step) -> str:
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
        text = _describe(step)
        out.append(f"{number:>3}  {step.request:<5}" + " " * (LANE * lane) + text)
        extra = [x for x in (step.note, "a copy stays in flight" if step.duplicate else "") if x]
        for e in extra:
            out.append(pad + " " * (LANE * lane) + f"  ({e})")
        for sent in step.sent:
            out.append(pad + _arrow(lanes, step.role, sent))
    out.append("")
    out.append(f"  ✗ {trace.prop} ({trace.request}): {trace.violation}")
    return "\n".join(out)
