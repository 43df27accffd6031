"""What a driver puts on the wire, held to the id space its spec says each message carries.

Two ids name one request across a P/D pair, and a message that names the
wrong one is dropped by the peer as ``unknown``: too late, and on the wrong
side, to say which line of which driver chose it. A spec declares what each
outgoing message carries (``outgoing: {read: {to: nixl_prefill, carries:
remote_request_id}}``); the driver reports every message it sends to its
:class:`Outbox` with the id it actually put on the wire; the outbox compares
that id with the one the tracker linked for the key in that space.

A mismatch is a ``misaddressed`` :class:`~kvfsm.Anomaly` of the tracker
(:meth:`Tracker.sent <kvfsm.Tracker.sent>`: counted, logged, journalled, so
``kvfsm replay --max misaddressed=0`` fails the run) and a
:class:`Misaddressed` record here, drained by the model-based tests, which
turn it into the failing story.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Hashable
from dataclasses import dataclass

from ..errors import KvfsmError
from ..spec import Spec
from .tracker import Tracker

LOGGER = logging.getLogger("kvfsm.anomalies")

__all__ = ["KEEP", "Misaddressed", "Outbox"]

KEEP = 1024
"""Misaddressed records kept until drained (the newest): a process that never drains them stays bounded."""


@dataclass(frozen=True)
class Misaddressed:
    """A message sent with an id from another space than the one its spec declares it carries."""

    message: str
    """The outgoing message's name in the spec."""
    to: str
    """The peer machine it went to."""
    key: Hashable
    """The instance that sent it."""
    sent: Hashable
    """The id that went on the wire."""
    belongs: str
    """What the sent id is, in words: ``the key (space request_id)``, an id of another instance, or unknown."""
    carries: str
    """The space the spec says the message's id comes from."""
    expected: Hashable | None
    """The id linked for ``key`` in ``carries`` (None: nothing was linked there)."""

    def __str__(self) -> str:
        linked = f"linked to {self.expected!r}" if self.expected is not None else f"with no id linked for {self.key!r}"
        return (
            f"sent {self.message} to {self.to} with {self.sent!r}, {self.belongs}; "
            f"the spec says it carries {self.carries}, {linked}"
        )


class Outbox:
    """The messages one driver sends, each held to the spec's ``outgoing:`` declaration by the tracker.

    The driver owns it (so it exists before any tracker) and calls
    :meth:`sent` once per message; whoever builds the tracker calls
    :meth:`bind`. Until bound nothing can be checked and :meth:`sent` only
    counts. The check itself is :meth:`Tracker.sent <kvfsm.Tracker.sent>`,
    so a misaddressed message is one of the tracker's anomalies (counted,
    logged, journalled); the outbox keeps the details for the model-based
    tests' story.
    """

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.tracker: Tracker | None = None
        self.counts: Counter[str] = Counter()
        """``sent`` and ``misaddressed`` messages, by kind."""
        self._found: deque[Misaddressed] = deque(maxlen=KEEP)

    def bind(self, tracker: Tracker) -> None:
        """Check what is sent from now on against ``tracker``'s links (its spec must be this outbox's)."""
        if tracker.spec.name != self.spec.name:
            raise KvfsmError(
                f"outbox of machine {self.spec.name!r} cannot check sends against a tracker of {tracker.spec.name!r}"
            )
        self.tracker = tracker

    def sent(self, key: Hashable, message: str, ident: Hashable) -> bool:
        """Report that ``key``'s instance sent ``message`` naming ``ident``; False when the id is from the wrong space."""
        carries = self.spec.carried_by(message)
        self.counts["sent"] += 1
        tracker = self.tracker
        if tracker is None or tracker.sent(key, message, ident):
            return True
        expected = key if carries == self.spec.key else tracker.ids(key).get(carries)
        to = self.spec.outgoing[message].to
        self._found.append(Misaddressed(message, to, key, ident, self._belongs(tracker, key, ident), carries, expected))
        self.counts["misaddressed"] += 1
        return False

    def misaddressed(self) -> list[Misaddressed]:
        """Drain the misaddressed messages found since the last call (the newest :data:`KEEP` of them)."""
        found = list(self._found)
        self._found.clear()
        return found

    def _belongs(self, tracker: Tracker, key: Hashable, ident: Hashable) -> str:
        """Which space ``ident`` is from, as far as the tracker knows: ``key``'s own ids first, then other instances'."""
        if ident == key:
            return f"the key (space {self.spec.key})"
        for space, linked in tracker.ids(key).items():
            if linked == ident:
                return f"{key!r}'s id in space {space}"
        if tracker.state(ident) is not None:
            return f"the key of another instance (space {self.spec.key})"
        for space in self.spec.spaces:
            other = tracker.route(space, ident)
            if other is not None:
                return f"{other!r}'s id in space {space}"
        return "an id no live instance has in any space"
