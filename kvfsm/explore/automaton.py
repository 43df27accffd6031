"""The graph the global search runs on: one request's local system, optionally with look-alike states merged.

Two local states are merged when no property can tell them apart now or in
any future: they break the same properties, hold the same number of messages
in flight (the channel's capacity couples requests through that number), and
their moves lead, with the same property broken on the way, to merged states
again. That is a bisimulation, computed by partition refinement; it keeps
every verdict and the length of every shortest counterexample, and the trace
is mapped back onto concrete local states afterwards. For the PD abort system
it turns 129 local states into 49, which is what lets six requests finish in
seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .local import LocalSystem

OVERFLOW_TARGET = -1
"""Target of a move whose sends cannot fit the channel at all."""


@dataclass(frozen=True)
class Automaton:
    """Nodes (local states or classes of them) and their moves, in the flat form the search wants."""

    initial: int
    nmsg: tuple[int, ...]
    """Messages in flight per node."""
    succ: tuple[tuple[int, ...], ...]
    """Distinct successor nodes per node, self-loops left out."""
    flagged: tuple[tuple[tuple[int, str], ...], ...]
    """Per node: (target node or OVERFLOW_TARGET, property) for each move that itself breaks a property."""
    violations: tuple[tuple[str, ...], ...]
    """Per node: the properties the node itself breaks."""
    node_of: tuple[int, ...]
    """Local state id → node."""

    @property
    def size(self) -> int:
        return len(self.nmsg)


def build(local: LocalSystem, *, merge: bool) -> Automaton:
    """The search graph over ``local``: every local state a node, or (``merge``) one node per bisimulation class."""
    n = len(local.states)
    node_of = _classes(local) if merge else list(range(n))
    size = max(node_of) + 1
    nmsg = [0] * size
    violations: list[tuple[str, ...]] = [()] * size
    succ: list[dict[int, None]] = [{} for _ in range(size)]
    flagged: list[dict[tuple[int, str], None]] = [{} for _ in range(size)]
    for i in range(n):
        c = node_of[i]
        nmsg[c] = local.nmsg[i]
        violations[c] = tuple(sorted({p for p, _text in local.violations[i]}))
        for j, move in local.moves[i]:
            target = node_of[j] if j >= 0 else OVERFLOW_TARGET
            if move.violation is not None:
                flagged[c].setdefault((target, move.violation))
            if target != c and target != OVERFLOW_TARGET:
                succ[c].setdefault(target)
    return Automaton(
        initial=node_of[local.initial],
        nmsg=tuple(nmsg),
        succ=tuple(tuple(s) for s in succ),
        flagged=tuple(tuple(f) for f in flagged),
        violations=tuple(violations),
        node_of=tuple(node_of),
    )


def _classes(local: LocalSystem) -> list[int]:
    """Coarsest partition that respects violations, messages in flight and moves (naive signature refinement)."""
    n = len(local.states)
    keys: dict[object, int] = {}
    cls = [keys.setdefault((local.nmsg[i], frozenset(p for p, _t in local.violations[i])), len(keys)) for i in range(n)]
    count = len(keys)
    while True:
        keys = {}
        refined = [
            keys.setdefault(
                (
                    cls[i],
                    frozenset((move.violation, cls[j] if j >= 0 else OVERFLOW_TARGET) for j, move in local.moves[i]),
                ),
                len(keys),
            )
            for i in range(n)
        ]
        if len(keys) == count:
            break
        cls, count = refined, len(keys)
    # Number classes in order of first appearance so the initial state is node 0, deterministically.
    order: dict[int, int] = {}
    return [order.setdefault(c, len(order)) for c in cls]
