"""A composition's trace set: a few traces that together take every reachable role edge, replayed on real drivers.

The explorer proves properties over every interleaving; its traces are
counterexamples, and a corrected system has none. To show that the real
drivers of a composition keep to their roles on *every* path the roles can
take together, :func:`trace_set` walks one request of the system breadth
first and keeps, for each thing to exercise, the shortest trace that does it:

- every **role edge** ``(role, from, event, to)`` some run can take,
- every **message** some run can deliver,
- every **ignored delivery** (a message a state ignores) some run can make;

then picks a small set of those traces that together exercise all of them
(greedy set cover, most new items first, shorter first). :func:`cover_system`
replays each chosen trace on fresh drivers (:class:`~kvfsm.testing.trace_replay.TraceRun`)
and judges the result like the single-machine bar: a driver that parts from
a trace fails the run, and so does anything reachable left unexercised,
named with why, unless the bar was lowered on purpose (``min_coverage``,
exemptions).

The walk follows the explorer's rules for one request (docs/explore.md): a
live instance may fire any event that is no message it receives (local work,
timeouts, ``abort``, the ``on_error`` event); a message in flight that may
arrive is fired, ignored, or answered by a finished instance's server
(``reply_if_finished``); sends, losses, duplicates and the capacity follow
the channel's rules (:class:`~kvfsm.spec.system.channel.Wire`). A delivery
the receiver would reject breaks a property, so the walk leaves it to the
explorer. Each trace is checked with :func:`~kvfsm.explore.check_trace`, and
the role states the walk reaches are compared with those
:func:`~kvfsm.explore.explore` reaches for one request: if the two part (the
explorer learned a move the walk does not make), the walk refuses to judge.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import KvfsmError
from ..explore import ExploreResult, Sent, Step, Trace, TraceRole, check_sizes, check_trace, explore
from ..spec.model import ABORT, Edge
from ..spec.system import System, load_system
from ..spec.system.channel import Flight
from .bar import Bar, check_names
from .calls import CallTimer, Factory
from .contract import DriverFactory
from .trace_replay import Mismatch, TraceRun

WALK_STATES = 1_000_000
"""Most local states of one request the trace set is built from (the explorer's bound for its check)."""

WALK_SECONDS = 120.0
"""Longest the explorer may take to check what one request reaches, before the walk."""

REQUEST = "r0"
"""The one request every trace of the set is about."""

Kind = Literal["edge", "message", "ignored"]


class TraceSetError(KvfsmError):
    """The walk and the explorer disagree on what a request can reach: the walk cannot be trusted to judge."""


@dataclass(frozen=True, order=True)
class Item:
    """One thing the trace set must exercise: a role edge, a delivered message, or an ignored delivery."""

    kind: Kind
    role: str
    """The role that moves (for a message: the role that receives it)."""
    source: str
    event: str
    target: str

    @property
    def name(self) -> str:
        """How the verdict and an exemption name it: ``decode: waiting --abort--> aborting``,
        ``message abort_ack``, ``prefill: ignored metadata in failed``."""
        if self.kind == "message":
            return f"message {self.event}"
        if self.kind == "ignored":
            return f"{self.role}: ignored {self.event} in {self.source}"
        return f"{self.role}: {self.source} --{self.event}--> {self.target}"

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name}


def items(system: System) -> list[Item]:
    """Everything a composition could ask a trace set to exercise, reachable or not, in declaration order."""
    out = [Item("message", m.receiver, "", m.name, "") for m in system.messages.values()]
    for name, role in system.roles.items():
        spec = role.spec
        out += [Item("edge", name, s, ev, e.target) for (s, ev), e in spec.table.items()]
        inbox = system.inbox(name)
        out += [Item("ignored", name, s, ev, s) for s, ev in sorted(spec.ignores) if ev in inbox]
    return out


def covered_by(step: Step) -> tuple[Item, ...]:
    """What one step of a trace exercises (a begin step: nothing)."""
    if step.event is None or step.source is None:
        return ()
    found: list[Item] = []
    if step.cause == "message":
        found.append(Item("message", step.role, "", step.event, ""))
    if step.action == "fire":
        found.append(Item("edge", step.role, step.source, step.event, step.target))
    elif step.action == "ignore":
        found.append(Item("ignored", step.role, step.source, step.event, step.source))
    return tuple(found)


