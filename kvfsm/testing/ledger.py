"""A driver that only keeps a ledger of what its actions took and gave back: the stand-in for a role with no driver.

Replaying a composition's trace needs a driver for every role, but you may
have real code for one side only. :class:`LedgerDriver` answers every action a
spec names and counts, per key, the resources its acquire and release actions
(and ``before_begin`` / ``before_fire``, for resources no action takes) left
held, so ``observe(key)`` works. It is bookkeeping, not a real system: a replay
with it checks what the Tracker asked the driver to do, not what a real
resource did.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Hashable
from functools import partial
from typing import Any

from ..spec import Spec


class LedgerError(RuntimeError):
    """A release for a resource the ledger says is not held: the engine released twice."""


class LedgerDriver:
    """Every action of ``spec``, recorded; ``observe(key)`` is what the calls left held.

    An action shared by several resources (one release for two of them) is
    called once per resource; each call takes or gives back the first of them
    that it can, in the spec's order.
    """

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.calls: list[tuple[str, Hashable]] = []
        """(action, key) per call, in order."""
        self._held: dict[Hashable, Counter[str]] = {}
        self._most = {r: max(1, *(st.holds.count(r) for st in spec.states.values())) for r in spec.resources}
        """How many units of each resource one instance can hold at once (more than 1: a counted holding)."""
        self._acquires: dict[str, list[str]] = {}
        self._releases: dict[str, list[str]] = {}
        for r in spec.resources.values():
            self._releases.setdefault(r.release, []).append(r.name)
            if r.acquire:
                self._acquires.setdefault(r.acquire, []).append(r.name)
        for t in spec.transitions:  # a transition's own release gives its resource back too
            for resource, action in t.release:
                if resource not in self._releases.setdefault(action, []):
                    self._releases[action].append(resource)
        clash = sorted(set(spec.actions()) & set(dir(LedgerDriver)))
        if clash:
            raise ValueError(f"actions {clash} of {spec.name!r} clash with LedgerDriver's own methods")

    def __getattr__(self, name: str) -> Callable[..., None]:
        """The spec's actions: the Tracker binds them with ``getattr`` like any driver method."""
        if name.startswith("_") or name not in self.spec.actions():
            raise AttributeError(f"{type(self).__name__} for {self.spec.name!r} has no action {name!r}")
        return partial(self._act, name)

    def _act(self, action: str, key: Hashable, /, **_payload: Any) -> None:
        self.calls.append((action, key))
        held = self._held.setdefault(key, Counter())
        taken = next((r for r in self._acquires.get(action, ()) if held[r] < self._most[r]), None)
        if taken is not None:
            held[taken] += 1
            return
        names = self._releases.get(action, ())
        given = next((r for r in names if held[r]), None)
        if given is not None:
            held[given] -= 1
        elif names and action not in self._acquires:
            raise LedgerError(f"{action}({key!r}) releases {', '.join(names)}, which {key!r} does not hold")

    def before_begin(self, key: Hashable, resources: Collection[str]) -> None:
        """The caller holds these before ``begin`` (resources of the initial state no acquire action takes)."""
        self._held.setdefault(key, Counter()).update(resources)

    def before_fire(self, key: Hashable, event: str, resources: Collection[str]) -> None:
        """The caller takes these before ``fire`` (the transition enters a state holding them, and no action does)."""
        self._held.setdefault(key, Counter()).update(resources)

    def observe(self, key: Hashable) -> dict[str, int]:
        """Each resource the calls left held, with how many units (a name per unit a spec lists)."""
        return {r: n for r, n in self._held.get(key, Counter()).items() if n}
