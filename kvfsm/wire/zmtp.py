"""ZMTP 3 on the listener's own sockets: the NULL handshake with a PUSH peer, and a frame parser that keeps only what a message needs.

libzmq hands a multipart message over only once its last frame has come and
keeps every frame until then; no socket option bounds how many (the
high-water mark counts whole messages, ``ZMQ_MAXMSGSIZE`` one frame), so a
peer that never sends the last frame grows the receiver without limit. Here
the listener reads the TCP stream itself: a message is judged the moment it
is certain to be dropped (a third frame, a frame over ``max_frame``, a body
over :data:`~kvfsm.wire.codec.MAX_BODY`), the rest of its bytes are skipped
as they arrive, and a connection never holds more than :data:`KEPT_BYTES`.

The wire format is RFC 23 (ZMTP 3.0): a 64-byte greeting each way, a READY
command each way, then frames of one flags byte (MORE 1, LONG 2, COMMAND 4),
a size of one byte or eight (big-endian) and the body.
"""

from __future__ import annotations

from typing import Protocol

from .codec import MAX_BODY, WireError, check_header

SIGNATURE_BYTES = 10
GREETING_BYTES = 64
MECHANISM = b"NULL".ljust(20, b"\x00")
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + MECHANISM + b"\x00" + b"\x00" * 31
"""This side's greeting: ZMTP 3.0, the NULL mechanism, not as-server (NULL has no roles)."""
MAX_COMMAND = 4096
"""Largest command accepted (a PUSH peer's READY is about 40 bytes; libzmq's PING at most 20)."""
HEADER_KEPT = 17
"""Bytes of frame 0 kept: enough to tell a kvfsm header (16 bytes at most) from anything longer."""
KEPT_BYTES = GREETING_BYTES + 9 + MAX_COMMAND + HEADER_KEPT + MAX_BODY
"""The most one connection's parser holds at once: greeting, a frame's size, a command, frame 0 and a body."""

MORE, LONG, COMMAND = 1, 2, 4


def command(name: bytes, properties: dict[bytes, bytes]) -> bytes:
    """A command frame: name, then each property as name (1-byte length) and value (4-byte length)."""
    body = bytes([len(name)]) + name
    for key, value in properties.items():
        body += bytes([len(key)]) + key + len(value).to_bytes(4, "big") + value
    if len(body) > 255:
        return bytes([COMMAND | LONG]) + len(body).to_bytes(8, "big") + body
    return bytes([COMMAND, len(body)]) + body


READY = command(b"READY", {b"Socket-Type": b"PULL"})
HELLO = GREETING + READY
"""All this side ever sends: it can go out at once, before the peer's greeting is read."""


class ZmtpError(Exception):
    """The peer broke ZMTP; ``reason`` is the listener's connection-drop reason (``handshake`` or ``protocol``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Sink(Protocol):
    """Where a session's messages go."""

    def dropped(self, reason: str) -> None:
        """A message judged before its end (its remaining bytes are skipped)."""

    def complete(self, header: bytes, body: bytes) -> None:
        """A two-frame message whose header and size passed: the codec judges the rest."""


def _header_reason(kept: bytearray, length: int) -> str | None:
    if length >= HEADER_KEPT:
        return "header"
    try:
        check_header(bytes(kept))
    except WireError as exc:
        return exc.reason
    return None


def ready_properties(body: bytes) -> dict[str, bytes]:
    """The properties of a READY command's body (names lower-cased: ZMTP names are case-insensitive)."""
    if body[:6] != b"\x05READY":
        raise ZmtpError("handshake", f"expected READY, got {bytes(body[:16])!r}")
    out: dict[str, bytes] = {}
    i = 6
    while i < len(body):
        n = body[i]
        name = bytes(body[i + 1 : i + 1 + n])
        i += 1 + n
        if i + 4 > len(body):
            raise ZmtpError("handshake", "READY property cut short")
        size = int.from_bytes(body[i : i + 4], "big")
        if i + 4 + size > len(body):
            raise ZmtpError("handshake", "READY property value cut short")
        out[name.decode("latin-1").lower()] = bytes(body[i + 4 : i + 4 + size])
        i += 4 + size
    return out


