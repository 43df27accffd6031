"""The receiving end: a background thread that reads a PULL socket and never dies on what a peer sends.

Seed 002's second bug was a bootstrap thread that parsed ABORT frames without
checking them and died on a malformed one, after which no abort was ever
answered. Here every message is decoded by :func:`~kvfsm.wire.codec.decode`
(and an optional ``check`` for the receiver's own id spaces); whatever fails
is counted by reason in :attr:`Listener.drops` and dropped. Valid messages go
to a bounded inbox that the owner's loop drains with :meth:`Listener.take`.

Memory stays bounded whatever peers send: frames beyond the second are read
and discarded without being kept, ZMQ refuses any frame over
``max_frame`` bytes, the inbox holds at most ``inbox`` messages (the rest are
dropped as ``backlog``), and per-peer counts keep at most ``max_peers`` names
(least recently heard first out).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from .codec import MAX_BODY, REASONS, WireError, check_header, decode
from .curve import Curve
from .messages import Message

Check = Callable[[Message], str | None]
"""The receiver's own validation: returns a drop reason (one of ``REASONS``), or None to accept."""


@dataclass
class PeerStats:
    """What the listener knows of one sender: how many of its messages it took, and when it last heard it."""

    received: int = 0
    last_seen: float = 0.0


@dataclass
class ListenerStats:
    """A snapshot of the listener's counters."""

    received: int
    accepted: int
    drops: dict[str, int]
    peers: int
    peers_evicted: int
    alive: bool
    errors: list[str] = field(default_factory=list)


class Listener:
    """Binds a PULL socket (127.0.0.1 by default) and decodes in a thread of its own until :meth:`close`.

    ``port=0`` picks a free port (see :attr:`endpoint`). With ``curve`` set,
    only peers holding a client key the curve allows can connect; with
    ``curve.names`` also set, a message must name the peer its key belongs to.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        check: Check | None = None,
        inbox: int = 65536,
        max_peers: int = 256,
        max_frame: int = 64 * 1024,
        curve: Curve | None = None,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        poll_ms: int = 50,
    ) -> None:
        self._context = context or zmq.Context.instance()
        self._curve = curve
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max(max_frame, MAX_BODY))
        self._socket.setsockopt(zmq.RCVHWM, 10000)
        if curve is not None:
            curve.serve(self._socket)
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.port = port
        self._check = check
        self._inbox: queue.Queue[Message] = queue.Queue(maxsize=inbox)
        self._max_peers = max_peers
        self._peers: OrderedDict[str, PeerStats] = OrderedDict()
        self.drops: Counter[str] = Counter()
        self.received = 0
        self.accepted = 0
        self.peers_evicted = 0
        self.errors: list[str] = []
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name=f"kvfsm-listener:{port}", daemon=True)
        self._thread.start()

    # -- the thread -----------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(self._poll_ms):
                    continue
                while not self._stop.is_set():
                    try:
                        self._receive_one()
                    except zmq.Again:
                        break
            except zmq.ContextTerminated:
                return
            except Exception as exc:  # the listener outlives anything a message can cause
                with self._lock:
                    self.drops["internal"] += 1
                    if len(self.errors) < 16:
                        self.errors.append(repr(exc))

    def _receive_one(self) -> None:
        """Read one multipart message without ever keeping more than two frames of it."""
        first = self._socket.recv(zmq.NOBLOCK, copy=False)
        frames = [first.bytes]
        user = _user_id(first) if self._curve is not None else None
        count = 1
        while self._socket.getsockopt(zmq.RCVMORE):
            frame = self._socket.recv(copy=False)
            count += 1
            if count <= 2:
                frames.append(frame.bytes)
        self.received += 1
        if count != 2:
            self._drop("frames")
            return
        try:
            check_header(frames[0])
            message = decode(frames)
        except WireError as exc:
            self._drop(exc.reason)
            return
        if self._curve is not None and not self._curve.may_speak_for(user, message.peer):
            self._drop("unauthenticated")
            return
        if self._check is not None:
            reason = self._check(message)
            if reason is not None:
                self._drop(reason if reason in REASONS else "invalid")
                return
        self._seen(message.peer)
        try:
            self._inbox.put_nowait(message)
        except queue.Full:
            self._drop("backlog")
            return
        self.accepted += 1

    def _drop(self, reason: str) -> None:
        with self._lock:
            self.drops[reason] += 1

    def _seen(self, peer: str) -> None:
        with self._lock:
            stats = self._peers.pop(peer, None) or PeerStats()
            stats.received += 1
            stats.last_seen = time.monotonic()
            self._peers[peer] = stats
            while len(self._peers) > self._max_peers:
                self._peers.popitem(last=False)
                self.peers_evicted += 1

    # -- the owner's side ---------------------------------------------------------

    def take(self, limit: int = 1024, timeout: float = 0.0) -> list[Message]:
        """Up to ``limit`` messages in arrival order, waiting at most ``timeout`` seconds for the first."""
        out: list[Message] = []
        try:
            out.append(self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait())
        except queue.Empty:
            return out
        while len(out) < limit:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return out

    def peer(self, name: str) -> PeerStats | None:
        """What the listener knows of ``name`` (None once evicted or never heard)."""
        with self._lock:
            stats = self._peers.get(name)
            return PeerStats(stats.received, stats.last_seen) if stats else None

    @property
    def alive(self) -> bool:
        """Whether the receiving thread still runs (it stops only on :meth:`close`)."""
        return self._thread.is_alive()

    def stats(self) -> ListenerStats:
        with self._lock:
            return ListenerStats(
                self.received,
                self.accepted,
                dict(self.drops),
                len(self._peers),
                self.peers_evicted,
                self.alive,
                list(self.errors),
            )

    def close(self) -> None:
        """Stop the thread and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if not self._socket.closed:
            self._socket.close(linger=0)

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id the authenticator gave the connection (the client's public key under CURVE)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, KeyError, UnicodeDecodeError):
        return None
    return user if isinstance(user, str) else None
