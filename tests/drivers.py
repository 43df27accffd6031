"""A recording, fault-injecting driver for tests: a real driver object, not a mock of the engine.

``recording_driver(spec)`` builds a driver class with one method per action the
spec names. Each call is recorded as a :class:`Call` (action, key, payload);
``fail_next(action, key)`` makes the next call of that action (or of any
action), for that key (or any key), raise :class:`InjectedFault`. Because it counts acquire and release calls per
key, it can say what the engine really left acquired (:meth:`outstanding`) and
whether it ever released something it never acquired (:meth:`over_released`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from kvfsm import Spec

ANY = None
"""``fail_next(ANY)``: the next call of whatever action comes first raises."""


@dataclass(frozen=True)
class Call:
    action: str
    key: Hashable
    payload: tuple[tuple[str, Any], ...]
    raised: bool


class InjectedFault(RuntimeError):
    """The error a driver raises when told to; equal faults compare equal across drivers."""

    def __init__(self, action: str, key: Hashable) -> None:
        super().__init__(f"injected fault in {action}({key!r})")
        self.action, self.key = action, key


class RecordingDriver:
    """Base of the generated drivers; see :func:`recording_driver`."""

    spec: Spec
    resource_of_acquire: dict[str, str]
    """acquire action -> its resource, for resources whose acquire and release actions are theirs alone."""
    resource_of_release: dict[str, str]

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._faults: list[tuple[str | None, Hashable | None]] = []
        self._balance: Counter[tuple[Hashable, str]] = Counter()

    def fail_next(self, action: str | None = ANY, key: Hashable | None = None) -> None:
        """Make the next call of ``action`` (``ANY``: of any action) for ``key`` (None: any) raise."""
        if action is not None and action not in self.spec.actions():
            raise ValueError(f"{action!r} is not an action of {self.spec.name!r}: {self.spec.actions()}")
        self._faults.append((action, key))

    def pending_faults(self) -> tuple[tuple[str | None, Hashable | None], ...]:
        """Faults armed and not yet spent, oldest first."""
        return tuple(self._faults)

    def clear_faults(self) -> None:
        self._faults.clear()

    def _act(self, action: str, key: Hashable, payload: dict[str, Any]) -> None:
        fault = next(
            (i for i, (a, k) in enumerate(self._faults) if a in (None, action) and (k is None or k == key)), None
        )
        raised = fault is not None
        self.calls.append(Call(action, key, tuple(sorted(payload.items())), raised))
        if action in self.resource_of_release:
            self._balance[key, self.resource_of_release[action]] -= 1
        if fault is not None:
            del self._faults[fault]
            raise InjectedFault(action, key)
        if action in self.resource_of_acquire:
            self._balance[key, self.resource_of_acquire[action]] += 1

    def outstanding(self, key: Hashable) -> set[str]:
        """Resources with an acquire action that ``key`` acquired and was not yet released.

        A release call counts even if it raised: the engine did its part.
        """
        return {r for (k, r), n in self._balance.items() if k == key and n > 0}

    def over_released(self) -> set[tuple[Hashable, str]]:
        """(key, resource) released more often than acquired: must always be empty."""
        return {kr for kr, n in self._balance.items() if n < 0}


def _method(action: str) -> Callable[..., None]:
    def method(self: RecordingDriver, key: Hashable, /, **payload: Any) -> None:
        self._act(action, key, payload)

    method.__name__ = action
    return method


def recording_driver(spec: Spec) -> RecordingDriver:
    """A new driver with a recording method for every action ``spec`` names."""
    reserved = set(dir(RecordingDriver))
    clash = [a for a in spec.actions() if a in reserved]
    if clash:
        raise ValueError(f"actions {clash} of {spec.name!r} clash with RecordingDriver's own attributes")
    acquire_users = Counter(r.acquire for r in spec.resources.values() if r.acquire)
    release_users = Counter(r.release for r in spec.resources.values())
    tracked = [
        r
        for r in spec.resources.values()
        if r.acquire and acquire_users[r.acquire] == 1 and release_users[r.release] == 1 and r.acquire != r.release
    ]
    namespace: dict[str, Any] = {action: _method(action) for action in spec.actions()}
    namespace["spec"] = spec
    namespace["resource_of_acquire"] = {r.acquire: r.name for r in tracked}
    namespace["resource_of_release"] = {r.release: r.name for r in tracked} | {
        action: r for t in spec.transitions for r, action in t.release if r in {x.name for x in tracked}
    }  # a transition's own release (release:) gives its resource back too
    cls = type(f"{spec.name.title().replace('_', '')}Driver", (RecordingDriver,), namespace)
    driver: RecordingDriver = cls()
    return driver


class Pins:
    """A driver for one-resource specs: ``pin`` (any payload) holds the key, ``unpin`` lets go; ``observe``
    says what a leak would show. Used where a test is about the engine's rules, not the driver's calls."""

    def __init__(self, resource: str = "blocks") -> None:
        self.resource = resource
        self.held: set[Hashable] = set()

    def pin(self, key: Hashable, /, **_: Any) -> None:
        self.held.add(key)

    def unpin(self, key: Hashable, /) -> None:
        self.held.discard(key)

    def observe(self, key: Hashable) -> set[str]:
        return {self.resource} if key in self.held else set()
