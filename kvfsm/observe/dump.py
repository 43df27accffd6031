"""A bounded JSON snapshot of a tracker: per state, how many, and the oldest few with what they hold.

For a debug endpoint: the output is capped however many instances are live
(``limit`` per state, a ``truncated`` flag), sorted oldest first. The
tracker's lock is taken once, to copy its tables (:class:`~kvfsm.observe.view.View`),
never once per instance and never while the dump is built.

Each live state names its deadline (``timeout``) and the age past which an
instance in it is stuck (``stuck_after``, :func:`~kvfsm.observe.stuck.limits`),
and each instance listed says whether it is (``stuck``): an old instance
below the threshold is slow, not stuck.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from .stuck import Limits, limits
from .view import View

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
    instances are listed in the order they were begun. ``generation`` is the
    one the tracker has assigned, or ``None``: a dump assigns none.
    """
    check_limit(limit)
    return dump_view(View.take(tracker, entered), limit=limit, now=now, limits=limits(tracker))


NO_LIMITS = Limits(None, None)
"""A final state's (or an unknown tracker's): no deadline, never stuck."""


def check_limit(limit: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ValueError(f"limit must be a whole number >= 0, not {limit!r}")


def dump_view(
    view: View, *, limit: int, now: float | None = None, limits: Mapping[str, Limits] | None = None
) -> dict[str, Any]:
    """:func:`state_dump` of a view already taken: bounded work, ``limit`` rows per state.

    ``limits`` (:func:`~kvfsm.observe.stuck.limits` of the view's tracker)
    gives each state's ``timeout`` and ``stuck_after``; without it they are None.
    """
    check_limit(limit)
    spec = view.spec
    now = view.now if now is None else now
    states: dict[str, Any] = {}
    truncated = False
    for name, group in view.groups.items():
        state = spec.states[name]
        cut = len(group) > limit
        truncated |= cut
        timeout, stuck_after = limits.get(name, NO_LIMITS) if limits is not None else NO_LIMITS
        rows = []
        for since, key in group.oldest(limit):
            age = None if since is None else round(max(0.0, now - since), 3)
            rows.append(
                {
                    "key": _text(key),
                    "age": age,
                    "stuck": age is not None and stuck_after is not None and age >= stuck_after,
                    "generation": view.gens.get(key),
                    "held": list(view.live[key].holds),
                    "ids": {space: _text(ident) for space, ident in view.ids(key).items()},
                }
            )
        states[name] = {
            "count": len(group),
            "final": state.is_final,
            "timeout": timeout,
            "stuck_after": stuck_after,
            "oldest": rows,
            "truncated": cut,
        }
    return {"machine": spec.name, "live": view.live_count(), "states": states, "truncated": truncated}


def _text(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return value
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= SHOWN else text[:SHOWN] + "…"
