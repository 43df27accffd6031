"""The sending end: a PUSH socket to one peer's listener, bounded and never blocking its owner for long."""

from __future__ import annotations

import zmq

from .codec import encode
from .curve import ClientKey
from .messages import Message


class Sender:
    """Connects to a listener's ``endpoint`` (``tcp://127.0.0.1:PORT``) and sends messages to it.

    As SGLang's push sockets: no linger, a send timeout, and a bounded queue
    while the peer is away (ZMQ reconnects by itself when it comes back).
    :meth:`send` returns False instead of blocking when that queue is full.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        key: ClientKey | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        hwm: int = 10000,
        timeout_ms: int = 1000,
    ) -> None:
        self._context = context or zmq.Context.instance()
        self.socket = self._context.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, hwm)
        self.socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
        self.socket.setsockopt(zmq.RECONNECT_IVL, 50)
        if key is not None:
            key.apply(self.socket)
        self.socket.connect(endpoint)
        self.endpoint = endpoint
        self.sent = 0
        self.refused = 0

    def send(self, message: Message) -> bool:
        """Send ``message``; False if the peer's queue stayed full for the send timeout."""
        return self.send_frames(encode(message))

    def send_frames(self, frames: list[bytes]) -> bool:
        """Send raw frames (a fuzzer's, or a fault injector's mangled copy)."""
        try:
            self.socket.send_multipart(frames, copy=True)
        except zmq.Again:
            self.refused += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)