class Session:
    """One connection's ZMTP state: :meth:`feed` it bytes as they come; it hands messages to the sink.

    It raises :class:`ZmtpError` when the peer breaks the protocol; the
    connection is then closed (its stream cannot be resynchronised).
    """

    __slots__ = (
        "_sink", "_max_frame", "_greeting", "_head", "_ready", "_remaining", "_keep", "_target", "_frame_more",
        "_frame_command", "_part", "_verdict", "_kept0", "_len0", "_kept1", "_command",
    )  # fmt: skip

    def __init__(self, sink: Sink, max_frame: int) -> None:
        self._sink = sink
        self._max_frame = max_frame
        self._greeting: bytearray | None = bytearray()
        self._head = bytearray()
        self._ready = False
        self._remaining = -1  # -1: reading a frame's flags and size; else body bytes still to come
        self._keep = 0
        self._target: bytearray | None = None
        self._frame_more = False
        self._frame_command = False
        self._part = 0
        self._verdict: str | None = None
        self._kept0 = bytearray()
        self._len0 = 0
        self._kept1 = bytearray()
        self._command = bytearray()

    @property
    def ready(self) -> bool:
        """Whether the handshake is done."""
        return self._ready

    @property
    def in_message(self) -> bool:
        """Whether a message has begun and not ended (closing now loses it)."""
        if self._remaining >= 0:
            return self._part > 0 or not self._frame_command
        return self._part > 0 or (self._ready and bool(self._head))

    def feed(self, data: memoryview) -> None:
        """Parse ``data``, the next bytes from the peer, keeping only what the message in progress needs."""
        i, n = 0, len(data)
        if self._greeting is not None:
            i = self._greet(data)
        while i < n:
            if self._remaining < 0:
                i = self._read_head(data, i, n)
                continue
            take = min(self._remaining, n - i)
            if self._keep:
                k = min(self._keep, take)
                assert self._target is not None
                self._target += data[i : i + k]
                self._keep -= k
            i += take
            self._remaining -= take
            if not self._remaining:
                self._frame_end()

    def _greet(self, data: memoryview) -> int:
        greeting = self._greeting
        assert greeting is not None
        take = min(GREETING_BYTES - len(greeting), len(data))
        greeting += data[:take]
        if len(greeting) >= SIGNATURE_BYTES and (greeting[0] != 0xFF or not greeting[9] & 1):
            raise ZmtpError("handshake", "not a ZMTP 3 peer (bad signature)")
        if len(greeting) > SIGNATURE_BYTES and greeting[10] < 3:
            raise ZmtpError("handshake", f"ZMTP {greeting[10]}, this side speaks 3")
        if len(greeting) == GREETING_BYTES:
            if bytes(greeting[12:32]) != MECHANISM:
                raise ZmtpError(
                    "handshake", f"mechanism {bytes(greeting[12:32]).rstrip(bytes(1))!r}, this side has NULL"
                )
            self._greeting = None
        return take

    def _read_head(self, data: memoryview, i: int, n: int) -> int:
        head = self._head
        if not head and n - i >= 9:  # the whole size is here: no copy
            flags = data[i]
            width = 9 if flags & LONG else 2
            self._begin_frame(flags, int.from_bytes(data[i + 1 : i + width], "big"))
            return i + width
        head.append(data[i])
        if len(head) == (9 if head[0] & LONG else 2):
            self._begin_frame(head[0], int.from_bytes(head[1:], "big"))
            head.clear()
        return i + 1

    def _begin_frame(self, flags: int, size: int) -> None:
        if flags & ~(MORE | LONG | COMMAND):
            raise ZmtpError("protocol", f"reserved frame flags {flags:#04x}")
        more, is_command = bool(flags & MORE), bool(flags & COMMAND)
        self._frame_more, self._frame_command = more, is_command
        self._keep, self._target = 0, None
        if is_command or not self._ready:
            if not is_command:
                raise ZmtpError("handshake", "a message frame before READY")
            if more or self._part:
                raise ZmtpError("protocol", "a command inside a message")
            if size > MAX_COMMAND:
                raise ZmtpError("protocol" if self._ready else "handshake", f"a command of {size} bytes")
            if not self._ready:  # READY is read; later commands (PING and the like) are skipped
                self._command.clear()
                self._keep, self._target = size, self._command
        else:
            self._message_frame(more, size)
        self._remaining = size
        if not size:
            self._frame_end()

    def _message_frame(self, more: bool, size: int) -> None:
        part = self._part
        if self._verdict is None:
            reason = None
            if size > self._max_frame:
                reason = "oversized"
            elif part == 0:
                self._len0 = size
                reason = None if more else "frames"
            elif more:  # a third frame is coming
                reason = "frames"
            else:  # exactly two frames: frame 0 is whole, frame 1's size is known
                reason = _header_reason(self._kept0, self._len0) or ("oversized" if size > MAX_BODY else None)
            if reason is not None:
                self._verdict = reason
                self._kept0.clear()
                self._sink.dropped(reason)
                return
            if part == 0:
                self._keep, self._target = min(size, HEADER_KEPT), self._kept0
            else:
                self._keep, self._target = size, self._kept1

    def _frame_end(self) -> None:
        self._remaining = -1
        if self._frame_command:
            if not self._ready:
                properties = ready_properties(bytes(self._command))
                if properties.get("socket-type") != b"PUSH":
                    raise ZmtpError("handshake", f"socket type {properties.get('socket-type')!r}, this side takes PUSH")
                self._ready = True
                self._command = bytearray()
            return
        if self._frame_more:
            self._part += 1
            return
        if self._verdict is None:
            self._sink.complete(bytes(self._kept0), bytes(self._kept1))
        self._part, self._verdict = 0, None
        self._kept0.clear()
        self._kept1.clear()
