"""``eventually`` properties: fair infinite runs of one request that never finish, or never release, as lassos.

A liveness property is broken by an infinite run, and every infinite run of
a finite system ends in a cycle: the counterexample is a *lasso*, a prefix
from the initial state and a cycle repeated forever. Only *fair* cycles
count. The fairness assumed (and written again in the Promela export):

- **weak fairness of each role's own work**: an instance that stays where a
  local event or its timeout can fire eventually fires one of them (``abort``,
  the ``on_error`` event and the events a role declares ``environment:`` are
  the environment's and never owed);
- **weak fairness of delivery**: a message that stays deliverable is
  eventually delivered;
- **the channel misbehaves finitely often**: a fair run loses and duplicates
  only finitely many messages, so a fair cycle neither loses nor duplicates;
- **time passes**: a phase's deadline is armed on entering the phase and
  kept while the instance moves inside it, so an instance cannot stay in a
  phase forever (runs are non-Zeno: infinitely many steps take unbounded
  time, and the deadline fires by then). A fair run leaves each phase it
  enters, or stays out of it, infinitely often: a cycle that keeps an instance
  inside one phase throughout (retrying inside a lease) is no run;
- **weak fairness of progress**: an instance whose own work can take it to
  another state (a local event or a timeout into a different state) does not
  stay in its state forever: a cycle that keeps it there by self-loops (a
  retry, a re-lookup) or stutters while such a way out stays enabled is no
  run. Any move of the instance to another state honours it, so a loop
  through a second state is not excused.

A state where nothing is owed (nothing deliverable, no instance with local
work or a timeout) may last forever: that lasso has an empty cycle. The
Promela export writes the same obligations (:func:`kvfsm.gen.promela._liveness`).

The check runs on one request's local system. Requests share nothing but the
channel's capacity, and the capacity only makes a send be lost (an unfair
move in a cycle) or break ``overflow`` (a safety property of its own), so a
fair cycle of N requests that keeps one request from finishing is, seen from
that request, one of its own fair cycles.

Fair cycles are found per strongly connected component of the graph
restricted to the states the property needs (not finished; the resource
held): with weak fairness only, a component has a fair cycle exactly when
every obligation enabled in all its states is discharged by one of its
edges, since a cycle through every edge of the component is then fair and
a smaller one is never fairer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..spec.system import Property
from .local import RETIRED, LocalSystem, Move

Hop = tuple[int, Move | None, int]
"""(local state before, the move or ``None`` for staying put, local state after)."""


@dataclass(frozen=True, slots=True)
class Lasso:
    """A fair infinite run of one request that breaks an ``eventually`` property."""

    prop: str
    prefix: tuple[Hop, ...]
    cycle: tuple[Hop, ...]
    """Repeated forever; empty when the run stays at the prefix's end (nothing is owed there)."""
    violation: str


