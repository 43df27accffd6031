"""The path cover: planned examples that take every edge, deadline, ignore rule and injected fault of a spec.

A random walk reaches a spec's deep edges only sometimes; a plan reaches each
by construction. :func:`path_cover` reads the spec model (its edges, ignore
rules, timeouts, phases, counts and early events, through the oracle's
:class:`~kvfsm.testing.oracle.SpecModel`) and returns, for each thing to
exercise, the shortest way there from ``begin``: fire the events along a
shortest path to the source state, then take the edge (by hand, by letting
its deadline fire, or with one of its actions made to raise), or fire each
ignored event there. A phase's deadline is let fire at its entry plus its
``after``, after time passed in the phase and moves inside it (the rest of
the route, a self-loop); a counted edge hears a repeated sender before its K
distinct ones; an early event's message names an id before the begin or
event that links it. Plans for one key come first, then the same routes for
several keys interleaved step by step.
Each plan is a list of steps of :class:`~kvfsm.testing.machine.SpecMachine`
(the format of its ``trace``), so it runs, checks and shrinks like any
example.

:func:`blocked_edges` says which edges the test cannot take with a given
driver, and why; the cover routes around them and the coverage verdict names
them.
"""

from __future__ import annotations

import inspect
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from ..spec import Spec
from ..spec.model import BEGIN
from .oracle import SpecModel

TraceStep = tuple[str, tuple[object, ...]]
"""One step of :attr:`SpecMachine.trace`: the machine method and its arguments."""

Pair = tuple[str, str]
"""A ``(state, event)`` pair: an edge's source and event, or an ignored event in a state."""


@dataclass(frozen=True)
class Plan:
    """One planned example: what it is for, and its steps."""

    goal: str
    steps: tuple[TraceStep, ...]


def caller_taken(spec: Spec, source: str | None, target: str) -> frozenset[str]:
    """Resources entering ``target`` takes with no acquire action: the caller takes them (before_begin/before_fire)."""
    return frozenset(r for r in spec.acquires(source, target) if not spec.resources[r].acquire)


def blocked_edges(spec: Spec, driver: object) -> dict[Pair, str]:
    """``(source, event) → why`` for each edge the test cannot take with ``driver``: one behind a payload.

    The test fires events bare unless the driver's ``before_fire`` returns a
    payload; an edge whose ``do`` or acquire action requires a payload
    argument (one the transition declares, with no default) would only make
    the driver raise ``TypeError``, so the test leaves it alone and says why.
    """
    if callable(getattr(driver, "before_fire", None)):
        return {}
    out: dict[Pair, str] = {}
    for e in spec.edges():
        needed = {a: _required(driver, a, e.transition.payload) for a in spec.raising_actions(e)}
        which = "; ".join(f"{a}() requires {', '.join(names)}" for a, names in needed.items() if names)
        if which:
            out[e.source, e.event] = (
                f"behind a payload the test cannot produce ({which}): give those parameters defaults, or give the "
                "driver before_fire(key, event, resources) returning the payload"
            )
    return out


def _required(driver: object, action: str, payload: Collection[str]) -> tuple[str, ...]:
    """Payload parameters of ``driver.action`` that have no default (the key excepted)."""
    method = getattr(driver, action, None)
    if method is None:
        return ()
    try:
        params = list(inspect.signature(method).parameters.values())[1:]  # the key comes first
    except (TypeError, ValueError):
        return ()
    return tuple(
        p.name
        for p in params
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.name in payload
    )


def routes(spec: Spec, blocked: Collection[Pair] = ()) -> dict[str, tuple[Pair, ...]]:
    """State → the edges ``(source, event)`` of a shortest path to it from the initial state.

    Breadth first in declaration order, around the ``blocked`` edges; a state
    missing from the result cannot be reached without one of them.
    """
    out: dict[str, tuple[Pair, ...]] = {spec.initial.name: ()}
    todo = deque([spec.initial.name])
    while todo:
        state = todo.popleft()
        for e in spec.edges():
            if e.source == state and e.target not in out and (e.source, e.event) not in blocked:
                out[e.target] = (*out[state], (e.source, e.event))
                todo.append(e.target)
    return out


