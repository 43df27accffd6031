"""Typed errors the runtime raises, and the records it keeps of what it refused."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .spec.findings import Finding

__all__ = [
    "ActionError",
    "Anomaly",
    "BindingError",
    "DuplicateKey",
    "Failure",
    "IllegalTransition",
    "KvfsmError",
    "PayloadError",
    "ReentrantCall",
    "SpecError",
    "TrackerClosed",
]


class KvfsmError(Exception):
    """Base of every error kvfsm raises."""


class SpecError(KvfsmError):
    """A spec that cannot be used: carries every error finding, each with file and line."""

    def __init__(self, findings: Iterable[Finding]) -> None:
        self.findings = tuple(findings)
        super().__init__("\n".join(str(f) for f in self.findings))


class IllegalTransition(KvfsmError):
    """An event that is neither a transition nor ignored in the instance's state; nothing changed."""

    def __init__(self, key: Hashable, event: str, state: str, accepted: Sequence[str]) -> None:
        self.key, self.event, self.state, self.accepted = key, event, state, tuple(accepted)
        ok = ", ".join(self.accepted) or "nothing"
        super().__init__(
            f"{key!r} is in state {state!r}, where {event!r} is neither a transition nor ignored (state unchanged). {state!r} accepts: {ok}."
        )


Phase = Literal["do", "acquire", "release", "observer", "queued", "refused", "link"]
"""Where a failure happened: a driver action of that kind, the observer, a call an action queued, or
(in ``fire_many``) an event a key's state neither handles nor ignores, or an id the spec says to link that
names another live instance already."""


@dataclass(frozen=True, slots=True)
class Failure:
    """One driver action that raised: which, for whom, and where the instance ended up."""

    key: Hashable
    event: str
    action: str
    phase: Phase
    error: BaseException
    state: str
    """The state the instance was in once the failure had been handled."""

    def __str__(self) -> str:
        return f"{self.phase} action {self.action!r} raised {type(self.error).__name__}: {self.error} (key {self.key!r}, event {self.event!r}; now in {self.state!r})"


class ActionError(KvfsmError):
    """Driver actions raised. The instances are already in defined states (see each Failure).

    ``result`` is what the call would have returned had nothing raised: the
    new state for ``fire``, the timeouts that fired for ``poll``.
    """

    def __init__(self, failures: Sequence[Failure], result: Any = None) -> None:
        self.failures = tuple(failures)
        self.result = result
        lines = "\n  ".join(str(f) for f in self.failures)
        super().__init__(f"{len(self.failures)} driver action(s) failed:\n  {lines}")
        if self.failures:
            self.__cause__ = self.failures[0].error


class BindingError(KvfsmError):
    """A driver that lacks methods the spec names, or params the spec does not declare."""


class DuplicateKey(KvfsmError):
    """``begin`` for a key whose instance is still live."""


class UnknownParent(KvfsmError, LookupError):
    """``begin`` of a child (``owns:``) naming a parent with no live instance; nothing begun."""


class TrackerClosed(KvfsmError):
    """The tracker was closed; it accepts no more events."""


class ReentrantCall(KvfsmError):
    """A call a driver action may not make on its own tracker (``poll`` or ``close``); nothing changed."""


class PayloadError(KvfsmError, TypeError):
    """``fire``/``begin`` given payload keys the spec does not declare for that event; nothing changed."""


AnomalyKind = Literal["unknown", "late", "stale", "forced", "misaddressed", "duplicate", "early"]


@dataclass(frozen=True, slots=True)
class Anomaly:
    """An event that could not be applied and was counted instead of raised.

    ``unknown``: no instance ever had that id (in memory of the tracker: a
    wrong id, or one from the wrong space); ``late``: the id named an instance
    that has finished and been drained (a late or duplicate message, a fact of
    life); ``stale``: the id belongs to an earlier generation of a reused key;
    ``forced``: ``close()`` had to release an instance that abort could not
    finish; ``misaddressed``: a message this side sent named an id from
    another space than the one its spec says it carries (``space`` is that
    declared space, ``event`` the outgoing message; see
    :mod:`kvfsm.engine.outbox`); ``duplicate``: a counted event from a
    sender already heard during this stay in the state (``count:``), never
    counted twice; ``early``: a message of an ``early:`` event kept for an
    id not yet known, dropped because its window passed, the bound was full or
    the tracker closed.
    """

    kind: AnomalyKind
    space: str
    id: Hashable
    event: str
