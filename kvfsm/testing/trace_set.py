"""A composition's trace set: a few traces that together take every reachable role edge, replayed on real drivers.

The explorer proves properties over every interleaving; its traces are
counterexamples, and a corrected system has none. To show that the real
drivers of a composition keep to their roles on *every* path the roles can
take together, :func:`trace_set` takes the explorer's own moves of one
request (:func:`~kvfsm.explore.shortest_runs`: every move, each with a
shortest run to it) and keeps, for each thing to exercise, the shortest run
that does it:

- every **role edge** ``(role, from, event, to)`` some run can take (a
  ``crash`` into ``crashed`` included, for a role that may crash),
- every **message** some run can deliver (fired, ignored, counted or
  answered by a finished instance's server),
- every **ignored delivery** (a message a state ignores, or a crashed
  instance drops) some run can make;

then picks a small set of those runs that together exercise all of them
(greedy set cover, most new items first, shorter first). Items are named
after the system file's roles and messages: a role with ranks is one role,
whichever rank's instance moved. There is one walk, the explorer's, so a
trace set exists for every system the explorer can build one request of:
crashes, ranks, counted messages, timeout relations and families
(``owns:``) included.

:func:`cover_system` replays each chosen trace on fresh drivers
(:class:`~kvfsm.testing.trace_replay.TraceRun`) and judges the result like
the single-machine bar: a driver that parts from a trace fails the run, and
so does anything reachable left unexercised, named with why, unless the bar
was lowered on purpose (``min_coverage``, exemptions). What a replay cannot
perform yet (a family's linked trackers) is refused there, by
:class:`~kvfsm.testing.trace_replay.TraceRun`, naming the step and the system.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from ..errors import KvfsmError
from ..explore import LocalLimit, Step, Trace, TraceRole, check_trace, shortest_runs
from ..explore.entry import entering
from ..spec.system import System, load_system
from ..spec.system.model import CRASH, CRASHED
from .bar import Bar, check_names
from .calls import CallTimer, Factory
from .contract import DriverFactory
from .trace_replay import Mismatch, TraceRun, check_replayable

WALK_STATES = 1_000_000
"""Most local states of one request the trace set is built from (the explorer's bound for its check)."""

WALK_SECONDS = 120.0
"""Longest the explorer may take to build what one request reaches."""

REQUEST = "r0"
"""The one request every trace of the set is about."""

Kind = Literal["edge", "message", "ignored"]


class TraceSetError(KvfsmError):
    """One request of the system reaches more local states than a trace set is built from."""


@dataclass(frozen=True, order=True)
class Item:
    """One thing the trace set must exercise: a role edge, a delivered message, or an ignored delivery."""

    kind: Kind
    role: str
    """The role that moves (for a message: the role that receives it), as the system file declares it."""
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
        inbox = system.inbox(name)
        out += [Item("edge", name, s, ev, e.target) for (s, ev), e in spec.table.items()]
        out += [Item("ignored", name, s, ev, s) for s, ev in sorted(spec.ignores) if ev in inbox]
        if role.crash:  # a crash ends any live instance; the lost instance drops what reaches it
            out += [Item("edge", name, s, CRASH, CRASHED) for s, st in spec.states.items() if not st.is_final]
            out += [Item("ignored", name, CRASHED, ev, CRASHED) for ev in inbox]
    return out


def covered_by(system: System, step: Step) -> tuple[Item, ...]:
    """What one step of a trace of ``system`` exercises (a begin step: nothing).

    A step of a rank's instance (``prefill#1``) or of a copy of a message
    (``read@prefill#1>decode``) exercises the declared role's and message's
    item; a transition into a state that counts to 0 on entry also exercises
    the counted transitions that fire in the same step.
    """
    return _covered(system, system.expanded(), step)


def _covered(system: System, wide: System, step: Step) -> tuple[Item, ...]:
    """:func:`covered_by`, with the system's ranks expanded once by the caller (``wide``)."""
    if step.event is None or step.source is None:
        return ()
    role = wide.base_of(step.role)
    event = step.event
    found: list[Item] = []
    if step.cause == "message":
        message = wide.messages[event]
        event = message.event
        found.append(Item("message", role, "", event, ""))
    if step.action == "ignore":
        found.append(Item("ignored", role, step.source, event, step.source))
    elif step.action == "fire":
        edge = system.roles[role].spec.table.get((step.source, event))
        if edge is None:  # a crash: no transition of the spec
            found.append(Item("edge", role, step.source, event, step.target))
        else:
            found.append(Item("edge", role, edge.source, edge.event, edge.target))
            if edge.target != edge.source:
                chain = entering(system.roles[role].spec, edge.target)
                found += [Item("edge", role, then.source, then.event, then.target) for then in chain]
    return tuple(found)


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
    reached: frozenset[tuple[str, str]] = field(default=frozenset())
    """(role, state) pairs some run of one request reaches, the explorer's moves say."""

    def covered_by(self, step: Step) -> tuple[Item, ...]:
        """What one step of a trace of the set exercises (:func:`covered_by`)."""
        return _covered(self.system, self._wide, step)

    @cached_property
    def _wide(self) -> System:
        return self.system.expanded()


def trace_set(system: System | str | Path) -> TraceSet:
    """The shortest traces of one request that, together, exercise every reachable role edge, message and ignore.

    Raises :class:`TraceSetError` when one request reaches more local states
    than :data:`WALK_STATES`, or they take longer than :data:`WALK_SECONDS`
    to build.
    """
    if not isinstance(system, System):
        system = load_system(system)
    try:
        runs = shortest_runs(system, max_states=WALK_STATES, time_limit=WALK_SECONDS)
    except LocalLimit as cut:
        raise TraceSetError(
            f"{system.name}: one request reaches more local states than the trace set is built from "
            f"({WALK_STATES:,} in {WALK_SECONDS:g} s, {cut.states:,} built); replay the explorer's traces of it "
            "with --trace instead"
        ) from None
    every = items(system)
    wide = system.expanded()
    shortest: dict[Item, tuple[Step, ...]] = {}
    covers: dict[Item, set[Item]] = {}
    reached: set[tuple[str, str]] = set()
    for run in runs:  # shortest first: the first run that exercises an item is a shortest one
        got = {c for s in run for c in _covered(system, wide, s)}
        reached.update((wide.base_of(s.role), s.target) for s in run if s.target is not None)
        for item in got - shortest.keys():
            shortest[item], covers[item] = run, got
    stray = sorted(shortest.keys() - set(every))  # pragma: no cover - items() names everything a move exercises
    reachable = [i for i in every if i in shortest] + stray
    left = set(reachable)
    chosen: list[Item] = []
    while left:
        best = min(reachable, key=lambda i: (-len(covers[i] & left), len(shortest[i]), i))
        chosen.append(best)
        left -= covers[best]
    roles = tuple(TraceRole(name, r.path, r.spec.name, r.spec.key) for name, r in wide.roles.items())
    traces = []
    for goal in chosen:
        trace = Trace(system.name, system.path, system.names[0], "", REQUEST, roles, shortest[goal])
        check_trace(trace, system)
        traces.append(trace)
    unreachable = tuple(i for i in every if i not in shortest)
    return TraceSet(system, tuple(traces), tuple(chosen), tuple(reachable), unreachable, frozenset(reached))


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
    factory's call and the trace. A set with a step a trace run cannot
    perform yet (a family's ``owner`` step) raises
    :class:`~kvfsm.explore.TraceError` naming it and the system
    (:func:`~kvfsm.testing.trace_replay.check_replayable`) before any
    driver is made.
    """
    chosen = trace_set(system)
    for trace in chosen.traces:  # what a trace run cannot perform yet is refused before any driver is made
        check_replayable(trace, chosen.system)
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
            exercised.update(chosen.covered_by(done.step))
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
            gaps.append((item, _why(item, runs, chosen)))
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


def _why(item: Item, runs: Sequence[TraceOutcome], chosen: TraceSet) -> str:
    """Why a reachable item went unexercised: the traces that would have exercised it parted from the drivers first."""
    cut = [r for r in runs if r.mismatch is not None and any(item in chosen.covered_by(s) for s in r.trace.moves)]
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
