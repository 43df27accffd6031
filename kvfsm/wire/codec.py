"""The strict, versioned wire format: two ZMQ frames, a header naming protocol and version, and a msgpack body.

Decoding never raises anything but :class:`WireError`, whose ``reason`` is
one of :data:`REASONS`, so a listener can count every drop by cause.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .messages import VERSION, Message

HEADER = b"kvfsm/%d" % VERSION
"""Frame 0 of every message."""
PREFIX = b"kvfsm/"
MAX_BODY = 4096
"""Largest body accepted: a metadata with :data:`~kvfsm.wire.messages.MAX_PAGES` pages is well under it."""
FRAMES = 2

REASONS: tuple[str, ...] = (
    "frames",  # not exactly two frames
    "header",  # frame 0 is not a kvfsm header
    "version",  # a kvfsm header of another version
    "oversized",  # a frame larger than the protocol allows
    "malformed",  # the body is not msgpack
    "unknown_type",  # msgpack, but no message of this version has that type
    "invalid",  # a known type with a missing, extra, mistyped or out-of-range field
    "unauthenticated",  # with CURVE on: the sender's key does not belong to the peer it names
    "unexpected",  # a valid message this receiver never takes (sent to the wrong role)
    "unknown_id",  # well formed, but names an id (a page, a peer) outside the receiver's id space
    "backlog",  # the receiver's inbox was full
)
"""Why a message was dropped; the listener counts each."""


class WireError(ValueError):
    """A message that is not a valid version-1 message; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> list[bytes]:
    """The frames that carry ``message``."""
    return [HEADER, _encoder.encode(message)]


def check_header(frame: bytes) -> None:
    """Raise :class:`WireError` unless ``frame`` is this version's header."""
    if frame == HEADER:
        return
    if frame.startswith(PREFIX) and len(frame) <= 16:
        raise WireError("version", f"peer speaks {frame!r}, this side speaks {HEADER!r}")
    raise WireError("header", f"frame 0 is {frame[:16]!r}, not {HEADER!r}")


def decode(frames: Sequence[bytes]) -> Message:
    """The message in ``frames``; :class:`WireError` says why there is none."""
    if len(frames) != FRAMES:
        raise WireError("frames", f"{len(frames)} frames, a message has {FRAMES}")
    check_header(frames[0])
    body = frames[1]
    if len(body) > MAX_BODY:
        raise WireError("oversized", f"body of {len(body)} bytes, at most {MAX_BODY}")
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        reason = "unknown_type" if "`$.type`" in text and "Invalid value" in text else "invalid"
        raise WireError(reason, text) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # a str field that is not UTF-8 raises the latter
        raise WireError("malformed", str(exc)) from None
