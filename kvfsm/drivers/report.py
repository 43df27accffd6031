"""What vLLM is owed at its next ``get_finished``: finished_sending, finished_recving and the blocks to recompute.

A connector's spec declares the obligation as a resource (``recv_report``)
whose release action records the request here, so every way out of a load
records it exactly once; the connector only drains this. One helper serves
every connector in kvfsm: :class:`RecvReport` is the resource's actions
for the loads that report by block id (MoRIIO's and NIXL's decode sides),
:class:`SendReport` the ``send_report`` actions of the holds that report
finished_sending (MoRIIO's and NIXL's prefill sides).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Finished:
    """One drain of a :class:`Report`: what vLLM's ``get_finished`` and ``get_block_ids_with_load_errors`` return."""

    sending: set[Hashable] = field(default_factory=set)
    """Requests whose blocks the connector no longer needs (vLLM may free them now)."""
    recving: set[Hashable] = field(default_factory=set)
    """Requests whose load is over, loaded or not (vLLM stops waiting for them)."""
    invalid_blocks: set[int] = field(default_factory=set)
    """Blocks a load did not fill: vLLM recomputes them."""


class Report:
    """Requests owed a finished_sending / finished_recving, and unfilled blocks, until the next drain.

    Invariant, kept under ``_lock``: a request recorded with invalid blocks
    is in ``_waiting`` until those blocks have been taken (:meth:`take_invalid`),
    and only then in ``_recving``. vLLM reads ``invalid_block_ids`` before
    ``finished_recving``; a request told it may run before its bad blocks
    are known would run on garbage. A caller that hands both over at once
    (:meth:`take`) never sees the difference.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sending: set[Hashable] = set()
        self._recving: set[Hashable] = set()
        self._waiting: set[Hashable] = set()
        self._invalid: set[int] = set()

    def send(self, request_id: Hashable) -> None:
        """``request_id``'s blocks may be freed: report it in the next finished_sending."""
        with self._lock:
            self._sending.add(request_id)

    def recv(self, request_id: Hashable, invalid_blocks: Iterable[int] = ()) -> None:
        """``request_id``'s load is over; ``invalid_blocks`` are the ones it did not fill."""
        invalid = set(invalid_blocks)
        with self._lock:
            if invalid:
                self._invalid |= invalid
                self._waiting.add(request_id)
            else:
                self._recving.add(request_id)

    def take_invalid(self) -> set[int]:
        """Drain the blocks to recompute; the requests recorded with them become reportable."""
        with self._lock:
            return self._take_invalid()

    def take_finished(self) -> tuple[set[Hashable], set[Hashable]]:
        """Drain ``(finished_sending, finished_recving)``: only requests whose invalid blocks were taken."""
        with self._lock:
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
            return sending, recving

    def take(self) -> Finished:
        """Drain everything at once, for a caller that hands vLLM all three together."""
        with self._lock:
            invalid = self._take_invalid()
            sending, self._sending = self._sending, set()
            recving, self._recving = self._recving, set()
        return Finished(sending, recving, invalid)

    def _take_invalid(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        self._recving |= self._waiting
        self._waiting = set()
        return invalid

    def owes(self, request_id: Hashable) -> bool:
        """Whether ``request_id`` is recorded and not yet drained (as sending or receiving)."""
        with self._lock:
            return request_id in self._sending or request_id in self._recving or request_id in self._waiting

    def owed(self) -> int:
        """Requests recorded and not yet drained."""
        with self._lock:
            return len(self._sending) + len(self._recving) + len(self._waiting)


class RecvReport:
    """The actions of a load spec's ``recv_report``: vLLM parked the request until finished_recving names it.

    The spec acquires it first, so a pin that fails after it still reports
    the load (undoing the acquire is its release). ``report_recv`` reports
    every block invalid; ``report_loaded`` is the checked edge's own release
    (``release: {recv_report: report_loaded}``), with none invalid. A driver
    mixes this in and sets ``report`` and ``_owed`` (the resource's record,
    empty) in its ``__init__``.
    """

    report: Report
    _owed: dict[Hashable, tuple[int, ...]]

    def owe_recv_report(self, key: Hashable, /, block_ids: Iterable[int], **_begin: object) -> None:
        """vLLM parked the request until it hears of the load; its blocks are unfilled until checked."""
        self._owed[key] = tuple(block_ids)

    def report_recv(self, key: Hashable, /) -> None:
        """Record the load for finished_recving with every block invalid: vLLM recomputes them."""
        self.report.recv(key, self._owed.pop(key))

    def report_loaded(self, key: Hashable, /) -> None:
        """The report's release on the edge that byte-checked the blocks: none invalid."""
        del self._owed[key]
        self.report.recv(key, ())

    def owes(self, key: Hashable) -> bool:
        """Whether ``key``'s report is still owed (what ``observe`` says of ``recv_report``)."""
        return key in self._owed


class SendReport:
    """The actions of a producer spec's ``send_report``: vLLM keeps the blocks until finished_sending names the request.

    The spec acquires it first, so a hold that fails after it still reports
    the request (undoing the acquire is its release, :meth:`report_sent`).
    A driver mixes this in and sets ``report`` and ``_owed`` (the resource's
    record, empty) in its ``__init__``; what the hold begins with is the
    hold's, so :meth:`owe_send_report` takes and ignores it (typed ``Any``:
    a subclass that wraps it names the producer's own payload).
    """

    report: Report
    _owed: set[Hashable]

    def owe_send_report(self, key: Hashable, /, *_given: Any, **_begin: Any) -> None:
        """vLLM handed the blocks over (delay_free) and keeps them until finished_sending names the request."""
        self._owed.add(key)

    def report_sent(self, key: Hashable, /) -> None:
        """vLLM's ``_mark_request_done``: whatever the outcome, record the request for finished_sending."""
        self._owed.remove(key)
        self.report.send(key)
