"""``explore(system)``: build the local system, search it for N requests, and turn what was found into traces.

:func:`shortest_runs` reads the same local system of one request without a
search: every move it can make, each with a shortest run that ends with it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..spec.system import Channel, System, load_system
from .automaton import Automaton, build
from .entry import at_once
from .limits import check_sizes
from .liveness import Fairness, Lasso, find_lasso
from .local import LocalLimit, LocalSystem, Move
from .search import Found, ProgressFn, Search, path_to, search
from .trace import Sent, Step, Trace, TraceRole


@dataclass(frozen=True)
class PropertyResult:
    """One property's verdict: ``holds`` (for the explored bounds), ``violated`` (with a trace) or ``unknown``."""

    name: str
    kind: str
    """``builtin``, ``never`` or ``eventually``."""
    description: str
    status: str
    trace: Trace | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "description": self.description,
            "status": self.status,
            "trace": self.trace.as_dict() if self.trace is not None else None,
        }


@dataclass(frozen=True)
class ExploreResult:
    """What an exploration proved or found, within which bounds, at what cost."""

    system: str
    path: str
    requests: int
    symmetry: bool
    merge: bool
    channel: Channel
    states: int
    transitions: int
    depth: int
    seconds: float
    complete: bool
    """Every reachable state was visited (no ``first`` stop, no ``max_states`` or ``time_limit`` cut)."""
    local_states: int
    """Reachable local states of one request (role states + its messages in flight)."""
    nodes: int
    """What the search ran on: local states, or their merged classes."""
    properties: tuple[PropertyResult, ...]
    unreached: tuple[tuple[str, str], ...]
    """(role, state) pairs no request can reach within the bounds."""
    stopped: str | None = None
    """Why the search stopped early (:data:`~kvfsm.explore.search.STOPS`); ``None`` when it was complete."""
    max_states: int | None = None
    """The state bound the search ran under (``None``: none)."""
    time_limit: float | None = None
    """The time bound the search ran under, in seconds (``None``: none)."""

    @property
    def interrupted(self) -> bool:
        """Ctrl-C stopped the search: what it holds is what was found until then."""
        return self.stopped == "interrupted"

    @property
    def violated(self) -> tuple[PropertyResult, ...]:
        return tuple(p for p in self.properties if p.status == "violated")

    @property
    def verdict(self) -> str:
        """``violated`` if any property is; else ``verified`` if the search was complete; else ``incomplete``."""
        if self.violated:
            return "violated"
        return "verified" if self.complete else "incomplete"

    @property
    def rate(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        c = self.channel
        return {
            "system": self.system,
            "path": self.path,
            "verdict": self.verdict,
            "requests": self.requests,
            "symmetry": self.symmetry,
            "merge": self.merge,
            "channel": {"loss": c.loss, "duplicate": c.duplicate, "reorder": c.reorder, "capacity": c.capacity},
            "states": self.states,
            "transitions": self.transitions,
            "depth": self.depth,
            "seconds": round(self.seconds, 4),
            "states_per_second": round(self.rate),
            "complete": self.complete,
            "local_states": self.local_states,
            "nodes": self.nodes,
            "properties": [p.as_dict() for p in self.properties],
            "unreached": [{"role": r, "state": s} for r, s in self.unreached],
            "stopped": self.stopped,
            "interrupted": self.interrupted,
            "max_states": self.max_states,
            "time_limit": self.time_limit,
        }


def explore(
    system: System | str | Path,
    *,
    requests: int | None = None,
    symmetry: bool = True,
    merge: bool = True,
    first: bool = False,
    max_states: int | None = None,
    time_limit: float | None = None,
    progress: ProgressFn | None = None,
) -> ExploreResult:
    """Check every property of a composition over every interleaving of ``requests`` requests.

    ``symmetry``: requests are interchangeable (a state is a multiset of
    per-request states). ``merge``: local states no property can tell apart
    are one node. Both keep every verdict and every shortest counterexample;
    switch both off to count the plain product, as SPIN stores it.
    ``first``: stop at the first violation; ``max_states``, ``time_limit``
    (seconds, building one request's local system included): stop there
    (the result is then incomplete, and a property not yet violated is
    ``unknown``). Ctrl-C (KeyboardInterrupt) during the search stops it the
    same way, with :attr:`ExploreResult.interrupted`; liveness is then not
    checked (``unknown``). ``progress`` is called with a
    :class:`~kvfsm.explore.search.Progress` as the search goes.

    Sizes are checked first (:func:`check_sizes`, :class:`ExploreError`).
    When one request's local system alone is larger than ``max_states``, or
    is not built within ``time_limit``, nothing is searched: the result is
    incomplete with no global state and every property ``unknown``.
    """
    if not isinstance(system, System):
        system = load_system(system)
    n = check_sizes(system, requests)
    system = system.expanded()
    started = time.perf_counter()
    deadline = started + time_limit if time_limit is not None else None
    try:
        local = LocalSystem(system, limit=max_states, deadline=deadline)
    except LocalLimit as cut:
        return _unbuilt(system, n, symmetry, merge, cut, time.perf_counter() - started, max_states, time_limit)
    auto = build(local, merge=merge)
    found = search(
        auto,
        requests=n,
        capacity=system.channel.capacity,
        properties=system.names,
        symmetry=symmetry,
        overflow=not system.channel.loss,
        first=first,
        max_states=max_states,
        time_limit=max(deadline - time.perf_counter(), 0.0) if deadline is not None else None,
        progress=progress,
    )
    results = []
    fairness = Fairness(local) if system.eventually and found.stopped != "interrupted" else None
    for prop in system.properties:
        kind = "builtin" if prop.builtin else "eventually" if prop.liveness else "never"
        if prop.liveness:
            if fairness is None:  # Ctrl-C: the user asked to stop, not for one more search
                results.append(PropertyResult(prop.name, kind, prop.describe(), "unknown"))
                continue
            lasso = find_lasso(local, prop, fairness)
            if lasso is None:
                results.append(PropertyResult(prop.name, kind, prop.describe(), "holds"))
            else:
                trace = _lasso_trace(system, local, lasso)
                results.append(PropertyResult(prop.name, kind, prop.describe(), "violated", trace))
            continue
        hit = found.found.get(prop.name)
        if hit is not None:
            trace = _trace(system, local, auto, found, hit, n)
            results.append(PropertyResult(prop.name, kind, prop.describe(), "violated", trace))
        else:
            status = "holds" if found.complete else "unknown"
            results.append(PropertyResult(prop.name, kind, prop.describe(), status))
    reached = local.reached()
    unreached = tuple(
        (role, state) for role, r in system.roles.items() for state in r.spec.states if (role, state) not in reached
    )
    return ExploreResult(
        system=system.name,
        path=system.path,
        requests=n,
        symmetry=symmetry,
        merge=merge,
        channel=system.channel,
        states=found.states,
        transitions=found.transitions,
        depth=found.depth,
        seconds=time.perf_counter() - started,
        complete=found.complete,
        local_states=len(local.states),
        nodes=auto.size,
        properties=tuple(results),
        unreached=unreached,
        stopped=found.stopped,
        max_states=max_states,
        time_limit=time_limit,
    )


def _unbuilt(
    system: System,
    requests: int,
    symmetry: bool,
    merge: bool,
    cut: LocalLimit,
    seconds: float,
    max_states: int | None,
    time_limit: float | None,
) -> ExploreResult:
    """The result of a run whose one-request local system outgrew its bound: nothing searched, nothing known."""
    return ExploreResult(
        system=system.name,
        path=system.path,
        requests=requests,
        symmetry=symmetry,
        merge=merge,
        channel=system.channel,
        states=0,
        transitions=0,
        depth=0,
        seconds=seconds,
        complete=False,
        local_states=cut.states,
        nodes=0,
        properties=tuple(
            PropertyResult(
                p.name,
                "builtin" if p.builtin else "eventually" if p.liveness else "never",
                p.describe(),
                "unknown",
            )
            for p in system.properties
        ),
        unreached=(),
        stopped=cut.stopped,
        max_states=max_states,
        time_limit=time_limit,
    )


def shortest_runs(
    system: System | str | Path, *, max_states: int | None = None, time_limit: float | None = None
) -> tuple[tuple[Step, ...], ...]:
    """Every move one request can make, each once, with a shortest run of request ``r0`` that ends with it.

    The explorer's local system of one request (:class:`~kvfsm.explore.local.LocalSystem`)
    is read breadth first from its initial state; for each distinct move (the
    same role, action, event, states, sends and fates, wherever the request
    is), the first run found that ends with it is kept. A run is the steps of
    a ``kvfsm-trace/1`` trace: each role's ``begin``, then one step per move
    (and one per transition the engine fired for a family in the same move).
    Runs come shortest first. A move that itself breaks a property (a
    delivery the receiver rejects, a send that overflows the channel) is a
    counterexample, found by :func:`explore`: it is neither kept nor taken.

    Sizes are checked first (:func:`check_sizes`); ``max_states`` and
    ``time_limit`` (seconds) bound the local system, which raises
    :class:`~kvfsm.explore.local.LocalLimit` past either.
    """
    if not isinstance(system, System):
        system = load_system(system)
    check_sizes(system, 1)
    system = system.expanded()
    deadline = time.perf_counter() + time_limit if time_limit is not None else None
    local = LocalSystem(system, limit=max_states, deadline=deadline)
    parent: dict[int, tuple[int, Move] | None] = {local.initial: None}
    kept: dict[Move, tuple[int, Move, int]] = {}
    """A move, as it is wherever the request is (its in-flight count aside) → (from, the move, to) of its first."""
    todo = deque([local.initial])
    while todo:
        i = todo.popleft()
        for j, move in (*local.moves[i], *((i, loop) for loop in local.loops[i])):
            if move.violation is not None or j < 0:
                continue
            kept.setdefault(replace(move, in_flight=0), (i, move, j))
            if j not in parent:
                parent[j] = (i, move)
                todo.append(j)

    def run(i: int, move: Move, j: int) -> tuple[Step, ...]:
        taken = [(0, move, j)]
        here = parent[i]
        while here is not None:
            before, step = here
            taken.append((0, step, i))
            i, here = before, parent[before]
        return tuple(_steps(local, taken[::-1]))

    return tuple(run(*first) for first in kept.values())


# -- from node steps back to concrete requests --------------------------------------


def _concrete(
    local: LocalSystem, auto: Automaton, found: Search, hit: Found, requests: int
) -> tuple[list[tuple[int, int, Move, int]], list[int]]:
    """(request, local before, move, local after) per step, and every request's local state at the end.

    Under symmetry a step says only "some request at node i moves to node j";
    any request at node i will do, and any concrete move into node j (by the
    bisimulation, one exists).
    """
    at = [local.initial] * requests
    out: list[tuple[int, int, Move, int]] = []
    steps = path_to(found, hit)
    for number, step in enumerate(steps):
        last = number == len(steps) - 1 and hit.move is not None
        r = (
            step.slot
            if step.slot is not None
            else next(k for k in range(requests) if auto.node_of[at[k]] == step.source)
        )
        before = at[r]
        # The violating move breaks the property itself, except an overflow of the whole channel:
        # that move fits its own request, and it is the other requests' messages that fill the channel.
        flagged = hit.prop if last and (hit.prop != "overflow" or step.target < 0) else None
        for after, move in local.moves[before]:
            node = auto.node_of[after] if after >= 0 else -1
            if node == step.target and move.violation == flagged and (after >= 0 or last):
                break
        else:  # pragma: no cover - the automaton was built from these very moves
            raise AssertionError(f"no concrete move from local state {before} into node {step.target}")
        out.append((r, before, move, after))
        if after >= 0 and not (last and hit.prop == "overflow"):
            at[r] = after
    return out, at


def _freed(before: tuple[str, ...], after: tuple[str, ...]) -> str:
    """What a move takes and frees, in words."""
    taken = [x for x in after if x not in before]
    freed = [x for x in before if x not in after]
    return "; ".join(
        ([f"takes {', '.join(taken)}"] if taken else []) + ([f"frees {', '.join(freed)}"] if freed else [])
    )


def _words(local: LocalSystem, move: Move) -> str:
    role = local.roles[move.role]
    moved = _freed(role.holds[move.source], role.holds[move.target])
    parts = [moved] if moved else []
    spec = local.system.roles[role.name].spec
    for state in move.via:  # states that count to 0 on entry: their counted transition fired in the same move
        then = at_once(spec, role.states[state])
        assert then is not None  # Move.via holds only such states
        parts.append(f"{then.source} waits for 0 senders: {then.event} fires at once, → {then.target}")
    return "; ".join(parts)


def _violation_text(
    local: LocalSystem, found: Search, hit: Found, final: tuple[int, int, Move, int] | None, at: list[int]
) -> str:
    """What is wrong at the end of the trace, as the property's evaluator says it."""
    if final is not None and hit.move is not None:
        _r, before, move, _after = final
        moved = local.placed(local.states[before][0], move)
        # Messages in flight once the move is made: the other requests' (from the search state), then this one's.
        load = (hit.state & found.codec.mask) - local.nmsg[before] + move.in_flight
        broken = local.step_violation(moved, move, load)
        assert broken is not None and broken[0] == hit.prop, f"{hit.prop} not broken by its own move"
        return broken[1]
    r = final[0] if final is not None else 0
    return next(text for p, text in local.violations[at[r]] if p == hit.prop)


def _steps(local: LocalSystem, taken: list[tuple[int, Move, int]]) -> list[Step]:
    """The trace steps of (request, move, local state after) in order, each request begun before its first move."""
    names = [role.name for role in local.roles]
    steps: list[Step] = []
    for r in sorted({r for r, *_ in taken} or {0}):
        for role_no, role in enumerate(local.roles):
            start = local.role_state(local.initial, role_no)
            assert start is not None
            steps.append(
                Step(
                    f"r{r}", role.name, "begin", "begin", None, None, start, holds=role.holds[role.states.index(start)]
                )
            )
    for r, move, after in taken:
        role = local.roles[move.role]
        flight = local.in_flight(after) if after >= 0 else ()
        sent = tuple(Sent(local.message_names[m], names[local.receiver[m]], lost=not kept) for m, kept in move.sent)
        steps.append(
            Step(
                request=f"r{r}",
                role=role.name,
                action=move.action,
                cause=move.cause,
                event=move.event,
                source=role.states[move.source],
                target=role.states[move.target],
                sent=sent,
                duplicate=move.duplicate,
                holds=role.holds[move.target],
                in_flight=flight,
                note=_words(local, move),
            )
        )
        for k, event, source, target in move.owner:  # what the engine fired for a family, in the same move
            kin = local.roles[k]
            steps.append(
                Step(
                    request=f"r{r}",
                    role=kin.name,
                    action="fire",
                    cause="owner",
                    event=event,
                    source=kin.states[source],
                    target=kin.states[target],
                    holds=kin.holds[target],
                    in_flight=flight,
                    note=_freed(kin.holds[source], kin.holds[target]),
                )
            )
    return steps


def _roles(system: System) -> tuple[TraceRole, ...]:
    return tuple(TraceRole(name, r.path, r.spec.name, r.spec.key) for name, r in system.roles.items())


def _trace(system: System, local: LocalSystem, auto: Automaton, found: Search, hit: Found, requests: int) -> Trace:
    steps_taken, at = _concrete(local, auto, found, hit, requests)
    final = steps_taken[-1] if steps_taken else None
    culprit = f"r{final[0]}" if final is not None else "r0"
    return Trace(
        system=system.name,
        path=system.path,
        prop=hit.prop,
        violation=_violation_text(local, found, hit, final, at),
        request=culprit,
        roles=_roles(system),
        steps=tuple(_steps(local, [(r, move, after) for r, _b, move, after in steps_taken])),
    )


def _lasso_trace(system: System, local: LocalSystem, lasso: Lasso) -> Trace:
    """A lasso of request r0 as a trace: its prefix, then its cycle from ``loop`` on."""
    taken = [(0, move, after) for _b, move, after in (*lasso.prefix, *lasso.cycle) if move is not None]
    return Trace(
        system=system.name,
        path=system.path,
        prop=lasso.prop,
        violation=lasso.violation,
        request="r0",
        roles=_roles(system),
        steps=tuple(_steps(local, taken)),
        loop=len(lasso.prefix),
    )
