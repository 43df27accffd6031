"""Counts of zero known on entry: a counted transition that fires as its instance enters the state.

``count: K`` with K known on entry (a number or a param; guide §7) and K = 0
means nobody to wait for: the Tracker fires the counted event as the instance
enters the state, queued as a call an action made, so before the call that
entered the state returns. The explorer and the Promela export make that
firing part of the move that entered the state (nothing of another role can
happen in between); :func:`entering` is the one place that says which
transitions fire so.

A K that ``begin``'s payload gives is per instance: the explorer does not
know it, and takes every sender rank (:mod:`kvfsm.spec.system.loader`), so a
K = 0 from ``begin`` is not explored.
"""

from __future__ import annotations

from ..spec.model import Edge, Spec
from .limits import ExploreError


def at_once(spec: Spec, state: str) -> Edge | None:
    """The counted transition out of ``state`` whose K, known on entry, is 0 (the first one, as the Tracker
    queues them in order and only the first still finds the instance there), or None."""
    for (source, _event), edge in spec.table.items():
        if source != state or edge.transition.count is None:
            continue
        given = spec.count_source(edge.transition)
        if given is None:
            continue
        kind, value = given
        if kind == "number" and value == 0:
            return edge
        if kind == "param" and spec.params.get(str(value)) == 0:
            return edge
    return None


def entering(spec: Spec, state: str) -> tuple[Edge, ...]:
    """The transitions that fire at once, one after another, when an instance enters ``state``: empty unless
    ``state`` counts to 0 on entry; each one's target is where the next fires from.

    Raises :class:`ExploreError` for a ring of such states (the Tracker would never stop firing).
    """
    out: list[Edge] = []
    seen = {state}
    edge = at_once(spec, state)
    while edge is not None and edge.target in spec.states:  # an undeclared target is KVF106's
        out.append(edge)
        if edge.target in seen:
            ring = " → ".join([*(e.source for e in out), edge.target])
            raise ExploreError(
                f"machine {spec.name!r}: counts of 0 on entry fire round a ring ({ring}) forever; "
                "give one of them a count that waits for someone"
            )
        seen.add(edge.target)
        edge = at_once(spec, edge.target)
    return tuple(out)