def path_cover(
    spec: Spec,
    params: Mapping[str, float] | None = None,
    keys: Iterable[str] = ("req-1",),
    *,
    blocked: Collection[Pair] = (),
    faults: Collection[str] = (),
) -> list[Plan]:
    """Planned examples that exercise every reachable edge, deadline, ignore rule and fault point of ``spec``.

    ``faults`` are the actions a fault may be injected into (empty: none);
    ``keys`` the keys the machine uses: single-key plans use the first, and
    the routes are then replayed for all of them interleaved.
    """
    names = list(keys)
    model = SpecModel(spec, params)
    route = routes(spec, blocked)
    key = names[0]

    def walk(state: str) -> list[TraceStep]:
        return [("begin", (key, None)), *(("fire", (key, ev, None)) for _s, ev in route[state])]

    plans: list[Plan] = []
    done: set[Pair] = set()
    edges = [e for e in model.edges.values() if (e.source, e.event) not in blocked and e.source in route]
    # Deepest first: the route to a deep edge takes the shallow ones on its way.
    for e in sorted(edges, key=lambda e: -len(route[e.source])):
        timed = model.after.get(e.source)
        phase = phase_firing(model, e.source, e.event)
        if timed is not None and timed[1] == e.event:
            plans.append(Plan(f"deadline of {e.source} ({e.event})", (*walk(e.source), ("advance", (timed[0], None)))))
        elif phase:
            steps = phase_steps(model, route, blocked, key, e.source, phase, None)
            plans.append(Plan(f"deadline of phase {phase} in {e.source} ({e.event})", steps))
        elif (e.source, e.event) not in done:
            plans.append(
                Plan(f"edge {e.source} --{e.event}--> {e.target}", (*walk(e.source), ("fire", (key, e.event, None))))
            )
        else:
            continue
        done.update((*route[e.source], (e.source, e.event)))
    singles = [
        *plans,
        *_count_plans(model, route, blocked, key),
        *_early_plans(model, route, blocked, key),
        *_fault_plans(model, route, walk, blocked, faults, key),
        *_ignored_plans(model, route, walk, key),
    ]
    return [*singles, *_interleaved(plans, names, key)]


def phase_firing(model: SpecModel, state: str, event: str) -> str:
    """The first phase (in declaration order) ``state`` is in whose deadline fires ``event`` ("" if none)."""
    return next((p for p in model.spec.phases_of(state) if model.phase_after[p][1] == event), "")


