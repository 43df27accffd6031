"""The journal's line format: one JSON object per line, shared by the writer and the checker.

A journal is a sequence of *sessions*. Each starts with a :class:`Header` line,
written when a journal opens (so a file appended to across restarts says where
each tracker began), followed by one :class:`Record` line per transition in the
order the tracker made them::

    {"journal":2,"machine":"kv_request","pid":4711,"opened":1718000000.25,"kvfsm":"0.1.0",
     "params":{"transfer_timeout":30.0},"ids":"plain","sample":1.0}
    {"key":"req-1","generation":1,"event":"begin","from":"","to":"pinned","time":12.5}
    {"key":"req-1","generation":1,"event":"enqueue","from":"pinned","to":"queued","time":12.5}
    {"anomaly":"unknown","space":"remote_request_id","id":"req-1","event":"read_done"}

An :class:`AnomalyLine` records an event the tracker dropped instead of
applying (when the journal is also its ``on_anomaly`` hook).

The header's format is versioned (:data:`VERSION`): version 1 named the
machine, pid and opening time; version 2 adds the kvfsm version, the
tracker's params (every one, as the tracker resolved it), how keys and ids
are written (``ids``: plain, or hashed with a key secret to the journal) and
the share of keys kept (``sample``). Every field after ``journal`` is
optional, so each version's header reads as the other's.

``from`` is ``""`` exactly on ``begin`` lines (no state is named ``""``).
``time`` is the tracker's clock (monotonic seconds by default), stamped once
the transition and its actions are done.
"""

from __future__ import annotations

from typing import Any

import msgspec

VERSION = 2
"""The format version a :class:`Header` names (1: machine, pid, opened; 2: also kvfsm, params, ids, sample)."""

IDS_PLAIN = "plain"
"""``ids`` of a header whose lines carry keys and ids as the tracker had them."""

IDS_HASHED = "blake2b-64-keyed"
"""``ids`` of a header whose lines carry, for each key and id, the hex of its 64-bit BLAKE2b keyed with a secret
of the journal's: one value per key within the journal, no way back to the key without the secret."""

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


class Header(msgspec.Struct, gc=False, omit_defaults=True):
    """The first line of a session: which journal format and, when known, which machine and params."""

    journal: int
    machine: str | None = None
    pid: int | None = None
    opened: float | None = None
    """Wall-clock time (seconds since the epoch) the journal opened; for people, not for checks."""
    kvfsm: str | None = None
    """The kvfsm version that wrote the journal (version 2)."""
    params: dict[str, float] | None = None
    """Every param of the tracker, as it resolved them (``Tracker(params=)``, the environment, the spec); what
    ``kvfsm replay`` checks deadlines against (version 2, when the journal was attached to its tracker)."""
    ids: str | None = None
    """:data:`IDS_PLAIN` or :data:`IDS_HASHED` (version 2; a version 1 journal's ids are plain)."""
    sample: float | None = None
    """The share of keys whose lines the journal writes, every line of each (version 2; 1.0: all)."""


def encode_key(value: object) -> object:
    """``enc_hook`` for keys msgspec cannot encode natively: their ``str()``.

    str, int, float, bool, None, tuples (as arrays), UUIDs, enums and
    dataclasses are encoded by msgspec itself; anything else is logged as
    ``str(key)``, which must then be unique per key for the log to be checked.
    """
    return str(value)
