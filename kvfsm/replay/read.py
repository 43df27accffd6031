"""Reading a journal's lines: plain or gzip (told by its content), and what a read that stops partway means.

A log is checked as far as it can be read. The exceptions that stop reading
partway (corrupt compressed data, a compressed stream cut short, an I/O error)
are named here once, with what each one says about the log, so the checker
turns them into a finding at the line where reading stopped.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

GZIP_MAGIC = b"\x1f\x8b"
"""The first two bytes of every gzip stream: a log that starts with them is read as gzip."""

STOPS: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error)
"""What reading a log can raise partway: gzip's EOFError (cut short), BadGzipFile (an OSError), zlib.error, I/O."""


class Stop(NamedTuple):
    """Why reading stopped: ``cut`` when the log just ends early, else its data is corrupt or unreadable."""

    cut: bool
    why: str


def why_stopped(exc: BaseException) -> Stop:
    """What one of :data:`STOPS` says about the log (for the finding at the line where reading stopped)."""
    if isinstance(exc, EOFError):
        return Stop(True, "the compressed log ends here, before its gzip end-of-stream marker")
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
            yield stream
    elif isinstance(log, io.BufferedReader):
        with _closing_if_new(_sniffed(log), log) as stream:
            yield stream
    else:
        yield log


@contextlib.contextmanager
def _closing_if_new(stream: BinaryIO, under: BinaryIO) -> Iterator[BinaryIO]:
    """Close a gzip reader made over ``under`` (not ``under`` itself, which its opener owns)."""
    try:
        yield stream
    finally:
        if stream is not under:
            stream.close()
