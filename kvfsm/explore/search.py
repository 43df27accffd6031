"""Breadth-first search over N requests, each a copy of one automaton, coupled by the channel's capacity.

A global state is one Python int, so that the visited set holds small
immutable numbers and a successor costs one addition:

- with symmetry, requests are interchangeable and a state is the *multiset* of
  their nodes: a count per node packed into fixed-width bit fields, plus the
  number of messages in flight in the low bits. Moving one request from node
  i to node j adds ``unit[j] - unit[i] + nmsg[j] - nmsg[i]``; two states that
  differ only by which request is where are the same int;
- without symmetry, request k's node sits in bit field k: the state is the
  ordered tuple, exactly what the Promela export's SPIN run stores.

Each frontier entry carries its nodes as a tuple (sorted under symmetry) so a
state is expanded without decoding the int. Only the ints of each level are
kept (for counterexamples, found by walking back level by level), so memory
is the visited set plus one pointer per state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .automaton import OVERFLOW_TARGET, Automaton


@dataclass(frozen=True, slots=True)
class Progress:
    """What the search has done so far; handed to the progress callback."""

    states: int
    depth: int
    frontier: int
    transitions: int
    seconds: float

    @property
    def rate(self) -> float:
        """States per second so far."""
        return self.states / self.seconds if self.seconds > 0 else 0.0


ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True, slots=True)
class NodeStep:
    """One request moving from node ``source`` to node ``target`` (``slot``: its index without symmetry)."""

    slot: int | None
    source: int
    target: int


@dataclass(frozen=True, slots=True)
class Found:
    """The first (so shallowest) state or move breaking ``prop``."""

    prop: str
    depth: int
    """Steps from the initial state to the violation, the violating move included."""
    state: int
    nodes: tuple[int, ...]
    """The state where it holds, or, for a violating move, the state the move leaves."""
    move: tuple[int, int] | None = None
    """(source node, target node) of a violating move; target -1 for a send that cannot fit at all."""


STOPS = ("first", "max_states", "time_limit", "interrupted")
"""Why a search stopped before it was complete: the first violation (``first``), the state bound, the
time bound, or Ctrl-C (KeyboardInterrupt, caught so that what was found is kept)."""


@dataclass
class Search:
    """What a search found, and enough of its levels to walk back from any state to the start."""

    states: int
    transitions: int
    depth: int
    complete: bool
    seconds: float
    found: dict[str, Found]
    levels: list[list[int]] = field(repr=False)
    codec: _Codec = field(repr=False)
    stopped: str | None = None
    """One of :data:`STOPS` when the search stopped early; ``None`` when it ran to the end."""


class _Codec:
    """How nodes pack into one int; both layouts keep the number of messages in flight in the low bits."""

    def __init__(self, auto: Automaton, requests: int, capacity: int, symmetry: bool) -> None:
        self.auto = auto
        self.requests = requests
        self.symmetry = symmetry
        self.low = (2 * capacity + 1).bit_length()
        self.mask = (1 << self.low) - 1
        self.width = requests.bit_length() if symmetry else max(auto.size - 1, 1).bit_length()

    def unit(self, node: int, slot: int) -> int:
        """What one request at ``node`` (in ``slot``) adds to the state, messages aside."""
        field_no = node if self.symmetry else slot
        weight = 1 if self.symmetry else node
        return weight << (self.low + self.width * field_no)

    def delta(self, slot: int, i: int, j: int) -> int:
        nmsg = self.auto.nmsg
        return self.unit(j, slot) - self.unit(i, slot) + nmsg[j] - nmsg[i]

    def initial(self) -> tuple[int, tuple[int, ...]]:
        start = self.auto.initial
        nodes = (start,) * self.requests
        return sum(self.unit(start, k) for k in range(self.requests)) + self.auto.nmsg[start] * self.requests, nodes

    def place(self, nodes: tuple[int, ...], slot: int, node: int) -> tuple[int, ...]:
        if self.symmetry:
            return tuple(sorted((*nodes[:slot], node, *nodes[slot + 1 :])))
        return (*nodes[:slot], node, *nodes[slot + 1 :])


def search(
    auto: Automaton,
    *,
    requests: int,
    capacity: int,
    properties: tuple[str, ...],
    symmetry: bool = True,
    overflow: bool = False,
    first: bool = False,
    max_states: int | None = None,
    time_limit: float | None = None,
    progress: ProgressFn | None = None,
    report_every: int = 1 << 17,
) -> Search:
    """Explore every reachable global state; note the shallowest violation of each property.

    ``overflow``: a send into a full channel breaks the ``overflow`` property
    (the channel may not lose messages). ``first``: stop at the first
    violation. ``max_states`` / ``time_limit`` (seconds): stop there; the
    search is then incomplete. A KeyboardInterrupt (Ctrl-C) stops it too: it
    returns what it found so far, with ``stopped="interrupted"``; every
    violation it records can be walked back to the start, whenever the
    interrupt lands.
    """
    codec = _Codec(auto, requests, capacity, symmetry)
    wanted = set(properties)
    found: dict[str, Found] = {}
    start_clock = time.perf_counter()
    s0, nodes0 = codec.initial()
    seen = {s0}
    seen_add = seen.add
    levels: list[list[int]] = [[s0]]
    frontier: list[tuple[int, tuple[int, ...]]] = [(s0, nodes0)]
    fresh = [True] * auto.size
    fresh[auto.initial] = False
    for p in auto.violations[auto.initial]:
        if p in wanted:
            found.setdefault(p, Found(p, 0, s0, nodes0))
    flagged = [tuple(f for f in fl if f[1] in wanted) or None for fl in auto.flagged]
    nmsg = auto.nmsg
    mask = codec.mask
    transitions = 0
    depth = 0
    checkpoint = min(report_every, max_states or report_every)
    deadline = start_clock + time_limit if time_limit is not None else None

    def out_of_budget() -> str | None:
        """The bound the search has reached, if any."""
        if max_states is not None and len(seen) >= max_states:
            return "max_states"
        if deadline is not None and time.perf_counter() >= deadline:
            return "time_limit"
        return None

    def report() -> None:
        if progress is not None:
            progress(Progress(len(seen), depth, len(frontier), transitions, time.perf_counter() - start_clock))

    def note_node(node: int, state: int, nodes: tuple[int, ...]) -> None:
        fresh[node] = False
        for p in auto.violations[node]:
            if p in wanted and p not in found:
                found[p] = Found(p, depth + 1, state, nodes)

    def note_flagged(state: int, nodes: tuple[int, ...], i: int) -> None:
        total = state & mask
        for target, p in flagged[i] or ():
            if p in found:
                continue
            if target == OVERFLOW_TARGET or total - nmsg[i] + nmsg[target] <= capacity:
                found[p] = Found(p, depth + 1, state, nodes, (i, target))

    if symmetry:
        rows = [tuple((codec.delta(0, i, j), j) for j in auto.succ[i]) for i in range(auto.size)]
    else:
        rows_by_slot = [
            [tuple((codec.delta(k, i, j), j) for j in auto.succ[i]) for i in range(auto.size)] for k in range(requests)
        ]
    row_len = [len(s) for s in auto.succ]

    stopped = bool(first and found)
    why: str | None = "first" if stopped else None
    cut = False
    try:
        report()
        while frontier and not stopped:
            nxt: list[tuple[int, tuple[int, ...]]] = []
            nxt_append = nxt.append
            for state, nodes in frontier:
                prev = -1
                for k in range(requests):
                    i = nodes[k]
                    if symmetry:
                        if i == prev:
                            continue
                        prev = i
                        row = rows[i]
                    else:
                        row = rows_by_slot[k][i]
                    if flagged[i] is not None:
                        note_flagged(state, nodes, i)
                    transitions += row_len[i]
                    for d, j in row:
                        ns = state + d
                        if (ns & mask) > capacity:
                            if overflow and "overflow" in wanted and "overflow" not in found:
                                found["overflow"] = Found("overflow", depth + 1, state, nodes, (i, j))
                            continue
                        if ns in seen:
                            continue
                        seen_add(ns)
                        new_nodes = codec.place(nodes, k, j)
                        nxt_append((ns, new_nodes))
                        if fresh[j]:
                            note_node(j, ns, new_nodes)
                        if len(seen) >= checkpoint:
                            report()
                            checkpoint = min(checkpoint + report_every, max_states or checkpoint + report_every)
                            why = out_of_budget()
                            stopped = why is not None
                            if stopped:
                                break
                    if stopped:
                        break
                if stopped or (first and found):
                    why = why or "first"
                    stopped = cut = True
                    break
            if nxt:
                levels.append([s for s, _n in nxt])
                depth += 1
            frontier = nxt
            if not stopped:
                why = "first" if first and found else (out_of_budget() if frontier else None)
                stopped = why is not None
            report()
    except KeyboardInterrupt:
        why, cut = "interrupted", True
    complete = not frontier and not cut
    frontier = []
    return Search(
        states=len(seen),
        transitions=transitions,
        depth=depth,
        complete=complete,
        seconds=time.perf_counter() - start_clock,
        found=found,
        levels=levels,
        codec=codec,
        stopped=None if complete else why,
    )


def path_to(result: Search, hit: Found) -> list[NodeStep]:
    """The node steps from the initial state to ``hit`` (its violating move last), walking back level by level."""
    codec = result.codec
    auto = codec.auto
    pred: list[list[int]] = [[] for _ in range(auto.size)]
    for i, targets in enumerate(auto.succ):
        for j in targets:
            pred[j].append(i)
    steps: list[NodeStep] = []
    if hit.move is not None:
        i, j = hit.move
        slot = None if codec.symmetry else _slot_of(hit.nodes, i)
        steps.append(NodeStep(slot, i, j))
    state, nodes = hit.state, hit.nodes
    level = hit.depth - (1 if hit.move is not None else 0)
    while level > 0:
        before = set(result.levels[level - 1])
        state, nodes, step = _back(codec, pred, before, state, nodes)
        steps.append(step)
        level -= 1
    steps.reverse()
    return steps


def _slot_of(nodes: tuple[int, ...], node: int) -> int:
    return nodes.index(node)


def _back(
    codec: _Codec, pred: list[list[int]], before: set[int], state: int, nodes: tuple[int, ...]
) -> tuple[int, tuple[int, ...], NodeStep]:
    """A predecessor of ``state`` among ``before`` and the step between them."""
    tried: set[int] = set()
    for k, j in enumerate(nodes):
        if codec.symmetry and j in tried:
            continue
        tried.add(j)
        for i in pred[j]:
            prior = state - codec.delta(k, i, j)
            if prior in before:
                return prior, codec.place(nodes, k, i), NodeStep(None if codec.symmetry else k, i, j)
    raise AssertionError("a state of level d has no predecessor in level d-1")  # the search guarantees one
