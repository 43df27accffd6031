"""Warn once about an instance that has spent most of its deadline in one state: observe-only.

A transfer that will expire usually looks stuck long before it does. A
:class:`StuckWatch` checked now and then (each scheduler step, or by the debug
endpoint's thread) logs one warning per instance per state once it has been
there ``fraction`` of the state's timeout, naming what it holds; it changes
nothing in the tracker.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine import Tracker

LOGGER = logging.getLogger("kvfsm.stuck")


class StuckWatch:
    """Logs ``key`` once per state when it has spent ``fraction`` of that state's timeout there."""

    def __init__(self, tracker: Tracker, *, fraction: float = 0.8, logger: logging.Logger = LOGGER) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(
                f"fraction must be in (0, 1], not {fraction!r}: the share of the deadline that counts as stuck"
            )
        self.tracker = tracker
        self.fraction = fraction
        self.logger = logger
        self.warned: dict[tuple[Hashable, int | None], str] = {}
        """(key, generation) → the state it was warned about."""

    def check(self, now: float | None = None) -> list[tuple[Hashable, str, float]]:
        """Warn about every instance newly found stuck; returns ``(key, state, seconds there)`` for each."""
        t = self.tracker
        now = t.now() if now is None else now
        found: list[tuple[Hashable, str, float]] = []
        seen: set[tuple[Hashable, int | None]] = set()
        for key, state in t.snapshot():
            after = t.timeout(state)
            due = t.due(key) if after else None
            if after is None or due is None:
                continue
            there = now - (due - after)
            if there < self.fraction * after:
                continue
            ident = (key, t.generation(key))
            seen.add(ident)
            if self.warned.get(ident) == state:
                continue
            self.warned[ident] = state
            found.append((key, state, there))
            self.logger.warning(
                "%s %r has been in %r for %.1f s of its %.1f s deadline, holding %s",
                t.spec.name,
                key,
                state,
                there,
                after,
                ", ".join(t.held(key)) or "nothing",
            )
        for ident in [i for i in self.warned if i not in seen]:
            del self.warned[ident]
        return found
