"""Warn once about an instance that has spent most of its deadline in one state: observe-only.

A transfer that will expire usually looks stuck long before it does. A
:class:`StuckWatch` checked now and then (each scheduler step, or by the debug
endpoint's thread) logs one warning per instance per state once it has been
there for the state's ``warn_after`` (declared in the spec) or, for a state
with a timeout and no ``warn_after``, ``fraction`` of that timeout, naming
what it holds; it changes nothing in the tracker.

Stuck, not slow: an instance younger than its state's threshold is only
slow, however long it has been there; one past it is stuck. :func:`limits`
gives each state's deadline and threshold, which the state dump (and so
``/state`` and ``kvfsm top``) shows beside each instance's age.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, NamedTuple

from .view import View

if TYPE_CHECKING:
    from ..engine import Tracker

LOGGER = logging.getLogger("kvfsm.stuck")

FRACTION = 0.8
"""The share of a state's timeout after which an instance is stuck, where the spec declares no ``warn_after``."""


class Limits(NamedTuple):
    """A live state's deadline and the age past which an instance in it is stuck (None: it has none)."""

    timeout: float | None
    """Seconds the state's own timeout is armed for, params resolved."""
    stuck_after: float | None
    """The state's ``warn_after`` (seconds or a param), else ``fraction`` of its timeout."""


def limits(tracker: Tracker, fraction: float = FRACTION) -> dict[str, Limits]:
    """Every live state's :class:`Limits` on ``tracker`` (its params resolved): what tells stuck from slow."""
    out: dict[str, Limits] = {}
    for state in tracker.spec.live:
        after = tracker.timeout(state)
        declared = tracker.spec.states[state].warn_after
        stuck: float | None
        if declared is not None:
            stuck = tracker.params[declared].value if isinstance(declared, str) else float(declared)
        else:
            stuck = None if after is None else fraction * after
        out[state] = Limits(after, stuck)
    return out


class StuckWatch:
    """Logs ``key`` once per stay in a state that has lasted past the state's warning threshold.

    ``entered`` (as :class:`~kvfsm.observe.metrics.TrackerMetrics` keeps it)
    gives entry times for states without a timeout; without it only timed
    states can be watched.
    """

    def __init__(
        self,
        tracker: Tracker,
        *,
        fraction: float = FRACTION,
        entered: Mapping[Hashable, float] | None = None,
        logger: logging.Logger = LOGGER,
    ) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"fraction must be in (0, 1], not {fraction!r}: the share of the deadline that counts as stuck"
            )
        self.tracker = tracker
        self.fraction = fraction
        self.entered = entered
        self.logger = logger
        self.thresholds = {name: limit.stuck_after for name, limit in limits(tracker, fraction).items()}
        """Seconds in each live state after which an instance is stuck (None: not watched)."""
        self.warned: dict[Hashable, tuple[str, float]] = {}
        """Key → the stay it was warned about: (state, when it entered it). A new stay is warned about anew."""

    def check(self, now: float | None = None) -> list[tuple[Hashable, str, float]]:
        """Warn about every instance newly found stuck; returns ``(key, state, seconds there)`` for each.

        Reads one :class:`~kvfsm.observe.view.View` of the tracker (its lock
        taken once), and only the watched states' instances, oldest first,
        stopping at the first one that is not stuck yet.
        """
        t = self.tracker
        view = View.take(t, self.entered)
        now = view.now if now is None else now
        found: list[tuple[Hashable, str, float]] = []
        stuck: dict[Hashable, tuple[str, float]] = {}
        for state, group in view.groups.items():
            threshold = self.thresholds.get(state)
            if threshold is None:
                continue
            for since, key in group.aged_since():
                if now - since < threshold:
                    break  # oldest first: the rest are younger
                stay = stuck[key] = (state, since)
                if self.warned.get(key) == stay:
                    continue
                found.append((key, state, now - since))
                self.logger.warning(
                    "%s %r has been in %r for %.1f s (warned after %.1f s), holding %s",
                    t.spec.name,
                    key,
                    state,
                    now - since,
                    threshold,
                    ", ".join(view.live[key].holds) or "nothing",
                )
        self.warned = stuck
        return found
