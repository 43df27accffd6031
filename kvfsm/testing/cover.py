"""The path cover: planned examples that take every edge, deadline, ignore rule and injected fault of a spec.

A random walk reaches a spec's deep edges only sometimes; a plan reaches each
by construction. :func:`path_cover` reads the spec model (its edges, ignore
rules and timeouts, through the oracle's :class:`~kvfsm.testing.oracle.SpecModel`)
and returns, for each thing to exercise, the shortest way there from
``begin``: fire the events along a shortest path to the source state, then
take the edge (by hand, by letting its deadline fire, or with one of its
actions made to raise), or fire each ignored event there. Plans for one key
come first, then the same routes for several keys interleaved step by step.
Each plan is a list of steps of :class:`~kvfsm.testing.machine.SpecMachine`
(the format of its ``trace``), so it runs, checks and shrinks like any
example.

:func:`blocked_edges` says which edges the test cannot take with a given
driver, and why; the cover routes around them and the coverage verdict names
them.
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from ..spec import Spec
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
        if timed is not None and timed[1] == e.event:
            plans.append(Plan(f"deadline of {e.source} ({e.event})", (*walk(e.source), ("advance", (timed[0], None)))))
        elif (e.source, e.event) not in done:
            plans.append(
                Plan(f"edge {e.source} --{e.event}--> {e.target}", (*walk(e.source), ("fire", (key, e.event, None))))
            )
        else:
            continue
        done.update((*route[e.source], (e.source, e.event)))
    singles = [
        *plans,
        *_fault_plans(model, route, walk, blocked, faults, key),
        *_ignored_plans(model, route, walk, key),
    ]
    return [*singles, *_interleaved(plans, names, key)]


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
        for nth, action in enumerate(a for a in e.prepare_actions if a in faults):
            step: TraceStep = ("advance", (timed[0], nth)) if by_deadline and timed else ("fire", (key, e.event, nth))
            plans.append(Plan(f"fault in {action} on {e.source} --{e.event}-->", (*walk(e.source), step)))
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


__all__ = ["Pair", "Plan", "TraceStep", "blocked_edges", "caller_taken", "path_cover", "routes"]
