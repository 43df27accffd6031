"""A machine that owns instances of another (``owns:``): which children each parent instance has live.

"A request finishes sending when the last of its store jobs has let go of
its blocks" is a lifecycle fact. Kept by hand in a driver it is a per-request
counter, and seed 000 was such a counter that one exception path forgot to
decrement. Here the engine keeps it: a child tracker names its parent at
``begin`` (its begin payload key ``by``), and the parent's spec says what the
parent does when its children end (``ended``), when one fails (``failed``),
and which of its own events reach every live child (``forward``).

Parent and children share one lock, so a child's end can fire on its parent
and a parent's abort reach its children in the same call, in either
direction, without a lock order to get wrong.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ActionError, BindingError, Failure, KvfsmError, PayloadError, UnknownParent
from ..spec.model import Owned

if TYPE_CHECKING:
    from .tracker import Tracker


class Owner:
    """One ``owns:`` entry at run time: the parent tracker, the child tracker, and the live children per parent.

    Every method runs under the family's one lock, inside a tracker call.
    """

    __slots__ = ("child", "children", "parent", "parent_of", "rule")

    def __init__(self, parent: Tracker, child: Tracker, rule: Owned) -> None:
        self.parent, self.child, self.rule = parent, child, rule
        self.children: dict[Hashable, set[Hashable]] = {}
        """Parent key → its children not yet in a final state. A parent with none has no entry."""
        self.parent_of: dict[Hashable, Hashable] = {}
        """Live child key → its parent's key."""

    @classmethod
    def attach(cls, parent: Tracker, child: Tracker) -> Owner:
        """Find the ``owns:`` entry of ``parent``'s spec that runs ``child``'s machine; check the two agree."""
        rules = [o for o in parent.spec.owns.values() if o.machine == child.spec.name]
        if not rules:
            owned = ", ".join(f"{o.name} ({o.machine})" for o in parent.spec.owns.values()) or "nothing"
            raise BindingError(
                f"machine {parent.spec.name!r} does not own instances of {child.spec.name!r} (it owns: {owned}); "
                f"add 'owns: {{<name>: {{machine: {child.spec.name}, by: <begin payload key>, ended: <event>}}}}'"
            )
        rule = rules[0]
        if rule.by not in child.spec.begin_payload:
            raise BindingError(
                f"owns {rule.name!r}: machine {child.spec.name!r} must carry its parent's {parent.spec.key} in its "
                f"begin payload as {rule.by!r}; add 'begin: {{payload: [{rule.by}, ...]}}' to its spec"
            )
        for event in rule.forward:
            for state in child.spec.live:
                if (state, event) not in child.spec.table and (state, event) not in child.spec.ignores:
                    raise BindingError(
                        f"owns {rule.name!r} passes {event!r} on to {child.spec.name!r}, whose state {state!r} "
                        f"neither takes nor ignores it; add {state!r} to the 'from' of its {event!r} transition"
                    )
        if parent.live() or child.live():
            raise BindingError(f"attach {child.spec.name!r} to {parent.spec.name!r} before either begins instances")
        return cls(parent, child, rule)

    # -- the child's side ------------------------------------------------------

    def parent_for(self, key: Hashable, payload: Mapping[str, Any]) -> Hashable:
        """The live parent a child about to begin names; raises (nothing begun) if it names none."""
        by = self.rule.by
        if by not in payload:
            raise PayloadError(
                f"begin of machine {self.child.spec.name!r} must carry {by!r}, the {self.parent.spec.key} of the "
                f"{self.parent.spec.name!r} that owns it; nothing changed"
            )
        parent: Hashable = payload[by]
        state = self.parent.state(parent)
        if state is None or self.parent.spec.states[state].is_final:
            where = "has no live instance" if state is None else f"has ended ({state})"
            raise UnknownParent(
                f"{self.child.spec.name} {key!r} names {self.parent.spec.name} {parent!r} as its owner, which {where}; "
                f"begin the {self.parent.spec.name} first, and no child after it has ended"
            )
        return parent

    def adopt(self, key: Hashable, parent: Hashable) -> None:
        """``key`` has begun as a child of ``parent``."""
        self.children.setdefault(parent, set()).add(key)
        self.parent_of[key] = parent

    def ended(self, key: Hashable, failed: bool) -> None:
        """A child reached a final state (or was forced out on close): tell its parent, if it still listens."""
        parent = self.parent_of.pop(key, None)
        if parent is None:
            return
        live = self.children.get(parent)
        if live is None:  # the parent ended first (detached)
            return
        live.discard(key)
        if not live:
            del self.children[parent]
        # Each poke on its own: a parent action that raised on ``failed`` must not cost the parent its ``ended``
        # (it would wait for children that are gone, holding what they no longer use).
        if failed and self.rule.failed is not None:
            self._poke(parent, self.rule.failed, None)
        if not live:
            self._poke(parent, self.rule.ended, self)

    def _poke(self, parent: Hashable, event: str, owner: Owner | None) -> None:
        try:
            self.parent._poke(parent, event, owner)
        except ActionError as exc:  # the parent's actions failed: the child's caller hears of it
            self.child._failures.extend(exc.failures)

    # -- the parent's side -------------------------------------------------------

    def idle(self, parent: Hashable) -> bool:
        """Whether ``parent`` has no live child."""
        return parent not in self.children

    def live(self, parent: Hashable) -> frozenset[Hashable]:
        return frozenset(self.children.get(parent, ()))

    def entered(self, parent: Hashable) -> None:
        """The parent entered a state that takes ``ended``: fire it now if no child is live."""
        if parent not in self.children:
            self.parent._poke(parent, self.rule.ended, self)

    def pass_on(self, parent: Hashable, event: str) -> None:
        """Fire ``event`` on each live child of ``parent`` (queued if the child tracker is mid-call)."""
        for key in sorted(self.children.get(parent, ()), key=repr):  # a set: repr order, so runs repeat
            try:
                self.child.fire(key, event)
            except ActionError as exc:
                self.parent._failures.extend(exc.failures)
            except KvfsmError as exc:
                state = self.child.state(key) or "(none)"
                self.parent._failures.append(Failure(key, event, "<forward>", "refused", exc, state))

    def detach(self, parent: Hashable) -> None:
        """The parent reached a final state: its children's ends no longer concern it."""
        self.children.pop(parent, None)