# -- the walk: one request, breadth first ---------------------------------------------------

Node = tuple[tuple[str, ...], Flight]
"""Each role's state, and the request's messages in flight (message ids, as the channel's rules keep them)."""


class _Walk:
    """Every composite state one request reaches, and for every item the shortest trace that exercises it."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.wire = system.wire
        self.roles = tuple(system.roles)
        start: Node = (tuple(system.roles[r].spec.initial.name for r in self.roles), ())
        self.parent: dict[Node, tuple[Node, Step] | None] = {start: None}
        self.first: dict[Item, tuple[Node, Step]] = {}
        """Item → the state and step of its shortest trace (breadth first: the first found is shortest)."""
        todo = deque([start])
        while todo:
            node = todo.popleft()
            for step, after in self._moves(node):
                for item in covered_by(step):
                    self.first.setdefault(item, (node, step))
                if after not in self.parent:
                    self.parent[after] = (node, step)
                    todo.append(after)

    def reached(self) -> set[tuple[str, str]]:
        """(role, state) pairs some run reaches."""
        return {(r, s) for at, _f in self.parent for r, s in zip(self.roles, at, strict=True)}

    def path(self, node: Node) -> list[Step]:
        """The steps from the start to ``node``."""
        out: list[Step] = []
        here = self.parent[node]
        while here is not None:
            node, step = here
            out.append(step)
            here = self.parent[node]
        return out[::-1]

    def _moves(self, node: Node) -> Iterator[tuple[Step, Node]]:
        at, flight = node
        for r, role in enumerate(self.roles):
            spec = self.system.roles[role].spec
            state = spec.states[at[r]]
            if state.is_final:
                continue
            inbox = self.system.inbox(role)
            for (source, event), edge in spec.table.items():
                if source != state.name or event in inbox or edge.target not in spec.states:
                    continue
                if spec.fires_on_timeout(state.name, event):  # its own deadline's event, or a phase's it is in
                    cause = "timeout"
                elif event == ABORT:
                    cause = "abort"
                elif event == spec.on_error:
                    cause = "error"
                else:
                    cause = "local"
                yield from self._send(at, flight, r, "fire", cause, event, edge.target, self._sends(edge), False)
        for pos in self.wire.deliverable(flight):
            message = self.system.messages[self.wire.names[flight[pos]]]
            r = self.roles.index(message.receiver)
            spec = self.system.roles[message.receiver].spec
            state = spec.states[at[r]]
            handled = spec.table.get((state.name, message.name))
            for left, duplicate in self.wire.deliveries(flight, pos):
                if state.is_final and message.reply_if_finished:
                    yield from self._send(
                        at, left, r, "reply", "message", message.name, state.name, (message.reply_if_finished,),
                        duplicate,
                    )  # fmt: skip
                elif (state.name, message.name) in spec.ignores:
                    yield from self._send(at, left, r, "ignore", "message", message.name, state.name, (), duplicate)
                elif handled is not None and not state.is_final:
                    sends = self._sends(handled)
                    yield from self._send(
                        at, left, r, "fire", "message", message.name, handled.target, sends, duplicate
                    )

    def _sends(self, edge: Edge) -> tuple[str, ...]:
        """The messages ``edge`` sends to another role of the system."""
        return tuple(s.message for s in edge.transition.sends if s.message in self.wire.ids)

    def _send(
        self,
        at: tuple[str, ...],
        flight: Flight,
        r: int,
        action: str,
        cause: str,
        event: str,
        target: str,
        sends: Sequence[str],
        duplicate: bool,
    ) -> Iterator[tuple[Step, Node]]:
        """The step, once per fate of each message it sends, that fits the channel."""
        role = self.roles[r]
        spec = self.system.roles[role].spec
        for after, fates in self.wire.sends(flight, [self.wire.ids[m] for m in sends]):
            if len(after) > self.system.channel.capacity:
                continue  # a send that does not fit breaks 'overflow' or is lost (another fate)
            sent = tuple(
                Sent(self.wire.names[m], self.system.messages[self.wire.names[m]].receiver, lost=not kept)
                for m, kept in fates
            )
            step = Step(
                request=REQUEST,
                role=role,
                action=action,
                cause=cause,
                event=event,
                source=at[r],
                target=target,
                sent=sent,
                duplicate=duplicate,
                holds=spec.states[target].holds,
                in_flight=tuple(self.wire.names[m] for m in after),
            )
            yield step, ((*at[:r], target, *at[r + 1 :]), after)


# -- the set ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSet:
    """The chosen traces, what each was chosen for, and what the system has that no run can reach."""

    system: System
    traces: tuple[Trace, ...]
    goals: tuple[Item, ...]
    """Per trace: the item it was the shortest trace for."""
    reachable: tuple[Item, ...]
    unreachable: tuple[Item, ...]
    """Items no run of one request can exercise (a role state never reached, a message never sent there)."""
    reached: frozenset[tuple[str, str]]
    """(role, state) pairs some run reaches: those the explorer reaches for one request."""


def trace_set(system: System | str | Path) -> TraceSet:
    """The shortest traces of one request that, together, exercise every reachable role edge, message and ignore.

    Raises :class:`TraceSetError` when the role states the walk reaches are
    not those the explorer reaches for one request.
    """
    if not isinstance(system, System):
        system = load_system(system)
    _modelled(system)
    explored = _explored(system)
    walk = _Walk(system)
    _agree_with_explorer(system, walk.reached(), explored)
    every = items(system)
    reachable = [i for i in every if i in walk.first]
    shortest = {i: (*walk.path(walk.first[i][0]), walk.first[i][1]) for i in reachable}
    covers = {i: {c for s in moves for c in covered_by(s)} for i, moves in shortest.items()}
    left = set(reachable)
    chosen: list[Item] = []
    while left:
        best = min(reachable, key=lambda i: (-len(covers[i] & left), len(shortest[i]), i))
        chosen.append(best)
        left -= covers[best]
    roles = tuple(TraceRole(name, r.path, r.spec.name, r.spec.key) for name, r in system.roles.items())
    begins = tuple(
        Step(REQUEST, name, "begin", "begin", None, None, r.spec.initial.name, holds=r.spec.initial.holds)
        for name, r in system.roles.items()
    )
    traces = []
    for goal in chosen:
        trace = Trace(system.name, system.path, system.names[0], "", REQUEST, roles, (*begins, *shortest[goal]))
        check_trace(trace, system)
        traces.append(trace)
    unreachable = tuple(i for i in every if i not in walk.first)
    return TraceSet(system, tuple(traces), tuple(chosen), tuple(reachable), unreachable, frozenset(walk.reached()))


def _modelled(system: System) -> None:
    """Refuse a system that uses what the walk does not model (yet), rather than judge its coverage wrongly."""
    unmodelled = [
        *(f"role {r.name} may crash" for r in system.roles.values() if r.crash),
        *(f"role {r.name} has {r.ranks} ranks" for r in system.roles.values() if r.ranks > 1),
        *(f"message {m.name} counts senders" for m in system.messages.values() if m.count),
        *(f"the timeout relation {rel.text!r}" for rel in system.relations),
        *(f"role {r.name} owns instances of another machine" for r in system.roles.values() if r.spec.owns),
    ]
    if unmodelled:
        raise TraceSetError(
            f"{system.name}: the trace set walks one request without crashes, ranks, counted messages, timeout "
            f"relations or owned machines, and this system has {'; '.join(unmodelled)}; replay the explorer's traces of it with "
            "--trace instead"
        )


def _explored(system: System) -> ExploreResult:
    """The explorer's run of one request, within bounds: the walk covers the same local states, so a system too big
    for the explorer's bounds is too big for the walk, and is refused before it starts."""
    check_sizes(system, 1)
    explored = explore(system, requests=1, max_states=WALK_STATES, time_limit=WALK_SECONDS)
    if explored.stopped is not None:
        raise TraceSetError(
            f"{system.name}: one request reaches more local states than the trace set is built from "
            f"({WALK_STATES:,} in {WALK_SECONDS:g} s); replay the explorer's traces of it with --trace instead"
        )
    return explored


