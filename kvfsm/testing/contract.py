"""The driver contract of kvfsm.testing: what a driver offers beyond its spec's actions, as typing Protocols.

A driver is any object with a method for each action its spec names (the
Tracker checks those when it binds). To be model-tested it also reports what
it really holds (:class:`ObservableDriver`); the other protocols are optional
capabilities that kvfsm.testing uses when a driver has them, found by
``callable(getattr(driver, name, None))``:

- :class:`FaultInjecting`: faults on demand, so the on_error paths are tested;
- :class:`TakesBeforeBegin`: required when the initial state holds a resource
  that no acquire action takes (the caller takes it before ``begin``);
- :class:`TakesBeforeFire`: used by trace replay when a transition enters a
  state holding a resource that no action takes;
- :class:`ReportsSends`: an ``outbox`` (:class:`~kvfsm.engine.outbox.Outbox`)
  the driver reports each message it sends to; the test binds it to its
  tracker and fails a message whose id is from another space than the
  spec's ``outgoing:`` says it carries;
- :class:`ReceivesMessages`: ``receive(event, ident, payload)``, what the
  driver's code does with a peer's message before the Tracker gets it; the
  test calls it with every message, and fails a driver that drops one the
  spec applies, counts or keeps.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from ..engine.outbox import Outbox


@runtime_checkable
class ObservableDriver(Protocol):
    """Required for model-based tests: ``observe(key)`` reads reality, so tests compare it with the spec."""

    def observe(self, key: Hashable, /) -> Iterable[str] | Mapping[str, int]:
        """The names of the resources the driver really holds for ``key`` now (a set, usually), or each name with
        how many units it holds (``{"block_pin": 2}``), which a spec holding a resource more than once needs.

        Read them from the real system (block-pool holders, queue entries, the
        store's counters), never from a log of the calls made: the test then
        checks what the driver left behind, not what it was asked to do.
        """
        ...


@runtime_checkable
class FaultInjecting(Protocol):
    """Optional: make one action raise on demand; a driver without it is tested without faults."""

    def inject_fault(self, action: str, /) -> bool:
        """Make the next call of ``action``, for whichever key comes first, raise.

        Return True when the fault is armed; False when this driver cannot make
        ``action`` raise (the test then expects no failure). The model-based
        test calls it just before the step that will make that call.
        """
        ...


@runtime_checkable
class TakesBeforeBegin(Protocol):
    """Required when the initial state holds a resource that no acquire action takes."""

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> None:
        """Do what your code does before ``Tracker.begin(key)`` (e.g. pin the request's blocks), so observe sees it."""
        ...


@runtime_checkable
class TakesBeforeFire(Protocol):
    """Optional, for trace replay: take what a transition's target holds that no action takes."""

    def before_fire(self, key: Hashable, event: str, resources: Collection[str], /) -> None:
        """Do what your code does before ``Tracker.fire(key, event)`` when the new state holds ``resources``."""
        ...


@runtime_checkable
class ReportsSends(Protocol):
    """Optional: what the driver puts on the wire, for specs that declare ``outgoing:`` messages."""

    outbox: Outbox
    """Called once per message sent (``outbox.sent(key, message, id_on_the_wire)``), with the id as it goes out."""


@runtime_checkable
class ReceivesMessages(Protocol):
    """Optional: the driver's receive path, for specs whose events are a peer's messages (``events:``, counted)."""

    def receive(self, event: str, ident: Hashable, payload: Mapping[str, Any], /) -> bool | None:
        """Do what your code does with a message of ``event`` naming ``ident`` before it hands it to the Tracker
        (``fire``/``deliver``): parse it, look the request up, keep a table. ``payload`` is what it carries, its
        ``sender`` included where the spec counts it. Return False where your code does not hand it on.

        What it does shows in ``observe``: a driver that frees on a message the
        spec only counts is caught there. A dropped message must be one the spec
        refuses anyway (an unknown, late or stale id of an event not declared
        early, an ignored event, a repeat from a sender already heard); one the
        spec applies, counts or keeps for an id not yet known is a divergence.
        """
        ...


DriverFactory = Callable[[], ObservableDriver]
"""Called with no arguments; must return a fresh driver each time (one per example)."""

OwnedFactory = Callable[[Any], ObservableDriver]
"""The driver factory of a machine another owns (``owns:``): called with the owner's driver of the same example
(whatever the two share: a block pool, the report to vLLM), it must return a fresh driver."""


def can_inject_faults(driver: object) -> bool:
    """Whether ``driver`` offers :class:`FaultInjecting` (a method, not merely an attribute of that name)."""
    return callable(getattr(driver, "inject_fault", None))


__all__ = [
    "DriverFactory",
    "FaultInjecting",
    "ObservableDriver",
    "OwnedFactory",
    "ReceivesMessages",
    "ReportsSends",
    "TakesBeforeBegin",
    "TakesBeforeFire",
    "can_inject_faults",
]
