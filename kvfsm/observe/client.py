"""Reading a tracker debug endpoint from another process: one bounded read, for ``kvfsm top`` and ``kvfsm inspect``.

A kvfsm endpoint's answers are bounded (``/state`` by its ``limit`` per
state), so an answer bigger or slower than any it sends is not a kvfsm
endpoint, and is refused rather than read whole.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request

from ..errors import KvfsmError

MAX_ANSWER = 16 << 20
"""Largest answer read (16 MiB)."""

READ_SECONDS = 10.0
"""Longest one read may take, however slowly the server sends."""


class EndpointError(KvfsmError):
    """The endpoint could not be read, or answered too much or too slowly; the message says which."""


def read(url: str, timeout: float = 5.0) -> bytes:
    """The body at ``url``, read in chunks up to :data:`MAX_ANSWER` bytes and :data:`READ_SECONDS`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            chunks: list[bytes] = []
            size, started = 0, time.monotonic()
            while chunk := answer.read(1 << 16):
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise EndpointError(f"{url} answered more than {MAX_ANSWER >> 20} MiB")
                if time.monotonic() - started > READ_SECONDS:
                    raise EndpointError(f"{url} took more than {READ_SECONDS:g} s to answer")
                chunks.append(chunk)
            return b"".join(chunks)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise EndpointError(f"cannot read {url} ({exc})") from None