def _agree_with_explorer(system: System, reached: set[tuple[str, str]], result: ExploreResult | None = None) -> None:
    """Refuse to judge if the walk and the explorer (``result``, one request; run here if not given) reach
    different role states."""
    if result is None:
        result = _explored(system)
    theirs = {(role, s) for role, r in system.roles.items() for s in r.spec.states} - set(result.unreached)
    if theirs != reached:
        only_walk = ", ".join(f"{r} in {s}" for r, s in sorted(reached - theirs)) or "nothing"
        only_explorer = ", ".join(f"{r} in {s}" for r, s in sorted(theirs - reached)) or "nothing"
        raise TraceSetError(
            f"{system.name}: the trace set's walk reaches {only_walk} that the explorer does not, and the explorer "
            f"reaches {only_explorer} that the walk does not; the walk follows the explorer's rules for one request "
            "and must learn the moves it lacks before its coverage can be trusted"
        )


# -- replaying it: the verdict ------------------------------------------------------------------


@dataclass(frozen=True)
class TraceOutcome:
    """One trace of the set as replayed: what it was for, how far it matched, where it parted."""

    goal: Item
    trace: Trace
    matched: int
    """Moves (steps after the begins) that matched before the end or the first mismatch."""
    mismatch: Mismatch | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "goal": self.goal.name,
            "moves": len(self.trace.moves),
            "matched": self.matched,
            "mismatch": self.mismatch.as_dict() if self.mismatch is not None else None,
            "trace": self.trace.as_dict(),
        }


