"""JsonlJournal: a Tracker observer that writes every transition as one JSON line.

Attach it when the tracker is built and check the file offline with ``kvfsm
replay``::

    journal = JsonlJournal("transitions.jsonl")
    tracker = Tracker(spec, driver, params=params, observer=journal)
    journal.attach(tracker)            # the header names its machine and params
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

The session header goes out with the first line written (or at :meth:`flush`
/ :meth:`close`), so :meth:`attach`, called before the tracker's first
transition, can put the tracker's machine and params in it. A journal can
write hashed keys and ids (``hash_ids``) and keep a share of the keys
(``sample``), every line of each, chosen by a hash of the key.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import threading
import time as _time
from collections.abc import Callable, Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

import msgspec

from ..errors import Anomaly
from .record import IDS_HASHED, IDS_PLAIN, VERSION, AnomalyLine, Header, Record, encode_key

if TYPE_CHECKING:
    from ..engine import Tracker

BUFFER_BYTES = 64 * 1024
"""Default size the buffer reaches before it is written to the file (about 600 lines)."""

FLUSH_INTERVAL = 1.0
"""Default most seconds of tracker time a line waits in the buffer while transitions keep coming."""


SAMPLE_PERSON = b"kvfsm sample"
"""BLAKE2b's personalisation of the sampling hash: unkeyed, so two journals (prefill's and decode's) keep the same
keys, and unrelated to the keyed hash that replaces ids."""

_SKIP = object()
"""What :meth:`JsonlJournal._redact` returns for a key outside the sample."""


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

    One journal serves one tracker; :meth:`attach` it to that tracker before
    its first transition, so the header records the machine and the params
    ``kvfsm replay`` checks deadlines against. Its lock makes :meth:`flush`
    and :meth:`close` safe to call from any thread while the tracker writes.

    ``hash_ids=True`` writes each key and id as the hex of its 64-bit
    BLAKE2b, keyed with a secret drawn for this journal (pass ``bytes``, at
    most 64, to share one secret across journals or runs): one value per key
    within the journal, so the log is checked as well as a plain one, and no
    request id is in it. ``sample`` (0 < share <= 1) writes the lines of that
    share of keys, every line of each: a key is in when an unkeyed 64-bit
    BLAKE2b of it falls below the share, so journals of peers keep the same
    requests. Either costs a hash per line.
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | Writable,
        *,
        machine: str | None = None,
        append: bool = True,
        buffer_bytes: int = BUFFER_BYTES,
        flush_interval: float | None = FLUSH_INTERVAL,
        hash_ids: bool | bytes = False,
        sample: float = 1.0,
    ) -> None:
        if buffer_bytes < 0:
            raise ValueError(f"buffer_bytes must be >= 0, not {buffer_bytes}")
        if not 0.0 < sample <= 1.0:
            raise ValueError(f"sample must be a share in (0, 1], not {sample!r}: 0.01 keeps one key in a hundred")
        secret = os.urandom(16) if hash_ids is True else hash_ids if isinstance(hash_ids, bytes) else None
        if secret is not None and not 0 < len(secret) <= hashlib.blake2b.MAX_KEY_SIZE:
            raise ValueError(f"hash_ids takes True or a secret of 1 to {hashlib.blake2b.MAX_KEY_SIZE} bytes")
        self._owned: BinaryIO | None = None
        """The file the journal opened, and so closes."""
        if isinstance(target, str | os.PathLike):
            target = self._owned = open(target, "ab" if append else "wb")  # noqa: SIM115 - closed by close()
        self._file: Writable = target
        self._text = isinstance(self._file, io.TextIOBase)
        encoder = msgspec.json.Encoder(enc_hook=encode_key)
        self._encode_into = encoder.encode_into
        self._encode = encoder.encode
        self._secret = secret
        self._below = None if sample == 1.0 else int(sample * 2**64)
        """A key is in the sample when its sampling hash, as a 64-bit number, is below this (None: every key)."""
        self._redact: Callable[[Hashable], Any] | None = (
            None if secret is None and self._below is None else self._redacted
        )
        """What a key or id becomes in a line (:data:`_SKIP`: no line); None where it is written as it is."""
        self.machine = machine
        self.params: dict[str, float] | None = None
        """The tracker's params as :meth:`attach` found them: what the header records."""
        self.sample = sample
        self._buffer = bytearray()
        self._limit = buffer_bytes
        """Write once the buffer held this many bytes before a line was added (0: every line)."""
        self._interval = math.inf if flush_interval is None else flush_interval
        self._last_write = -math.inf
        """Tracker time of the last write; the first line is written at once."""
        self._lock = threading.Lock()
        self._closed = False
        self.lines = 1
        """Lines offered (the header included; a key outside the ``sample`` offers none); ``dropped`` never reached the file."""
        self.dropped = 0
        """Lines lost: to a failed write, an unencodable line, or a transition after :meth:`close`."""
        self.error: BaseException | None = None
        """The first error that dropped lines, for diagnosis; None while the log is complete."""
        self._opened = _time.time()
        self._header = 0
        """Bytes of the header at the front of the buffer while it is not written yet (0 once it is)."""
        self._put_header()

    def attach(self, tracker: Tracker) -> None:
        """Record ``tracker``'s machine and params in the header; call it before the tracker's first transition.

        The params are every one the tracker resolved (its ``params=``, the
        environment, the spec's defaults), so ``kvfsm replay`` checks the
        log's deadlines against the values it ran with.
        """
        with self._lock:
            if self.machine is not None and self.machine != tracker.spec.name:
                raise ValueError(
                    f"this journal was opened for machine {self.machine!r}, not {tracker.spec.name!r}: "
                    "one journal serves one tracker"
                )
            if not self._header:
                raise ValueError(
                    "the journal's header is written already (with its first line, or a flush): attach it to "
                    "its tracker right after building the tracker, before the first transition"
                )
            self.machine = tracker.spec.name
            self.params = {name: resolved.value for name, resolved in tracker.params.items()}
            del self._buffer[: self._header]
            self._put_header()

    def _put_header(self) -> None:
        """Put the session header at the front of the buffer, before any line already there."""
        header = Header(
            VERSION,
            self.machine,
            os.getpid(),
            self._opened,
            kvfsm=_version(),
            params=self.params,
            ids=IDS_PLAIN if self._secret is None else IDS_HASHED,
            sample=self.sample,
        )
        line = bytearray()
        self._encode_into(header, line, -1)
        line.append(0x0A)
        self._buffer[:0] = line
        self._header = len(line)

    def _redacted(self, value: Hashable) -> Any:
        """``value`` as a line writes it: its keyed hash (with ``hash_ids``), or :data:`_SKIP` outside the sample."""
        encoded = self._encode(value)
        if self._below is not None:
            draw = hashlib.blake2b(encoded, digest_size=8, person=SAMPLE_PERSON).digest()
            if int.from_bytes(draw, "big") >= self._below:
                return _SKIP
        if self._secret is None:
            return value
        return hashlib.blake2b(encoded, digest_size=8, key=self._secret).hexdigest()

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
            if self._redact is not None:
                try:
                    key = self._redact(key)
                except Exception as exc:  # a key whose str() raised: lose the line, not the tracker's event
                    self.lines += 1
                    self._drop(1, exc)
                    return
                if key is _SKIP:
                    return
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
            ident: Any = anomaly.id
            if self._redact is not None:
                try:
                    ident = self._redact(ident)
                except Exception as exc:
                    self.lines += 1
                    self._drop(1, exc)
                    return
                if ident is _SKIP:
                    return
            self.lines += 1
            if self._closed:
                self._drop(1, None)
                return
            buffer = self._buffer
            size = len(buffer)
            try:
                self._encode_into(AnomalyLine(anomaly.kind, anomaly.space, ident, anomaly.event), buffer, -1)
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
        self._header = 0  # written, or lost with the rest: either way no longer the buffer's to change
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


def _version() -> str:
    from .. import __version__

    return __version__
