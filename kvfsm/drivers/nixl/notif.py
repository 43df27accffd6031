"""The notification a decode rank sends a prefill rank: ``b"<remote_request_id>:<world_size>"``, parsed with a guard.

vLLM's producer parses it with ``notif.decode().rsplit(":", 1)`` and no guard,
so one stray message raises inside the engine's step. Here a message that is
not UTF-8, has no colon, an empty id, or a world size that is not a positive
integer parses to ``None``, and the caller counts it as malformed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Notif:
    """A parsed notification: the prefill's request id, and the decode side's TP world size."""

    request_id: str
    world_size: int


def encode(request_id: str, world_size: int) -> bytes:
    """The message that tells a prefill rank the decode side is done with ``request_id``'s blocks."""
    if world_size < 1:
        raise ValueError(f"world_size must be a positive integer, not {world_size}")
    return f"{request_id}:{world_size}".encode()


def fault_label(raw: bytes) -> tuple[str, str] | None:
    """``("notif", request id)``: the key a notification's fault is decided on, one per request; None if malformed."""
    notif = parse(raw)
    return None if notif is None else ("notif", notif.request_id)


def parse(raw: bytes) -> Notif | None:
    """``raw`` as a :class:`Notif`, or ``None`` when it is malformed (never raises)."""
    try:
        text = raw.decode()
    except (UnicodeDecodeError, AttributeError):
        return None
    request_id, colon, size = text.rpartition(":")
    if not colon or not request_id or not size.isdigit():
        return None
    world_size = int(size)
    return Notif(request_id, world_size) if world_size >= 1 else None
