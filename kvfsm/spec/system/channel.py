"""The channel between the roles: what it may do to a message, and what send and delivery do to those in flight.

These rules are written once: the explorer runs them over message ids to
build each request's moves, and a trace's checks and its replay run them over
the steps of a trace (:class:`Traffic`). A request's messages in flight are a
tuple of message ids:

- a sent message is kept, or lost when the channel may lose messages;
- a kept message joins the request's flight: a sorted multiset when the
  channel reorders, else in send order per direction (sender → receiver);
- a message may arrive when the channel reorders; otherwise only the oldest
  of its direction may;
- delivery takes the message out of flight, or leaves a copy in flight when
  the channel may duplicate messages;
- the channel holds at most ``capacity`` messages, all requests together; a
  send that does not fit is lost when the channel may lose messages, and breaks
  the ``overflow`` property otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import product
from typing import TYPE_CHECKING

from ..model import NOWHERE, Loc

if TYPE_CHECKING:
    from .model import Message

Flight = tuple[int, ...]
"""One request's messages in flight, as message ids (see :class:`Wire`)."""


@dataclass(frozen=True, slots=True)
class Channel:
    """What may happen to a message between send and delivery.

    ``capacity`` bounds the messages in flight at once, all requests and both
    directions together. A send that does not fit is lost when ``loss`` is
    allowed and an ``overflow`` violation otherwise. ``duplicate`` lets a
    delivered message stay in flight (it may arrive again); without
    ``reorder`` each request's messages arrive in send order per direction.
    """

    loss: bool = True
    duplicate: bool = True
    reorder: bool = True
    capacity: int = 2
    loc: Loc = NOWHERE

    def fates(self, count: int) -> Iterator[tuple[bool, ...]]:
        """Every way ``count`` sends may fare, each message kept (True) or lost (only if the channel may lose it)."""
        return product(*[(True, False) if self.loss else (True,) for _ in range(count)])

    def overflows(self, load: int) -> bool:
        """Whether ``load`` messages in flight break ``overflow``: more than fit, on a channel that may not lose one."""
        return load > self.capacity and not self.loss


class Wire:
    """The channel's rules over message ids: where a sent message joins the flight, which may arrive next."""

    def __init__(self, channel: Channel, messages: Sequence[Message]) -> None:
        self.channel = channel
        self.names = tuple(m.name for m in messages)
        self.ids = {name: i for i, name in enumerate(self.names)}
        directions: dict[tuple[str, str], int] = {}
        for m in messages:
            directions.setdefault((m.sender, m.receiver), len(directions))
        self.direction = tuple(directions[(m.sender, m.receiver)] for m in messages)

    def send(self, flight: Flight, message: int) -> Flight:
        """``flight`` plus ``message``: a sorted multiset if the channel reorders, else send order per direction."""
        if self.channel.reorder:
            return tuple(sorted((*flight, message)))
        d = self.direction[message]
        at = len(flight)
        while at > 0 and self.direction[flight[at - 1]] > d:
            at -= 1
        return (*flight[:at], message, *flight[at:])

    def deliverable(self, flight: Flight) -> Iterator[int]:
        """Positions of the messages that may arrive next (one per message id, or per direction without reorder)."""
        seen: set[int] = set()
        for pos, m in enumerate(flight):
            key = m if self.channel.reorder else self.direction[m]
            if key not in seen:
                seen.add(key)
                yield pos

    def deliveries(self, flight: Flight, pos: int) -> Iterator[tuple[Flight, bool]]:
        """What delivering the message at ``pos`` may leave in flight, and whether a copy stayed (duplicated)."""
        yield (*flight[:pos], *flight[pos + 1 :]), False
        if self.channel.duplicate:
            yield flight, True

    def sends(self, flight: Flight, messages: Sequence[int]) -> Iterator[tuple[Flight, tuple[tuple[int, bool], ...]]]:
        """The flight after sending ``messages``, once per fate of each: (flight, ((message, kept), ...))."""
        for fate in self.channel.fates(len(messages)):
            after = flight
            for m, kept in zip(messages, fate, strict=True):
                if kept:
                    after = self.send(after, m)
            yield after, tuple(zip(messages, fate, strict=True))


class Traffic:
    """Every request's messages in flight as a run's steps leave them, by message name (traces and their replay)."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.flights: dict[str, Flight] = {}

    def of(self, request: str) -> int:
        """How many of ``request``'s messages are in flight."""
        return len(self.flights.get(request, ()))

    def total(self) -> int:
        """How many messages are in flight, all requests together: what the capacity bounds."""
        return sum(len(f) for f in self.flights.values())

    def deliver(self, request: str, message: str, *, duplicate: bool) -> bool:
        """Deliver one ``message`` of ``request`` (a copy stays if ``duplicate``); False if none may arrive now."""
        flight = self.flights.get(request, ())
        m = self.wire.ids.get(message)
        for pos in self.wire.deliverable(flight):
            if flight[pos] == m:
                if not duplicate:
                    self.flights[request] = (*flight[:pos], *flight[pos + 1 :])
                return True
        return False

    def send(self, request: str, message: str) -> None:
        """Put a kept ``message`` of ``request`` in flight."""
        self.flights[request] = self.wire.send(self.flights.get(request, ()), self.wire.ids[message])
