"""What each property means: one evaluator of every property against a snapshot of one request.

The explorer builds a :class:`Snapshot` from each local state and move of
its model; trace replay builds one from real Trackers (state names), drivers
(``observe``) and the trace's messages in flight. Both ask :func:`violation`,
so a property's meaning, and the sentence that says how it is broken, are
written here only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass

from .model import Property, System


@dataclass(frozen=True, slots=True)
class LastStep:
    """The step that led to a snapshot, as the step properties see it."""

    role: str
    event: str
    rejected: bool = False
    """A delivered message that the role's instance neither handles nor ignores (the Tracker raises)."""
    sent: tuple[str, ...] = ()
    """The messages the step sent that the channel kept."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One request as the properties see it: each role's instance, its messages in flight, and the channel's load."""

    states: Mapping[str, str | None]
    """role → the state of the request's instance; ``None`` when it has none (never begun, or retired)."""
    held: Mapping[str, Collection[str]]
    """role → what the instance holds: the spec's ``holds`` in the explorer, the driver's ``observe`` in a replay."""
    in_flight: int = 0
    """The request's own messages in flight."""
    load: int = 0
    """Messages in flight, all requests together, after ``last``."""
    last: LastStep | None = None


def violation(system: System, prop: Property, snap: Snapshot) -> str | None:
    """How ``snap`` breaks ``prop``, in one sentence; ``None`` when it keeps it.

    - ``never``: every condition holds of the request's instances at once;
    - ``late_message`` / ``unexpected_message``: the last step delivered a
      message that a finished / a live instance neither handles nor ignores;
    - ``overflow``: the last step's sends leave more in flight than the
      channel holds, and it may not lose them;
    - ``deadlock`` / ``leak``: nothing is in flight for the request, no role can
      move on by local work, and some instance is live: ``leak`` when a stuck
      instance holds something, ``deadlock`` when none does.
    """
    kind = prop.kind
    if prop.liveness:
        return None  # no single state or step breaks an ``eventually``: kvfsm.explore.liveness finds its lassos
    if kind == "never":
        met = []
        for c in prop.when:
            for inst in system.instances_of(c.role):  # with ranks: one instance meeting it is enough
                state = snap.states.get(inst)
                if state is not None and c.matches(state, snap.held.get(inst, ())):
                    met.append(c.describe(state).replace(c.role, inst, 1))
                    break
            else:
                return None
        return " while ".join(met)
    last = snap.last
    if kind in ("late_message", "unexpected_message"):
        if last is None or not last.rejected:
            return None
        state = snap.states.get(last.role)
        if state is None:
            return None
        finished = system.finished(last.role, state)
        if kind == "late_message" and finished:
            return f"{last.event} reaches {last.role} after it finished in {state}, which does not ignore it"
        if kind == "unexpected_message" and not finished:
            return f"{last.event} reaches {last.role} in {state}, which neither handles nor ignores it"
        return None
    if kind == "overflow":
        if last is None or not last.sent or not system.channel.overflows(snap.load):
            return None
        return (
            f"{last.role} sends {', '.join(last.sent)} but the channel is full "
            f"(capacity {system.channel.capacity}) and may not lose it"
        )
    return _stuck(system, kind, snap)


def _stuck(system: System, kind: str, snap: Snapshot) -> str | None:
    """``deadlock`` and ``leak``: the request can never finish, holding nothing or something."""
    if snap.in_flight:
        return None
    live = []
    for role, state in snap.states.items():
        if state is None:
            continue
        if system.moves_on(role, state):
            return None
        if not system.finished(role, state):
            live.append((role, state))
    if not live:
        return None
    where = ", ".join(f"{role} in {state}" for role, state in live)
    held = [f"{role}: {', '.join(sorted(snap.held[role]))}" for role, _s in live if snap.held.get(role)]
    if kind == "leak" and held:
        return f"nothing can move {where} and nothing is in flight; it keeps {'; '.join(held)}"
    if kind == "deadlock" and not held:
        return f"nothing can move {where} and nothing is in flight (only an abort would end it)"
    return None


def violations(system: System, snap: Snapshot, *, on_step: bool = False) -> Iterator[tuple[str, str]]:
    """(property, what is wrong) for each property of ``system`` that ``snap`` breaks.

    ``on_step`` picks which properties: those a step breaks, or (the default)
    those a state breaks.
    """
    for prop in system.properties:
        if prop.on_step == on_step:
            text = violation(system, prop, snap)
            if text is not None:
                yield prop.name, text
