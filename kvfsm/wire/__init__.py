"""The control plane over pyzmq: typed, versioned messages and a listener that counts and drops what is not one.

The codec (:mod:`kvfsm.wire.codec`, :mod:`kvfsm.wire.messages`) needs only
msgspec. The sockets (:class:`Listener`, :class:`Sender`, :class:`Curve`)
need pyzmq, the ``kvfsm[zmq]`` extra; asking for them without it raises an
ImportError that says how to install it. docs/wire.md describes the schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .codec import HEADER, MAX_BODY, REASONS, WireError, decode, encode
from .messages import (
    MESSAGE_TYPES,
    ROOM_MESSAGES,
    VERSION,
    AbortAck,
    AbortReq,
    Failed,
    Heartbeat,
    Hello,
    Message,
    Metadata,
    Request,
    Succeeded,
    tag,
)

if TYPE_CHECKING:
    from .curve import ClientKey, Curve
    from .listener import Listener, ListenerStats
    from .sender import Sender

_SOCKETS = {
    "Listener": "listener",
    "ListenerStats": "listener",
    "Sender": "sender",
    "Curve": "curve",
    "ClientKey": "curve",
}

MISSING_ZMQ = "kvfsm.wire's sockets need pyzmq: pip install 'kvfsm[zmq]'"


def __getattr__(name: str) -> Any:
    module = _SOCKETS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfsm.wire' has no attribute {name!r}")
    try:
        import zmq  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{MISSING_ZMQ} (import zmq failed: {exc})") from exc
    from importlib import import_module

    return getattr(import_module(f"{__name__}.{module}"), name)


__all__ = [
    "HEADER",
    "MAX_BODY",
    "MESSAGE_TYPES",
    "MISSING_ZMQ",
    "REASONS",
    "ROOM_MESSAGES",
    "VERSION",
    "AbortAck",
    "AbortReq",
    "ClientKey",
    "Curve",
    "Failed",
    "Heartbeat",
    "Hello",
    "Listener",
    "ListenerStats",
    "Message",
    "Metadata",
    "Request",
    "Sender",
    "Succeeded",
    "WireError",
    "decode",
    "encode",
    "tag",
]