@dataclass(frozen=True)
class SystemCoverage:
    """A trace set replayed on drivers: the divergences, what went unexercised and whether that clears the bar."""

    system: str
    drivers: Mapping[str, str]
    """role → what drove it (the driver's class, or the built-in ledger)."""
    runs: tuple[TraceOutcome, ...]
    reachable: tuple[Item, ...]
    unreachable: tuple[Item, ...]
    exercised: frozenset[Item]
    gaps: tuple[tuple[Item, str], ...]
    """Reachable, never exercised, not exempt: with why."""
    exempted: tuple[tuple[Item, str], ...]
    cleared: bool
    """The coverage cleared the bar (it says nothing of divergences)."""
    skipped: int = 0
    """Traces of the set not replayed: a driver call hung in an earlier one, which ended the run."""

    @property
    def diverged(self) -> tuple[TraceOutcome, ...]:
        return tuple(r for r in self.runs if r.mismatch is not None)

    @property
    def passed(self) -> bool:
        """Every trace matched to its end, and the coverage cleared the bar."""
        return not self.diverged and self.cleared

    @property
    def ratio(self) -> float:
        return len(self.exercised) / len(self.reachable) if self.reachable else 1.0

    def summary(self) -> str:
        """One line: what diverged, what was not reached, or that everything was exercised."""
        if self.diverged:
            first = self.diverged[0]
            left = f"; {self.skipped} more not replayed" if self.skipped else ""
            return (
                f"{len(self.diverged)} of {len(self.runs)} traces diverged; the first, for {first.goal.name}, "
                f"at {first.mismatch}{left}"
            )
        if self.gaps:
            return f"{len(self.gaps)} not reached ({self.ratio:.0%} exercised): " + "; ".join(
                f"{i.name} ({why})" for i, why in self.gaps
            )
        counts = {k: sum(i.kind == k for i in self.reachable) for k in ("edge", "message", "ignored")}
        return (
            f"every reachable role edge ({counts['edge']}), message ({counts['message']}) and ignored delivery "
            f"({counts['ignored']}) was exercised in {len(self.runs)} traces"
            + (f" ({len(self.exempted)} exempt)" if self.exempted else "")
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "drivers": dict(self.drivers),
            "passed": self.passed,
            "summary": self.summary(),
            "coverage_verdict": {
                "cleared": self.cleared,
                "ratio": round(self.ratio, 4),
                "reachable": len(self.reachable),
                "exercised": len(self.exercised),
                "not_reached": [{**i.as_dict(), "why": why} for i, why in self.gaps],
                "exempt": [{**i.as_dict(), "reason": reason} for i, reason in self.exempted],
                "unreachable": [i.as_dict() for i in self.unreachable],
            },
            "traces": [r.as_dict() for r in self.runs],
            "not_replayed": self.skipped,
        }


