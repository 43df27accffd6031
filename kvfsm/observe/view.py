"""A copy of a tracker's state taken under one acquisition of its lock: what every reader in kvfsm.observe reads.

Asking the tracker once per instance (``entered(key)``, ``generation(key)``,
``ids(key)``) takes its lock once per instance: at 100,000 live instances a
dump then competes with the owner 100,000 times, and as the lock hands itself
to the oldest waiter, every one of those steps waits for the owner's next call
to end. :meth:`View.take` instead copies the tables a reader needs with C-level
dict copies inside one acquisition (milliseconds at 200,000 instances);
grouping, sorting and formatting run on the copy, outside the lock. Nothing
is written to the tracker: a read never assigns a generation.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from ..engine import Tracker
    from ..engine.program import CState
    from ..spec.model import Spec

_stamp = itemgetter(0)


@dataclass(frozen=True)
class Group:
    """The instances of one state, oldest first: those with a known entry time, then the rest in begin order."""

    aged: list[tuple[float, Hashable]]
    """``(stamp, key)`` sorted by stamp, where the key entered the state at ``stamp - offset``."""
    unaged: list[Hashable]
    """Keys whose entry time is unknown (an untimed state without ``entered``), in begin order."""
    offset: float = 0.0
    """What to take from a stamp to get an entry time: a timed state's ``after`` when stamps are its deadlines
    (the tracker's own ``(due, key)`` entries, so a timed state is grouped without a tuple made per key)."""

    def __len__(self) -> int:
        return len(self.aged) + len(self.unaged)

    def first(self) -> float | None:
        """When the oldest instance of known age entered the state (None: none has a known age)."""
        return self.aged[0][0] - self.offset if self.aged else None

    def oldest(self, limit: int) -> list[tuple[float | None, Hashable]]:
        """The ``limit`` oldest as ``(entered or None, key)``."""
        rows: list[tuple[float | None, Hashable]] = [(stamp - self.offset, key) for stamp, key in self.aged[:limit]]
        rows.extend((None, key) for key in self.unaged[: max(0, limit - len(rows))])
        return rows

    def aged_since(self) -> Iterator[tuple[float, Hashable]]:
        """Every instance of known age as ``(entered, key)``, oldest first."""
        offset = self.offset
        return ((stamp - offset, key) for stamp, key in self.aged)


@dataclass(frozen=True)
class View:
    """What a tracker held at one instant (``now`` on its clock); see the module docstring."""

    spec: Spec
    now: float
    live: dict[Hashable, CState]
    """Key → its instance's compiled state (final ones until drained), in begin order."""
    armed: dict[Hashable, tuple[float, Hashable]]
    """Key → its armed deadline ``(due, key)``: the entry time of a timed state is ``due - after``."""
    entered: dict[Hashable, float] | None
    """When each instance entered its state, as a caller (``TrackerMetrics(state_times=True)``) keeps it."""
    gens: dict[Hashable, int]
    linked: dict[Hashable, list[tuple[str, Hashable]]]
    links: dict[str, dict[Hashable, tuple[Hashable, int]]]
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def take(cls, tracker: Tracker, entered: Mapping[Hashable, float] | None = None) -> View:
        """Copy ``tracker``'s tables (and ``entered``, which its taps write under the same lock) in one acquisition.

        Only dict copies run under the lock; a ``Tracker.view()`` in the engine
        would let this stop reading its private tables (see docs/observability.md).
        """
        with tracker._guard:
            return cls(
                spec=tracker.spec,
                now=tracker.clock(),
                live=tracker._live.copy(),
                armed=tracker._armed.copy(),
                entered=None if entered is None else dict(entered),
                gens=tracker._gens.copy(),
                linked=tracker._linked.copy(),
                links={space: table.copy() for space, table in tracker._links.items()},
                counts=tracker.counts.copy(),
            )

    def census(self) -> dict[str, int]:
        """Instances per state, every state present (what ``Tracker.census`` answers)."""
        return {name: len(keys) for name, keys in self.members.items()}

    def holding(self) -> dict[str, int]:
        """Instances holding each resource (what ``Tracker.holding`` answers)."""
        out = dict.fromkeys(self.spec.resources, 0)
        for state, keys in self._members.items():
            for resource in state.holds:
                out[resource] += len(keys)
        return out

    def live_count(self) -> int:
        """Instances not yet in a final state."""
        return sum(len(keys) for state, keys in self._members.items() if not state.final)

    @cached_property
    def _members(self) -> dict[CState, list[Hashable]]:
        """Keys by compiled state, in begin order: the one pass over every instance a view makes."""
        members: dict[CState, list[Hashable]] = {}
        for key, state in self.live.items():
            try:
                members[state].append(key)
            except KeyError:
                members[state] = [key]
        return members

    @cached_property
    def members(self) -> dict[str, list[Hashable]]:
        """Keys by state name, every state present, in begin order."""
        out: dict[str, list[Hashable]] = {name: [] for name in self.spec.states}
        out.update((state.name, keys) for state, keys in self._members.items())
        return out

    @cached_property
    def groups(self) -> dict[str, Group]:
        """Every state's instances, oldest first; past the one pass of :attr:`members`, only C-level steps per key
        (maps, zips and sorts of nearly sorted lists), and no tuple made per key of a timed state."""
        groups = {name: Group([], []) for name in self.spec.states}
        for state, keys in self._members.items():
            groups[state.name] = self._group(state, keys)
        return groups

    def _group(self, state: CState, keys: list[Hashable]) -> Group:
        after, armed = state.after, self.armed
        if self.entered is None:
            if after is None:
                return Group([], keys)
            entries = list(map(armed.get, keys))  # all there: live and armed were copied together
            if None in entries:  # pragma: no cover - the tracker's invariant: armed iff in a timed state
                return Group([], keys)
            aged = cast("list[tuple[float, Hashable]]", entries)
            aged.sort(key=_stamp)
            return Group(aged, [], offset=after)
        stamps = list(map(self.entered.get, keys))
        if None not in stamps:
            aged = list(zip(cast("list[float]", stamps), keys, strict=True))
            aged.sort(key=_stamp)
            return Group(aged, [])
        aged, unaged = [], []  # some begun before entry times were kept: a timed state's deadline still tells
        for key, stamp in zip(keys, stamps, strict=True):
            entry = armed.get(key) if stamp is None and after is not None else None
            if stamp is not None:
                aged.append((stamp, key))
            elif entry is not None and after is not None:
                aged.append((entry[0] - after, key))
            else:
                unaged.append(key)
        aged.sort(key=_stamp)
        return Group(aged, unaged)

    def oldest_since(self) -> dict[str, float]:
        """When the oldest instance of each live state entered it; states with none of known age are left out."""
        firsts = {name: self.groups[name].first() for name in self.spec.live}
        return {name: since for name, since in firsts.items() if since is not None}

    def since(self, key: Hashable) -> float | None:
        """When ``key`` entered its state: from ``entered``, else from its armed deadline; None if unknown."""
        since = self.entered.get(key) if self.entered is not None else None
        if since is not None:
            return since
        state, entry = self.live.get(key), self.armed.get(key)
        if state is None or entry is None or state.after is None:
            return None
        return entry[0] - state.after

    def ids(self, key: Hashable) -> dict[str, Hashable]:
        """The ids linked to ``key``'s current instance, by space (what ``Tracker.ids`` answers)."""
        gen = self.gens.get(key)
        return {
            space: ident
            for space, ident in list(self.linked.get(key, ()))
            if self.links.get(space, {}).get(ident) == (key, gen)
        }