def phase_steps(
    model: SpecModel,
    route: Mapping[str, tuple[Pair, ...]],
    blocked: Collection[Pair],
    key: str,
    state: str,
    phase: str,
    fault: int | None,
) -> tuple[TraceStep, ...]:
    """Let ``phase``'s deadline fire in ``state``, measured from the entry: walk into the phase (at t=0, so its
    deadline falls due at its ``after``), let time pass in the phase state reached, go on to ``state`` by moves
    inside the phase and take a self-loop there if it has one, then move the clock to the deadline
    (``fault``: the fault-th action then raises).

    Of the phase states to wait in, one from which ``state`` is reached inside the phase is preferred, so
    the expiry comes after moves inside it; the wait is chosen so that neither that state's own deadline nor
    ``state``'s (re-armed on the way) falls due before the phase's, where the spec allows that at all.
    """
    spec = model.spec
    inside = spec.phase_states[phase]
    ttl = model.phase_after[phase][0]
    loop = next(
        (e.event for e in model.edges.values() if e.source == e.target == state and (state, e.event) not in blocked),
        None,
    )

    def own(s: str) -> float:
        return model.after[s][0] if s in model.after else math.inf

    def window(wait_in: str, moves: tuple[Pair, ...]) -> float | None:
        """How long to wait in ``wait_in`` before ``moves`` lead to ``state``; None if no wait lets the phase fire
        there first."""
        rearmed = bool(moves) or loop is not None
        lo = max(0.0, ttl - own(state)) if rearmed else (0.0 if own(state) > ttl else math.inf)
        hi = min(ttl, own(wait_in))
        if lo < hi:
            return (lo + hi) / 2
        return 0.0 if own(state) > ttl else None  # no time to let pass first: go straight on

    options = []
    for entry in spec.states:
        moves = _inside(model, blocked, inside, entry, state) if entry in inside and entry in route else None
        if moves is not None:
            wait = window(entry, moves)
            rank = (wait is None, not moves and loop is None, len(route[entry]) + len(moves))
            options.append((rank, entry, moves, wait or 0.0))
    _rank, entry, moves, wait = min(options, key=lambda o: o[0])
    rest = ttl - wait
    while wait + rest < ttl:  # the clock adds: land on the deadline, not an ulp before it
        rest = math.nextafter(rest, math.inf)
    steps: list[TraceStep] = [("begin", (key, None)), *(("fire", (key, ev, None)) for _s, ev in route[entry])]
    if wait > 0:
        steps.append(("advance", (wait, None)))
    steps += [("fire", (key, ev, None)) for _s, ev in moves]
    if loop is not None:
        steps.append(("fire", (key, loop, None)))
    steps.append(("advance", (rest, fault)))
    return tuple(steps)


def _inside(
    model: SpecModel, blocked: Collection[Pair], inside: Collection[str], start: str, goal: str
) -> tuple[Pair, ...] | None:
    """A shortest path from ``start`` to ``goal`` that never leaves the states ``inside`` (no self-loops)."""
    paths: dict[str, tuple[Pair, ...]] = {start: ()}
    todo = deque([start])
    while todo:
        here = todo.popleft()
        if here == goal:
            return paths[here]
        for e in model.edges.values():
            if e.source == here and e.target in inside and e.target not in paths and (here, e.event) not in blocked:
                paths[e.target] = (*paths[here], (here, e.event))
                todo.append(e.target)
    return None


MOST_SENDERS = 16
"""Most distinct senders a count plan sends (a K from a param may be large)."""


def _count_plans(
    model: SpecModel, route: Mapping[str, tuple[Pair, ...]], blocked: Collection[Pair], key: str
) -> list[Plan]:
    """One plan per counted edge: get to its source, then hear one sender twice (a repeat, never counted), then
    the other senders one by one until K distinct ones were heard (K drawn as 2 where begin or the arrival
    gives it)."""
    plans = []
    for (state, event), source in model.counted.items():
        if source is None or state not in route or (state, event) in blocked:
            continue
        kind, what = source
        if kind == "number":
            k = int(what)
        elif kind == "param":
            k = int(model.spec.param(str(what), model.params))
        else:
            k = 2
        k = min(k, MOST_SENDERS)
        senders = ["s0"] if k <= 1 else ["s0", "s0", *(f"s{i}" for i in range(1, k))]
        steps: list[TraceStep] = [("begin", (key, None, k)), *(("fire", (key, ev, None)) for _s, ev in route[state])]
        steps += [("hear", (key, event, None, sender, k)) for sender in senders]
        repeat = ", a repeated sender" if k > 1 else ""
        plans.append(Plan(f"count of {event} in {state} ({k} distinct senders{repeat})", tuple(steps)))
    return plans


