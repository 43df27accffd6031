"""JsonlJournal: a Tracker observer that writes every transition as one JSON line.

Attach it when the tracker is built and check the file offline with ``kvfsm
replay``::

    journal = JsonlJournal("transitions.jsonl", machine=spec.name)
    tracker = Tracker(spec, driver, observer=journal)
    ...
    tracker.close()
    journal.close()

The observer runs on the tracker's per-event path, under its lock, after the
state has changed; so it must be cheap and must never raise (an exception there
would escape ``fire()`` for a transition that did happen). Lines are encoded
with msgspec into an in-memory buffer that goes to the file when it fills, when
``flush_interval`` seconds of tracker time have passed since the last write,
and on :meth:`flush` / :meth:`close`. A write that fails is counted in
:attr:`dropped` and kept in :attr:`error`, never raised from the observer.
"""

from __future__ import annotations

import io
import math
import os
import threading
import time as _time
from collections.abc import Hashable
from types import TracebackType
from typing import Any, BinaryIO, Protocol

import msgspec

from ..errors import Anomaly
from .record import VERSION, AnomalyLine, Header, Record, encode_key

BUFFER_BYTES = 64 * 1024
"""Default size the buffer reaches before it is written to the file (about 600 lines)."""

FLUSH_INTERVAL = 1.0
"""Default most seconds of tracker time a line waits in the buffer while transitions keep coming."""


class Writable(Protocol):
    """What a journal can write to besides a path: any file-like object (text if an ``io.TextIOBase``)."""

    def write(self, data: Any, /) -> Any: ...

    def flush(self) -> Any: ...


class JsonlJournal:
    """Writes each transition a tracker makes as a JSON line; pass it as ``Tracker(observer=...)``.

    ``target`` is a path (opened for appending, or truncated with
    ``append=False``; closed by :meth:`close`) or an open file, binary or text
    (flushed but left open by :meth:`close`). ``machine`` names the spec in the
    session header so ``kvfsm replay`` can tell a log checked against the wrong
    spec. ``buffer_bytes=0`` writes and flushes every line as it is made
    (line-buffered: for ``tail -f``, at a few microseconds per transition).

    Keys are written as msgspec encodes them: ``str`` as a JSON string, ``int``
    as a JSON number (so ``7`` and ``"7"`` stay different keys), tuples as
    arrays; a key msgspec cannot encode is written as ``str(key)``.

    One journal serves one tracker. Its lock makes :meth:`flush` and
    :meth:`close` safe to call from any thread while the tracker writes.
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | Writable,
        *,
        machine: str | None = None,
        append: bool = True,
        buffer_bytes: int = BUFFER_BYTES,
        flush_interval: float | None = FLUSH_INTERVAL,
    ) -> None:
        if buffer_bytes < 0:
            raise ValueError(f"buffer_bytes must be >= 0, not {buffer_bytes}")
        self._owned: BinaryIO | None = None
        """The file the journal opened, and so closes."""
        if isinstance(target, str | os.PathLike):
            target = self._owned = open(target, "ab" if append else "wb")  # noqa: SIM115 - closed by close()
        self._file: Writable = target
        self._text = isinstance(self._file, io.TextIOBase)
        self._encode_into = msgspec.json.Encoder(enc_hook=encode_key).encode_into
        self._buffer = bytearray()
        self._limit = buffer_bytes
        """Write once the buffer held this many bytes before a line was added (0: every line)."""
        self._interval = math.inf if flush_interval is None else flush_interval
        self._last_write = -math.inf
        """Tracker time of the last write; the first line is written at once."""
        self._lock = threading.Lock()
        self._closed = False
        self.lines = 1
        """Lines offered (the header included); ``dropped`` of them never reached the file."""
        self.dropped = 0
        """Lines lost: to a failed write, an unencodable line, or a transition after :meth:`close`."""
        self.error: BaseException | None = None
        """The first error that dropped lines, for diagnosis; None while the log is complete."""
        self._encode_into(Header(VERSION, machine, os.getpid(), _time.time()), self._buffer, -1)
        self._buffer.append(0x0A)
        self._write()

    @property
    def name(self) -> str:
        """The file's name, for messages."""
        return str(getattr(self._file, "name", "<stream>"))

    @property
    def closed(self) -> bool:
        return self._closed

    def __call__(self, key: Hashable, generation: int, event: str, source: str, target: str, time: float) -> None:
        """The observer: append one transition line (never raises; see :attr:`dropped`).

        Written flat, with the lock taken by hand: it runs once per transition.
        """
        lock = self._lock
        lock.acquire()
        try:
            self.lines += 1
            if self._closed:
                self._drop(1, None)
                return
            buffer = self._buffer
            size = len(buffer)
            try:
                self._encode_into(Record(key, generation, event, source, target, time), buffer, -1)
            except Exception as exc:  # a key whose str() raised, say: lose the line, not the tracker's event
                del buffer[size:]
                self._drop(1, exc)
                return
            buffer.append(0x0A)
            if size >= self._limit or time - self._last_write >= self._interval:
                self._write()
                self._last_write = time
        finally:
            lock.release()

    def anomaly(self, anomaly: Anomaly) -> None:
        """The ``on_anomaly`` hook: append one line for an event the tracker dropped (never raises)."""
        with self._lock:
            self.lines += 1
            if self._closed:
                self._drop(1, None)
                return
            buffer = self._buffer
            size = len(buffer)
            try:
                self._encode_into(AnomalyLine(anomaly.kind, anomaly.space, anomaly.id, anomaly.event), buffer, -1)
            except Exception as exc:
                del buffer[size:]
                self._drop(1, exc)
                return
            buffer.append(0x0A)

    def flush(self) -> None:
        """Write buffered lines to the file and flush it to the OS (not fsync)."""
        with self._lock:
            if not self._closed:
                self._write()

    def close(self) -> None:
        """Flush, and close the file if the journal opened it. Later transitions are counted as dropped."""
        with self._lock:
            if self._closed:
                return
            self._write()
            self._closed = True
            if self._owned is not None:
                try:
                    self._owned.close()
                except OSError as exc:
                    self._drop(0, exc)

    def __enter__(self) -> JsonlJournal:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<JsonlJournal {self.name!r} {state}: {self.lines} lines, {self.dropped} dropped>"

    # -- under the lock ------------------------------------------------------------

    def _write(self) -> None:
        """Move the buffer to the file; on failure its lines are dropped, not retried."""
        buffer = self._buffer
        if not buffer:
            return
        try:
            self._file.write(buffer.decode() if self._text else buffer)
            self._file.flush()
        except Exception as exc:  # disk full, closed by someone else: the tracker must not see it
            self._drop(buffer.count(0x0A), exc)
        buffer.clear()

    def _drop(self, lines: int, exc: BaseException | None) -> None:
        self.dropped += lines
        if self.error is None and exc is not None:
            self.error = exc
