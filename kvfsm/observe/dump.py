"""A bounded JSON snapshot of a tracker: per state, how many, and the oldest few with what they hold.

For a debug endpoint: the output is capped however many instances are live
(``limit`` per state, a ``truncated`` flag), sorted oldest first, and the
tracker's lock is held only to copy its table once, never while the dump is
built.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..engine import Tracker

SHOWN = 200
"""Characters of a key or id shown; longer ones are cut."""


def state_dump(
    tracker: Tracker, *, limit: int = 10, entered: Mapping[Hashable, float] | None = None, now: float | None = None
) -> dict[str, Any]:
    """Per state: ``count`` and the ``limit`` oldest instances (key, age in seconds, generation, held, ids).

    Age is known from ``entered`` (when each instance entered its state, as
    :class:`~kvfsm.observe.metrics.TrackerMetrics` keeps it) or, for a state
    with a timeout, from its armed deadline; otherwise it is ``None`` and
    instances are listed in the order they were begun.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    spec = tracker.spec
    rows = tracker.snapshot()
    now = now if now is not None else tracker.clock()
    by_state: dict[str, list[tuple[Hashable, float | None]]] = {name: [] for name in spec.states}
    for key, state in rows:
        by_state[state].append((key, _age(tracker, key, entered, now)))
    states: dict[str, Any] = {}
    truncated = False
    for name, members in by_state.items():
        members.sort(key=lambda m: -(m[1] if m[1] is not None else -1.0))
        shown = members[:limit]
        truncated |= len(members) > limit
        states[name] = {
            "count": len(members),
            "final": spec.states[name].is_final,
            "oldest": [
                {
                    "key": _text(key),
                    "age": None if age is None else round(age, 3),
                    "generation": tracker.generation(key),
                    "held": list(tracker.held(key)),
                    "ids": {space: _text(ident) for space, ident in tracker.ids(key).items()},
                }
                for key, age in shown
            ],
            "truncated": len(members) > limit,
        }
    return {
        "machine": spec.name,
        "live": sum(1 for _k, s in rows if not spec.states[s].is_final),
        "states": states,
        "truncated": truncated,
    }


def _age(tracker: Tracker, key: Hashable, entered: Mapping[Hashable, float] | None, now: float) -> float | None:
    since = entered.get(key) if entered is not None else None
    since = since if since is not None else tracker.entered(key)
    return None if since is None else max(0.0, now - since)


def _text(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN] + "…"
