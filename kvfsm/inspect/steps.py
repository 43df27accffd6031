"""A trace replayed into snapshots: where every instance is, what it holds and what is in flight after each move.

A kvfsm-trace/1 step says what one instance did and what that instance holds
afterwards; a reviewer stepping through it needs the whole picture at each
move (every role's state, every holding, the channel). That picture is built
here once, in Python, so the page's script only shows snapshot ``i``.
One machine's timeline (a ``kvfsm test`` story, a journal ``kvfsm replay``
checked) is told the same way by :func:`timeline`, with each key its own lane.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ..explore import Step, Trace, describe_step

K = TypeVar("K", bound=Hashable)

CHANNEL = "channel"
"""The lane of the sequence diagram that messages cross between roles."""


@dataclass(frozen=True)
class Instance:
    """One role instance of one request at one moment."""

    request: str
    role: str
    """The instance (``prefill#1`` where a role has ranks)."""
    base: str
    """The declared role it runs (the cluster it is drawn in)."""
    state: str
    holds: tuple[str, ...]
    freed: tuple[tuple[str, int], ...] = ()
    """``(resource, move)``: what it held earlier in the trace and let go of at that move (a write after it is
    a write into pages it no longer owns)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything after move ``index`` (0: after the instances began, before any move)."""

    index: int
    text: str
    """The move in words (``abort: waiting → aborted``), or what the start is."""
    request: str
    role: str | None
    """The instance that moved (None at the start)."""
    note: str
    sent: tuple[tuple[str, str, bool], ...]
    """``(message, to, lost)`` per message the move sent."""
    delivered: str | None
    """The message this move took off the channel, if any."""
    instances: tuple[Instance, ...]
    in_flight: dict[str, tuple[str, ...]]
    """Per request, the messages in flight."""
    violation: bool
    """The property is broken here (the last move of a safety trace; the cycle's start and end of a lasso); never in
    a trace that names no violation (a trace set's)."""
    in_cycle: bool
    problem: str = ""
    """What broke at this move, when it is not the trace's one violation (a story's divergence, a log's finding)."""

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as the page's script reads it (JSON-ready)."""
        return {
            "index": self.index,
            "text": self.text,
            "request": self.request,
            "role": self.role,
            "note": self.note,
            "sent": [{"message": m, "to": to, "lost": lost} for m, to, lost in self.sent],
            "delivered": self.delivered,
            "instances": [
                {
                    "request": i.request,
                    "role": i.role,
                    "base": i.base,
                    "state": i.state,
                    "holds": list(i.holds),
                    "freed": [[r, at] for r, at in i.freed],
                }
                for i in self.instances
            ],
            "in_flight": {req: list(msgs) for req, msgs in self.in_flight.items()},
            "violation": self.violation,
            "in_cycle": self.in_cycle,
            "problem": self.problem,
        }


def base_role(instance: str, roles: set[str] | frozenset[str] | None = None) -> str:
    """The declared role of an instance: ``prefill#1`` → ``prefill`` (unless a role is really named so)."""
    if roles is not None and instance in roles:
        return instance
    return instance.rsplit("#", 1)[0] if "#" in instance else instance


def lanes(trace: Trace) -> list[str]:
    """The instances in the order the trace declares its roles (then any a step names that it does not)."""
    out = [r.name for r in trace.roles]
    for s in trace.steps:
        if s.role not in out:
            out.append(s.role)
    return out


def snapshots(trace: Trace, roles: set[str] | frozenset[str] | None = None) -> list[Snapshot]:
    """One snapshot for the start and one per move; ``roles`` are the system's declared roles (for ``base``)."""
    where: dict[tuple[str, str], tuple[str, tuple[str, ...]]] = {}
    freed: dict[tuple[str, str], dict[str, int]] = {}
    flight: dict[str, tuple[str, ...]] = {}
    moves: list[Step] = []
    for s in trace.steps:
        if s.action == "begin":
            where[(s.request, s.role)] = (s.target, s.holds)
            flight.setdefault(s.request, ())
        else:
            moves.append(s)
    order = lanes(trace)

    def instances() -> tuple[Instance, ...]:
        keys = sorted(where, key=lambda k: (k[0], order.index(k[1]) if k[1] in order else len(order)))
        return tuple(
            Instance(k[0], k[1], base_role(k[1], roles), *where[k], tuple(freed.get(k, {}).items())) for k in keys
        )

    last = len(moves)
    breaks = bool(trace.violation)  # a trace set's traces break nothing: no move of theirs is marked
    start = Snapshot(
        0,
        "the instances begin",
        trace.request,
        None,
        "",
        (),
        None,
        instances(),
        dict(flight),
        breaks and last == 0,
        False,
    )
    out = [start]
    for i, s in enumerate(moves, start=1):
        _move(where, freed, (s.request, s.role), s.target, s.holds, i)
        flight[s.request] = s.in_flight
        in_cycle = trace.loop is not None and i > trace.loop
        broken = breaks and (i == last if trace.loop is None else (i == trace.loop or i == last))
        text = describe_step(s) + (" (a copy stays in flight)" if s.duplicate else "")
        sent = tuple((x.message, x.to, x.lost) for x in s.sent)
        delivered = s.event if s.cause == "message" else None
        out.append(
            Snapshot(i, text, s.request, s.role, s.note, sent, delivered, instances(), dict(flight), broken, in_cycle)
        )
    if (
        breaks and trace.loop is not None and trace.loop == 0
    ):  # a lasso whose cycle starts at once: the start is where it breaks
        out[0] = replace(out[0], violation=True)
    return out


def _move(
    where: dict[K, tuple[str, tuple[str, ...]]],
    freed: dict[K, dict[str, int]],
    key: K,
    target: str,
    holds: tuple[str, ...],
    at: int,
) -> None:
    """Put ``key`` in ``target`` holding ``holds`` at move ``at``: what it held before and not now is freed there,
    what it holds again is no longer freed."""
    let_go = freed.setdefault(key, {})
    for resource in where[key][1] if key in where else ():
        if resource not in holds:
            let_go[resource] = at
    for resource in holds:
        let_go.pop(resource, None)
    where[key] = (target, holds)


@dataclass(frozen=True)
class Moved:
    """One transition of one instance of a single machine (``source`` is ``""`` for begin)."""

    key: str
    event: str
    source: str
    target: str

    def __str__(self) -> str:
        return f"begin → {self.target}" if not self.source else f"{self.event}: {self.source} → {self.target}"


@dataclass(frozen=True)
class Moment:
    """One moment of a single machine's timeline: what happened in words, the transitions it made, what broke there."""

    text: str
    moves: tuple[Moved, ...] = ()
    problem: str = ""


def timeline(moments: Sequence[Moment], holds: Callable[[str], tuple[str, ...]]) -> list[Snapshot]:
    """One snapshot for the start (nothing begun) and one per moment; each key is its own instance and lane.

    ``holds`` says what a state holds (the spec's promise, which a story's
    divergence or a log's finding is read against).
    """
    where: dict[str, tuple[str, tuple[str, ...]]] = {}
    freed: dict[str, dict[str, int]] = {}

    def instances() -> tuple[Instance, ...]:
        return tuple(Instance(k, k, "", *where[k], tuple(freed.get(k, {}).items())) for k in where)

    out = [Snapshot(0, "nothing has begun", "", None, "", (), None, (), {}, False, False)]
    for i, moment in enumerate(moments, start=1):
        for m in moment.moves:
            if not m.source:  # a new instance of the key: what the old one held and freed is history
                where.pop(m.key, None)
                freed.pop(m.key, None)
            _move(where, freed, m.key, m.target, holds(m.target), i)
        key = moment.moves[0].key if moment.moves else ""
        problem = moment.problem
        out.append(Snapshot(i, moment.text, key, key, "", (), None, instances(), {}, bool(problem), False, problem))
    return out
