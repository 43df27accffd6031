"""The journal's line format: one JSON object per line, shared by the writer and the checker.

A journal is a sequence of *sessions*. Each starts with a :class:`Header` line,
written when a journal opens (so a file appended to across restarts says where
each tracker began), followed by one :class:`Record` line per transition in the
order the tracker made them::

    {"journal":1,"machine":"kv_request","pid":4711,"opened":1718000000.25}
    {"key":"req-1","generation":1,"event":"begin","from":"","to":"pinned","time":12.5}
    {"key":"req-1","generation":1,"event":"enqueue","from":"pinned","to":"queued","time":12.5}
    {"anomaly":"unknown","space":"remote_request_id","id":"req-1","event":"read_done"}

An :class:`AnomalyLine` records an event the tracker dropped instead of
applying (when the journal is also its ``on_anomaly`` hook).

``from`` is ``""`` exactly on ``begin`` lines (no state is named ``""``).
``time`` is the tracker's clock (monotonic seconds by default), stamped once
the transition and its actions are done.
"""

from __future__ import annotations

from typing import Any

import msgspec

VERSION = 1
"""The format version a :class:`Header` names; a checker refuses nothing on it yet."""

BEGIN = "begin"
"""The event name of a line that starts an instance (its ``from`` is ``""``)."""


class Record(msgspec.Struct, gc=False):
    """One transition of one instance, as the tracker's observer saw it."""

    key: Any
    """The instance's key: a JSON string or number for ``str``/``int`` keys (see :func:`encode_key`)."""
    generation: int
    event: str
    from_: str = msgspec.field(name="from")
    to: str
    time: float


class AnomalyLine(msgspec.Struct, gc=False):
    """An event the tracker dropped (``Tracker(on_anomaly=journal.anomaly)``): unknown, late or stale id, forced."""

    anomaly: str
    space: str
    id: Any
    event: str


class Header(msgspec.Struct, gc=False):
    """The first line of a session: which journal format and, when known, which machine."""

    journal: int
    machine: str | None = None
    pid: int | None = None
    opened: float | None = None
    """Wall-clock time (seconds since the epoch) the journal opened; for people, not for checks."""


def encode_key(value: object) -> object:
    """``enc_hook`` for keys msgspec cannot encode natively: their ``str()``.

    str, int, float, bool, None, tuples (as arrays), UUIDs, enums and
    dataclasses are encoded by msgspec itself; anything else is logged as
    ``str(key)``, which must then be unique per key for the log to be checked.
    """
    return str(value)