class Fairness:
    """What each local state owes (obligations enabled) and what each move discharges.

    Obligations, numbered: role r's own work (r), the delivery of message m
    (roles + m), leaving each phase (after those), then role r's progress
    (``leave + r``): owed where its own work can take it to another state
    (:meth:`~kvfsm.spec.system.System.leaves`), discharged by any move of r to
    another state. The Promela export numbers them the same way.
    """

    def __init__(self, local: LocalSystem) -> None:
        self.local = local
        self.nroles = len(local.roles)
        first = self.nroles + len(local.message_names)
        self.phases = [(first + j, slot) for j, slot in enumerate(s for s in local.clocks.slots if s.phase)]
        """(obligation, phase slot): "leave the phase", owed in its states and discharged by no move."""
        self.leave = first + len(self.phases)
        """Role r's progress obligation is ``leave + r``."""
        system = local.system
        self.leaving = [tuple(system.leaves(role.name, st) for st in role.states) for role in local.roles]
        """Per role, per state index: its own work can take it to another state."""
        self.enabled = [self._enabled(i) for i in range(len(local.states))]

    def _enabled(self, i: int) -> frozenset[int]:
        state = self.local.states[i]
        if state == RETIRED:
            return frozenset()
        at, flight, _bits = state
        owed = {
            r
            for r, role in enumerate(self.local.roles)
            if not role.final[at[r]] and any(c in ("local", "timeout") for _e, _t, _s, c, _v in role.spontaneous[at[r]])
        }
        owed |= {self.nroles + flight[pos] for pos in self.local.wire.deliverable(flight)}
        owed |= {k for k, slot in self.phases if slot.param[at[slot.role]] is not None}
        owed |= {self.leave + r for r, leaving in enumerate(self.leaving) if leaving[at[r]]}
        return frozenset(owed)

    def takes(self, move: Move | None) -> tuple[int, ...]:
        """The obligations ``move`` discharges: its role's own work (local work, a timeout) or its message's
        delivery, and its role's progress if it leaves its state; none for staying put."""
        if move is None:
            return ()
        done: tuple[int, ...]
        if move.cause == "message":
            done = (self.nroles + move.message,)
        elif move.cause in ("local", "timeout"):
            done = (move.role,)
        else:
            done = ()
        if move.action == "fire" and (move.source != move.target or move.via):
            done += (self.leave + move.role,)
        return done

    @staticmethod
    def fair_move(move: Move) -> bool:
        """Whether a move may repeat forever: it loses no message and leaves no duplicate in flight."""
        return not move.duplicate and all(kept for _m, kept in move.sent)


def _edges(local: LocalSystem, fair: Fairness, keep: Callable[[int], bool]) -> list[list[Hop]]:
    """Per local state: the fair moves that stay within ``keep``, self-loops and staying put included."""
    out: list[list[Hop]] = [[] for _ in local.states]
    for i in range(len(local.states)):
        if not keep(i):
            continue
        hops = out[i]
        for j, move in local.moves[i]:
            if j >= 0 and keep(j) and fair.fair_move(move):
                hops.append((i, move, j))
        hops.extend((i, move, i) for move in local.loops[i] if fair.fair_move(move))
        if not fair.enabled[i]:
            hops.append((i, None, i))
    return out


def _components(edges: list[list[Hop]]) -> Iterator[list[int]]:
    """Strongly connected components with at least one edge inside (iterative Tarjan)."""
    n = len(edges)
    index = [-1] * n
    low = [0] * n
    on_stack = [False] * n
    stack: list[int] = []
    counter = 0
    for root in range(n):
        if index[root] >= 0 or not edges[root]:
            continue
        work = [(root, 0)]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack[root] = True
        while work:
            v, k = work[-1]
            if k < len(edges[v]):
                work[-1] = (v, k + 1)
                w = edges[v][k][2]
                if index[w] < 0:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack[w] = True
                    work.append((w, 0))
                elif on_stack[w]:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack[w] = False
                    comp.append(w)
                    if w == v:
                        break
                members = set(comp)
                if any(h[2] in members for u in comp for h in edges[u]):
                    yield comp


def _is_fair(comp: list[int], edges: list[list[Hop]], fair: Fairness) -> bool:
    """Every obligation enabled throughout the component is discharged by one of its edges."""
    members = set(comp)
    owed = frozenset.intersection(*(fair.enabled[i] for i in comp))
    taken = {k for i in comp for h in edges[i] if h[2] in members for k in fair.takes(h[1])}
    return owed <= taken


def _bfs(edges: list[list[Hop]], start: int, goal: Callable[[Hop], bool], members: set[int]) -> list[Hop]:
    """The shortest path of hops from ``start``, inside ``members``, whose last hop meets ``goal``."""
    parent: dict[int, Hop] = {}
    seen = {start}
    queue = deque([start])
    while queue:
        u = queue.popleft()
        for hop in edges[u]:
            if hop[2] not in members or hop[1] is None:
                continue
            if goal(hop):
                path = [hop]
                while path[-1][0] != start:
                    path.append(parent[path[-1][0]])
                return path[::-1]
            if hop[2] not in seen:
                seen.add(hop[2])
                parent[hop[2]] = hop
                queue.append(hop[2])
    raise AssertionError("a strongly connected component is connected")  # pragma: no cover