def _early_plans(
    model: SpecModel, route: Mapping[str, tuple[Pair, ...]], blocked: Collection[Pair], key: str
) -> list[Plan]:
    """One plan per event declared ``early:``: a message naming an id before the begin (or the event) that links
    it, then that begin (or the way to that event, and the event): the message is kept, then applied."""
    spec = model.spec
    plans = []
    for event, decl in spec.event_decls.items():
        if decl.early is None:
            continue
        space = spec.routed_by(event)
        ident = key if space == spec.key else f"{space}-1"  # the machine's first fresh id of the space
        hello: TraceStep = ("deliver", (event, ident, "s0", 1))
        at = spec.spaces[space].linked_at if space in spec.spaces else BEGIN
        if at == BEGIN:
            steps: tuple[TraceStep, ...] = (hello, ("begin", (key, None, 1)))
        else:
            links = [
                e for e in model.edges.values() if e.event == at and e.source in route and (e.source, at) not in blocked
            ]
            if not links:
                continue
            way = route[links[0].source]
            steps = (
                hello,
                ("begin", (key, None, 1)),
                *(("fire", (key, ev, None)) for _s, ev in way),
                ("fire", (key, at, None)),
            )
        before = (
            "its begin"
            if at == BEGIN and space == spec.key
            else "the begin that links it"
            if at == BEGIN
            else (f"the {at} that links it")
        )
        plans.append(Plan(f"early {event} naming {ident} before {before}", steps))
    return plans


def _ignored_plans(
    model: SpecModel, route: Mapping[str, tuple[Pair, ...]], walk: Callable[[str], list[TraceStep]], key: str
) -> list[Plan]:
    """One plan per state with ignore rules: get there, then fire each event it ignores."""
    ignored: dict[str, list[str]] = {}
    for state, event in sorted(model.ignored, key=lambda p: (model.order[p[0]], p[1])):
        ignored.setdefault(state, []).append(event)
    return [
        Plan(f"ignored in {state}: {', '.join(events)}", (*walk(state), *(("fire", (key, ev, None)) for ev in events)))
        for state, events in ignored.items()
        if state in route
    ]


def _fault_plans(
    model: SpecModel,
    route: Mapping[str, tuple[Pair, ...]],
    walk: Callable[[str], list[TraceStep]],
    blocked: Collection[Pair],
    faults: Collection[str],
    key: str,
) -> list[Plan]:
    """One plan per action that can raise before a state changes, on every edge (and begin) that runs it."""
    plans: list[Plan] = []
    raising = [a for a, _r in model.begin_acquires if a in faults]
    for nth, action in enumerate(raising):
        plans.append(Plan(f"fault in {action} at begin", (("begin", (key, nth)),)))
    for e in model.edges.values():
        if (e.source, e.event) in blocked or e.source not in route:
            continue
        timed = model.after.get(e.source)
        by_deadline = timed is not None and timed[1] == e.event
        phase = "" if by_deadline else phase_firing(model, e.source, e.event)
        for nth, action in enumerate(a for a in e.prepare_actions if a in faults):
            goal = f"fault in {action} on {e.source} --{e.event}-->"
            if phase:
                plans.append(Plan(goal, phase_steps(model, route, blocked, key, e.source, phase, nth)))
                continue
            step: TraceStep = ("advance", (timed[0], nth)) if by_deadline and timed else ("fire", (key, e.event, nth))
            plans.append(Plan(goal, (*walk(e.source), step)))
    return plans


def _interleaved(plans: list[Plan], names: list[str], key: str) -> list[Plan]:
    """The single-key plans again, ``len(names)`` at a time, each on its own key, one step of each in turn."""
    if len(names) < 2:
        return []
    out = []
    for start in range(0, len(plans), len(names)):
        group = plans[start : start + len(names)]
        if len(group) < 2:
            break
        lanes = [[_rekey(step, key, name) for step in p.steps] for p, name in zip(group, names, strict=False)]
        steps: list[TraceStep] = []
        for i in range(max(map(len, lanes))):
            steps += [lane[i] for lane in lanes if i < len(lane)]
        out.append(Plan(f"interleaved: {' | '.join(p.goal for p in group)}", tuple(steps)))
    return out


def _rekey(step: TraceStep, old: str, new: str) -> TraceStep:
    name, args = step
    return name, tuple(new if a == old else a for a in args)


__all__ = [
    "Pair",
    "Plan",
    "TraceStep",
    "blocked_edges",
    "caller_taken",
    "path_cover",
    "phase_firing",
    "phase_steps",
    "routes",
]
