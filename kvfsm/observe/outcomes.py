"""Drain a tracker's finished instances and anomalies into counts: what a driver's stats say ended, and was dropped."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import Tracker
    from ..errors import Anomaly


def drain_outcomes(
    tracker: Tracker,
    outcomes: MutableMapping[str, int],
    anomalies: MutableMapping[str, int] | None = None,
    *,
    prefix: str = "",
) -> list[Anomaly]:
    """Drain ``tracker.finished()`` into ``outcomes`` and, given ``anomalies``, ``tracker.anomalies()`` into it.

    ``outcomes[prefix + final_state]`` counts the instances that ended in
    each final state (``prefix`` tells two trackers apart in one mapping:
    ``"send:"``, ``"load."``); ``anomalies["kind:space"]`` counts the events
    the tracker dropped, by kind and by the id space they were looked up in.
    Returns the anomalies drained (their ids, for a caller that keeps them);
    without ``anomalies`` none are drained, and the tracker keeps its last
    ones for whoever reads them.
    """
    for _key, final in tracker.finished():
        name = prefix + final
        outcomes[name] = outcomes.get(name, 0) + 1
    if anomalies is None:
        return []
    drained = tracker.anomalies()
    for anomaly in drained:
        name = f"{anomaly.kind}:{anomaly.space}"
        anomalies[name] = anomalies.get(name, 0) + 1
    return drained