def cover_system(
    system: System | str | Path,
    drivers: Mapping[str, DriverFactory] | None = None,
    *,
    bar: Bar | None = None,
    call_timeout: float | None = None,
    on_stuck: Callable[[str], None] | None = None,
) -> SystemCoverage:
    """Replay the :func:`trace_set` of ``system`` on fresh drivers per trace (a ledger for roles without a factory).

    ``bar`` lowers the coverage required, as for one machine: its exemptions
    name items as :attr:`Item.name` does, and are refused if they name
    nothing the system has or give no reason. ``call_timeout`` (seconds)
    bounds each call into a driver: a call that does not return in time is a
    ``hung`` mismatch, and the traces after it are not replayed
    (:attr:`SystemCoverage.skipped`). A factory that raises, on any trace,
    raises :class:`~kvfsm.testing.calls.DriverError` naming the role, the
    factory's call and the trace.
    """
    chosen = trace_set(system)
    bar = bar if bar is not None else Bar()
    every = [*chosen.reachable, *chosen.unreachable]
    check_names(chosen.system.name, [i.name for i in every], bar.exempt)
    timer = CallTimer(call_timeout, on_stuck=on_stuck)
    made = {role: Factory(f, timer, role=role) for role, f in (drivers or {}).items()}
    runs: list[TraceOutcome] = []
    exercised: set[Item] = set()
    drove: Mapping[str, str] = {}
    for goal, trace in zip(chosen.goals, chosen.traces, strict=True):
        replay = TraceRun(chosen.system, trace, made, timer=timer, purpose=f"for the trace for {goal.name}")
        drove = replay.driven_by
        matched = 0
        for done in replay:
            if done.mismatch is not None:
                break
            matched += done.step.action != "begin"
            exercised.update(covered_by(done.step))
        mismatch = next((d.mismatch for d in replay.done if d.mismatch is not None), None)
        runs.append(TraceOutcome(goal, trace, matched, mismatch))
        if replay.hung:  # the driver may hang again on every trace: one finding is enough
            break
    skipped = len(chosen.traces) - len(runs)
    gaps: list[tuple[Item, str]] = []
    exempted: list[tuple[Item, str]] = []
    for item in chosen.reachable:
        if item in exercised:
            continue
        if item.name in bar.exempt:
            exempted.append((item, bar.exempt[item.name]))
        else:
            gaps.append((item, _why(item, runs)))
    ratio = len(exercised) / len(chosen.reachable) if chosen.reachable else 1.0
    return SystemCoverage(
        chosen.system.name,
        dict(drove),
        tuple(runs),
        chosen.reachable,
        chosen.unreachable,
        frozenset(exercised),
        tuple(gaps),
        tuple(exempted),
        not gaps or ratio >= bar.min_coverage,
        skipped,
    )


def _why(item: Item, runs: Sequence[TraceOutcome]) -> str:
    """Why a reachable item went unexercised: the traces that would have exercised it parted from the drivers first."""
    cut = [r for r in runs if r.mismatch is not None and any(item in covered_by(s) for s in r.trace.moves)]
    if cut:
        r = cut[0]
        return f"the trace for {r.goal.name} diverged at {r.mismatch} before reaching it"
    if any(r.mismatch is not None and r.mismatch.what == "hung" for r in runs):
        return "not replayed: a driver call hung in an earlier trace, which ended the run"
    return "no trace of the set reaches it"  # pragma: no cover - the set covers every reachable item


__all__ = [
    "REQUEST",
    "Item",
    "SystemCoverage",
    "TraceOutcome",
    "TraceSet",
    "TraceSetError",
    "cover_system",
    "covered_by",
    "items",
    "trace_set",
]
