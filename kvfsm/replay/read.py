"""Reading a journal's lines: plain or gzip (told by its content), bounded, and what a read that stops partway means.

A log is checked as far as it can be read. The exceptions that stop reading
partway (corrupt compressed data, a compressed stream cut short, an I/O error,
a "line" with no newline in :data:`MAX_SKIP` bytes) are named here once, with
what each one says about the log, so the checker turns them into a finding at
the line where reading stopped.

Lines are read with a bound: no more than :data:`MAX_LINE` bytes of a line
are held. A longer line is passed on as its first ``MAX_LINE + 1`` bytes (the
checker reports it, KVF301, by its length alone) and the rest of it is read
and dropped, so memory does not grow with the longest line.

:func:`first_header` reads the session header a journal begins with (its
machine, its tracker's params) before the lines are checked.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import msgspec

from .record import Header

GZIP_MAGIC = b"\x1f\x8b"
"""The first two bytes of every gzip stream: a log that starts with them is read as gzip."""

MAX_LINE = 1 << 20
"""Longest line checked (1 MiB): a journal line is a few hundred bytes, so a longer one is damage."""

MAX_SKIP = 64 << 20
"""Longest line skipped (64 MiB): past it with no newline, the input is no journal (a device, a disk
image), and reading stops rather than go on through it."""


class NoNewline(Exception):
    """A line ran on for :data:`MAX_SKIP` bytes with no newline: reading stops there."""


STOPS: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error, NoNewline)
"""What reading a log can raise partway: gzip's EOFError (cut short), BadGzipFile (an OSError), zlib.error, I/O,
and :class:`NoNewline`."""


class Stop(NamedTuple):
    """Why reading stopped: ``cut`` when the log just ends early, else its data is corrupt or unreadable."""

    cut: bool
    why: str


def why_stopped(exc: BaseException) -> Stop:
    """What one of :data:`STOPS` says about the log (for the finding at the line where reading stopped)."""
    if isinstance(exc, EOFError):
        return Stop(True, "the compressed log ends here, before its gzip end-of-stream marker")
    if isinstance(exc, NoNewline):
        return Stop(False, f"no newline in the {MAX_SKIP >> 20} MiB from the start of this line, so this is no journal")
    if isinstance(exc, gzip.BadGzipFile | zlib.error):
        return Stop(False, f"the compressed log is corrupt here ({exc})")
    return Stop(False, f"the log cannot be read past this point ({exc})")


def _sniffed(stream: BinaryIO) -> BinaryIO:
    """``stream`` itself, or a gzip reader over it when it starts with :data:`GZIP_MAGIC`."""
    peek = getattr(stream, "peek", None)
    head = peek(len(GZIP_MAGIC)) if peek is not None else b""
    if head[: len(GZIP_MAGIC)] == GZIP_MAGIC:
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    return stream


@contextlib.contextmanager
def log_lines(log: str | os.PathLike[str] | Iterable[bytes]) -> Iterator[Iterable[bytes]]:
    """The log's lines as read: a path is opened (and closed), a binary stream is read as it is (and left open).

    Either may be gzip-compressed; that is told from the first bytes, not the
    file's name. Any other iterable of byte lines is used as it is. Opening a
    path raises OSError; reading it may raise one of :data:`STOPS` later.
    """
    if isinstance(log, str | os.PathLike):
        with open(Path(log), "rb") as raw, _closing_if_new(_sniffed(raw), raw) as stream:
            yield bounded_lines(stream)
    elif isinstance(log, io.BufferedReader):
        with _closing_if_new(_sniffed(log), log) as stream:
            yield bounded_lines(stream)
    elif callable(getattr(log, "readline", None)):
        yield bounded_lines(log)  # type: ignore[arg-type]
    else:
        yield log


def bounded_lines(stream: BinaryIO, limit: int = MAX_LINE, skip: int = MAX_SKIP) -> Iterator[bytes]:
    """``stream``'s lines, each at most ``limit + 1`` bytes: a longer one is cut there and the rest dropped.

    Raises :class:`NoNewline` once a line runs past ``skip`` bytes.
    """
    readline = stream.readline
    while line := readline(limit + 1):
        if len(line) <= limit:
            yield line
            continue
        size, rest = len(line), line
        while not rest.endswith(b"\n") and (rest := readline(limit)):
            size += len(rest)
            if size > skip:
                raise NoNewline(size)
        yield line


@contextlib.contextmanager
def _closing_if_new(stream: BinaryIO, under: BinaryIO) -> Iterator[BinaryIO]:
    """Close a gzip reader made over ``under`` (not ``under`` itself, which its opener owns)."""
    try:
        yield stream
    finally:
        if stream is not under:
            stream.close()


def first_header(lines: Iterable[bytes]) -> tuple[Header | None, Iterator[bytes]]:
    """The session header on the log's first line (None if that line is none), and all the lines, it included.

    Reading the first line may raise one of :data:`STOPS`; the lines
    returned then raise it again when read, so the checker reports it at its
    line as it would have.
    """
    lines = iter(lines)
    try:
        first = next(lines, None)
    except STOPS as exc:
        return None, _raising(exc)
    if first is None:
        return None, iter(())
    header: Header | None
    try:
        header = msgspec.json.decode(first, type=Header) if len(first) <= MAX_LINE else None
    except (msgspec.MsgspecError, ValueError, RecursionError):
        header = None
    return header, itertools.chain((first,), lines)


def _raising(exc: BaseException) -> Iterator[bytes]:
    raise exc
    yield b""  # a generator: the raise happens when it is read