def _cycle(comp: list[int], entry: int, edges: list[list[Hop]], fair: Fairness) -> list[Hop]:
    """A fair cycle through ``entry``: obligations discharged one by one, then back to ``entry``."""
    if not fair.enabled[entry]:
        return []  # nothing is owed here: the run may stay forever
    members = set(comp)
    walk: list[Hop] = []
    pos = entry
    owed = set(fair.enabled[entry])
    while owed:
        k = min(owed)

        def honours(hop: Hop, k: int = k) -> bool:
            return k in fair.takes(hop[1]) or k not in fair.enabled[hop[2]]

        path = _bfs(edges, pos, honours, members)
        walk += path
        for hop in path:
            owed &= fair.enabled[hop[2]]
            owed.difference_update(fair.takes(hop[1]))
        pos = walk[-1][2]
    if pos != entry or not walk:

        def home(hop: Hop) -> bool:
            return hop[2] == entry

        walk += _bfs(edges, pos, home, members)
    return walk


def _prefixes(local: LocalSystem) -> tuple[list[int], list[Hop | None]]:
    """Shortest distance from the initial state to every local state, and the last hop on that path."""
    n = len(local.states)
    dist = [-1] * n
    parent: list[Hop | None] = [None] * n
    dist[local.initial] = 0
    queue = deque([local.initial])
    while queue:
        u = queue.popleft()
        for j, move in local.moves[u]:
            if j >= 0 and dist[j] < 0:
                dist[j] = dist[u] + 1
                parent[j] = (u, move, j)
                queue.append(j)
    return dist, parent


def _path_to(parent: list[Hop | None], target: int) -> tuple[Hop, ...]:
    path = []
    hop = parent[target]
    while hop is not None:
        path.append(hop)
        hop = parent[hop[0]]
    return tuple(path[::-1])


def _goals(local: LocalSystem, prop: Property) -> Iterator[tuple[Callable[[int], bool], Callable[[int], str]]]:
    """(which states the property's failure stays in, what is wrong there) per way of breaking it."""
    roles = local.roles
    if prop.kind == "final":

        def unfinished(i: int) -> bool:
            state = local.states[i]
            return state != RETIRED and not all(role.final[state[0][r]] for r, role in enumerate(roles))

        def never_finishes(i: int) -> str:
            at = local.states[i][0]
            live = [f"{role.name} in {role.states[at[r]]}" for r, role in enumerate(roles) if not role.final[at[r]]]
            return f"the request never finishes: {', '.join(live)} forever"

        yield unfinished, never_finishes
        return
    for r, role in enumerate(roles):
        for resource in sorted({x for held in role.holds for x in held}):

            def holding(i: int, r: int = r, resource: str = resource) -> bool:
                state = local.states[i]
                return state != RETIRED and resource in roles[r].holds[state[0][r]]

            def keeps(_i: int, name: str = role.name, resource: str = resource) -> str:
                return f"{name} keeps {resource} forever: it is never released"

            yield holding, keeps


def find_lasso(local: LocalSystem, prop: Property, fair: Fairness | None = None) -> Lasso | None:
    """The shortest-prefix fair lasso breaking ``prop`` (``final`` or ``released``), or ``None`` if it holds."""
    fair = fair or Fairness(local)
    dist, parent = _prefixes(local)
    best: tuple[int, int, Lasso] | None = None
    for keep, text in _goals(local, prop):
        edges = _edges(local, fair, keep)
        for comp in _components(edges):
            if not _is_fair(comp, edges, fair):
                continue
            reached = [i for i in comp if dist[i] >= 0]
            if not reached:
                continue
            entry = min(reached, key=lambda i: (dist[i], i))
            cycle = _cycle(comp, entry, edges, fair)
            size = dist[entry] + len(cycle)
            if best is None or (size, dist[entry]) < best[:2]:
                best = (size, dist[entry], Lasso(prop.name, _path_to(parent, entry), tuple(cycle), text(entry)))
    return best[2] if best is not None else None
