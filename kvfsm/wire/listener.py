"""The receiving end: a background thread that reads peers' messages and never dies, or grows, on what they send.

Seed 002's second bug was a bootstrap thread that parsed ABORT frames without
checking them and died on a malformed one, after which no abort was ever
answered. Here every message is decoded by :func:`~kvfsm.wire.codec.decode`
(and an optional ``check`` for the receiver's own id spaces); whatever fails
is counted by reason in :attr:`Listener.drops` and dropped. Valid messages go
to a bounded inbox that the owner's loop drains with :meth:`Listener.take`.

Memory is bounded in bytes whatever peers send (:func:`memory_bound`, derived
from the settings; docs/wire.md). Without CURVE (the default) the listener
reads TCP itself and parses ZMTP (:mod:`kvfsm.wire.zmtp`): libzmq would
keep every frame of a message until its last one came, without limit. So it
holds at most ``max_connections`` connections (more are refused and
counted), a connection at most :data:`~kvfsm.wire.zmtp.KEPT_BYTES` of what it
sent, the inbox at most ``inbox`` messages and ``inbox_bytes`` bytes (the
rest dropped as ``backlog``), and per-peer counts at most ``max_peers`` names
(least recently heard first out). With CURVE, libzmq's own CURVE does the
handshake; see :class:`Listener` for what that bounds and what it cannot.
"""

from __future__ import annotations

import collections
import contextlib
import selectors
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from .codec import MAX_BODY, REASONS, WireError, decode
from .curve import Curve
from .messages import Hello, Message, Metadata
from .zmtp import HELLO, KEPT_BYTES, Session, ZmtpError

Check = Callable[[Message], str | None]
"""The receiver's own validation: returns a drop reason (one of ``REASONS``), or None to accept."""

RECV_CHUNK = 64 << 10
"""One read from a connection; a single buffer shared by all of them."""
CONNECTION_BYTES = KEPT_BYTES + (8 << 10)
"""One open connection: what its parser keeps, plus its socket, parser and selector objects (about 2 KiB) doubled."""
PEER_BYTES = 512
"""One per-peer record: a name of at most 64 ASCII characters, its counts, its place in the LRU."""
ERRORS_KEPT = 16
SLACK_BYTES = 4 << 20
"""The interpreter's share: a message being decoded, the allocator's rounding and arenas, the counters."""

CONNECTION_DROPS: tuple[str, ...] = (
    "limit",  # refused at accept: max_connections were open
    "handshake",  # not a ZMTP 3 NULL PUSH peer, or not one within handshake_timeout (CURVE: libzmq's handshake failed)
    "auth",  # CURVE: the ZAP authenticator refused the client's key
    "protocol",  # broke ZMTP framing after the handshake
    "truncated",  # closed by the peer in mid-message (that message is lost)
    "disconnected",  # CURVE: libzmq closed a connection (a frame over max_frame, a peer that left, a refused handshake)
    "internal",  # the listener failed on the connection's bytes (a bug: see errors)
)
"""Why a connection was closed or refused; the listener counts each (``ListenerStats.connection_drops``)."""


def message_cost(message: Message) -> int:
    """An upper bound on the bytes ``message`` holds while it waits in the inbox (the inbox's budget counts these).

    The struct, its peer name (ASCII, 64 characters at most), its ints and
    the inbox's own slot fit in 512 bytes; a page costs its list slot and an
    int object (40 bytes, 48 counted); a session string at most 4 bytes a
    character.
    """
    if isinstance(message, Metadata):
        return 512 + 64 + 48 * len(message.pages)
    if isinstance(message, Hello):
        return 512 + 80 + 4 * len(message.session)
    return 512


def memory_bound(*, inbox_bytes: int, max_connections: int, max_peers: int) -> int:
    """The most the listener's state may add to its process's RSS, in bytes, for these settings (CURVE off)."""
    return (
        inbox_bytes + max_connections * CONNECTION_BYTES + RECV_CHUNK + max_peers * PEER_BYTES
        + ERRORS_KEPT * 1024 + SLACK_BYTES
    )  # fmt: skip


@dataclass
class PeerStats:
    """What the listener knows of one sender: how many of its messages it took, and when it last heard it."""

    received: int = 0
    last_seen: float = 0.0


@dataclass
class ListenerStats:
    """A snapshot of the listener's counters.

    ``received == accepted + sum(drops.values())``: every message the
    listener began to read is taken or dropped under one reason.
    ``connection_drops`` counts connections closed or refused, by reason
    (:data:`CONNECTION_DROPS`); ``connections`` is how many are open.
    """

    received: int
    accepted: int
    drops: dict[str, int]
    peers: int
    peers_evicted: int
    alive: bool
    errors: list[str] = field(default_factory=list)
    connections: int = 0
    connection_drops: dict[str, int] = field(default_factory=dict)
    inbox_bytes: int = 0


class _Connection:
    """A TCP connection of the listener's own transport: its socket, its ZMTP session, its handshake deadline."""

    __slots__ = ("sock", "session", "deadline")

    def __init__(self, sock: socket.socket, session: Session, deadline: float) -> None:
        self.sock = sock
        self.session = session
        self.deadline = deadline


class _Sink:
    """What a ZMTP session hands its listener: a message judged early, or a whole two-frame one to decode."""

    __slots__ = ("_listener",)

    def __init__(self, listener: Listener) -> None:
        self._listener = listener

    def dropped(self, reason: str) -> None:
        self._listener._count(reason)

    def complete(self, header: bytes, body: bytes) -> None:
        self._listener._judge([header, body], None)


class Listener:
    """Binds 127.0.0.1 by default and decodes in a thread of its own until :meth:`close`.

    ``port=0`` picks a free port (see :attr:`endpoint`); peers are
    :class:`~kvfsm.wire.Sender` (a PUSH socket). Without ``curve`` the
    listener reads TCP itself and its memory is bounded by
    :meth:`memory_bound`. With ``curve``, libzmq's PULL socket does the CURVE
    handshake (in a context and with an authenticator of this listener's own,
    both released by :meth:`close`): only peers holding a client key the
    curve allows can connect, and a message must name the peer its key
    belongs to. libzmq bounds each frame (``max_frame``) and each
    connection's queue (``rcvhwm`` messages), but keeps a message's frames
    until its last one comes, so with CURVE a peer holding a key must be
    trusted not to stream a message without end; a peer without one is
    refused at the handshake.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        check: Check | None = None,
        inbox: int = 65536,
        inbox_bytes: int = 32 << 20,
        max_peers: int = 256,
        max_frame: int = 64 << 10,
        max_connections: int = 64,
        handshake_timeout: float = 5.0,
        rcvhwm: int = 128,
        curve: Curve | None = None,
        poll_ms: int = 50,
    ) -> None:
        for name, value in (
            ("inbox", inbox), ("inbox_bytes", inbox_bytes), ("max_peers", max_peers), ("max_frame", max_frame),
            ("max_connections", max_connections), ("rcvhwm", rcvhwm), ("poll_ms", poll_ms),
        ):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Listener({name}={value!r}): must be a positive int")
        if max_frame < MAX_BODY:
            raise ValueError(f"Listener(max_frame={max_frame}): must hold a body of {MAX_BODY} bytes")
        if handshake_timeout <= 0:
            raise ValueError(f"Listener(handshake_timeout={handshake_timeout!r}): must be positive")
        self._curve = curve
        self._check = check
        self._inbox_limit = inbox
        self._inbox_budget = inbox_bytes
        self._max_peers = max_peers
        self._max_frame = max_frame
        self._max_connections = max_connections
        self._handshake_timeout = handshake_timeout
        self._poll_ms = poll_ms
        self._inbox: collections.deque[tuple[Message, int]] = collections.deque()
        self._inbox_used = 0
        self._ready = threading.Condition(threading.Lock())
        self._peers: OrderedDict[str, PeerStats] = OrderedDict()
        self.drops: Counter[str] = Counter()
        self.connection_drops: Counter[str] = Counter()
        self.received = 0
        self.accepted = 0
        self.peers_evicted = 0
        self.errors: list[str] = []
        self._open = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        # the own transport
        self._server: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._connections: dict[socket.socket, _Connection] = {}
        self._handshaking: OrderedDict[socket.socket, _Connection] = OrderedDict()
        self._sink = _Sink(self)
        # libzmq's, with CURVE
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._auth: ThreadAuthenticator | None = None
        try:
            if curve is None:
                port = self._bind_tcp(host, port)
                target = self._serve_tcp
            else:
                port = self._bind_zmq(host, port, curve, rcvhwm)
                target = self._serve_zmq
        except BaseException:
            self._release()
            raise
        self.endpoint = f"tcp://{host}:{port}"
        self.port = port
        self._thread = threading.Thread(target=target, name=f"kvfsm-listener:{port}", daemon=True)
        self._thread.start()

    def memory_bound(self) -> int | None:
        """The most this listener's state may add to its process's RSS, in bytes (None with CURVE: not bounded in bytes)."""
        if self._curve is not None:
            return None
        return memory_bound(
            inbox_bytes=self._inbox_budget, max_connections=self._max_connections, max_peers=self._max_peers
        )

    # -- judging a message (either transport) ----------------------------------------

    def _judge(self, frames: list[bytes], user: str | None) -> None:
        try:
            message = decode(frames)
        except WireError as exc:
            self._count(exc.reason)
            return
        if self._curve is not None and not self._curve.may_speak_for(user, message.peer):
            self._count("unauthenticated")
            return
        if self._check is not None:
            reason = self._check(message)
            if reason is not None:
                self._count(reason if reason in REASONS else "invalid")
                return
        self._seen(message.peer)
        cost = message_cost(message)
        with self._ready:
            full = len(self._inbox) >= self._inbox_limit or self._inbox_used + cost > self._inbox_budget
            if not full:
                self._inbox.append((message, cost))
                self._inbox_used += cost
                self._ready.notify()
        self._count("backlog" if full else None)

    def _count(self, reason: str | None) -> None:
        """One message received: taken (``reason`` None) or dropped under ``reason``."""
        with self._lock:
            self.received += 1
            if reason is None:
                self.accepted += 1
            else:
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

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            if len(self.errors) < ERRORS_KEPT:
                self.errors.append(repr(exc)[:512])

    def _dropped_connection(self, reason: str) -> None:
        with self._lock:
            self.connection_drops[reason] += 1

    # -- the own transport (no CURVE) -------------------------------------------------

    def _bind_tcp(self, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        self._server = server
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds the port again at once
        try:
            server.bind((host, port))
        except OSError as exc:
            raise OSError(exc.errno, f"kvfsm Listener cannot bind {host}:{port}: {exc.strerror}") from None
        server.listen(128)
        server.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(server, selectors.EVENT_READ, None)
        bound: int = server.getsockname()[1]
        return bound

    def _serve_tcp(self) -> None:
        selector = self._selector
        assert selector is not None
        buffer = bytearray(RECV_CHUNK)
        view = memoryview(buffer)
        while not self._stop.is_set():
            try:
                for key, _ in selector.select(self._poll_ms / 1000):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data, buffer, view)
                self._expire()
            except Exception as exc:  # the listener outlives anything a peer can cause
                self._dropped_connection("internal")
                self._failed(exc)

    def _accept(self) -> None:
        server, selector = self._server, self._selector
        assert server is not None and selector is not None
        for _ in range(64):  # then the connections already open get their turn
            try:
                sock, _ = server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, or the peer gave up before accept: nothing is held
                self._dropped_connection("limit")
                self._failed(exc)
                return
            if len(self._connections) >= self._max_connections:
                _abort(sock)
                self._dropped_connection("limit")
                continue
            sock.setblocking(False)
            try:
                sent = sock.send(HELLO)
            except OSError:
                sent = 0
            if sent != len(HELLO):  # 64 + 30 bytes into an empty send buffer: only a dead peer refuses them
                _abort(sock)
                self._dropped_connection("handshake")
                continue
            session = Session(self._sink, self._max_frame)
            connection = _Connection(sock, session, time.monotonic() + self._handshake_timeout)
            self._connections[sock] = connection
            self._handshaking[sock] = connection
            selector.register(sock, selectors.EVENT_READ, connection)
            with self._lock:
                self._open = len(self._connections)

    def _read(self, connection: _Connection, buffer: bytearray, view: memoryview) -> None:
        try:
            n = connection.sock.recv_into(buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:  # the peer left
            self._close(connection, "truncated" if connection.session.in_message else None)
            return
        session = connection.session
        try:
            session.feed(view[:n])
        except ZmtpError as exc:
            self._close(connection, exc.reason)
            return
        except Exception as exc:
            self._failed(exc)
            self._close(connection, "internal")
            return
        if session.ready and connection.sock in self._handshaking:
            del self._handshaking[connection.sock]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._handshaking:
            connection = next(iter(self._handshaking.values()))
            if connection.deadline > now:
                return
            self._close(connection, "handshake")

    def _close(self, connection: _Connection, reason: str | None) -> None:
        sock = connection.sock
        self._connections.pop(sock, None)
        self._handshaking.pop(sock, None)
        if self._selector is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
        _abort(sock)
        with self._lock:  # one snapshot: the drop and the open count together
            self._open = len(self._connections)
            if reason is not None:
                self.connection_drops[reason] += 1

    # -- libzmq's transport (CURVE) ---------------------------------------------------

    def _bind_zmq(self, host: str, port: int, curve: Curve, rcvhwm: int) -> int:
        self._context = context = zmq.Context()  # its own: ZAP binds once per context
        self._auth = curve.authenticate(context)
        self._socket = sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        curve.serve(sock)
        self._monitor = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )  # fmt: skip
        try:
            if port:
                sock.bind(f"tcp://{host}:{port}")
                return port
            bound: int = sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, f"kvfsm Listener cannot bind {host}:{port}: {exc.strerror}") from None
        return bound

    def _serve_zmq(self) -> None:
        sock, monitor = self._socket, self._monitor
        assert sock is not None and monitor is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self._poll_ms))
                if monitor in ready:
                    self._events(monitor)
                if sock in ready:
                    for _ in range(1024):  # then the monitor gets its turn
                        self._receive_one(sock)
            except zmq.Again:
                continue
            except zmq.ContextTerminated:
                return
            except Exception as exc:  # the listener outlives anything a message can cause
                self._dropped_connection("internal")
                self._failed(exc)

    def _events(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_ACCEPTED:
                with self._lock:
                    self._open += 1
            elif event == zmq.EVENT_DISCONNECTED:
                with self._lock:
                    self._open = max(0, self._open - 1)
                self._dropped_connection("disconnected")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._dropped_connection("auth")
            else:
                self._dropped_connection("handshake")

    def _receive_one(self, sock: zmq.Socket[bytes]) -> None:
        """Read one multipart message without ever keeping more than two frames of it."""
        first = sock.recv(zmq.NOBLOCK, copy=False)
        frames = [first.bytes]
        user = _user_id(first)
        count = 1
        while sock.getsockopt(zmq.RCVMORE):
            frame = sock.recv(copy=False)
            count += 1
            if count <= 2:
                frames.append(frame.bytes)
        if count != 2:
            self._count("frames")
            return
        self._judge(frames, user)

    # -- the owner's side ---------------------------------------------------------

    def take(self, limit: int = 1024, timeout: float = 0.0) -> list[Message]:
        """Up to ``limit`` messages in arrival order, waiting at most ``timeout`` seconds for the first."""
        with self._ready:
            if timeout > 0 and not self._inbox:
                self._ready.wait_for(lambda: bool(self._inbox), timeout)
            out: list[Message] = []
            while self._inbox and len(out) < limit:
                message, cost = self._inbox.popleft()
                self._inbox_used -= cost
                out.append(message)
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
        with self._ready:
            used = self._inbox_used
        with self._lock:
            return ListenerStats(
                self.received,
                self.accepted,
                dict(self.drops),
                len(self._peers),
                self.peers_evicted,
                self.alive,
                list(self.errors),
                self._open,
                dict(self.connection_drops),
                used,
            )

    def close(self) -> None:
        """Stop the thread and release every socket, the authenticator and the context it started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._release()

    def _release(self) -> None:
        for sock in list(self._connections):
            _abort(sock)
        self._connections.clear()
        self._handshaking.clear()
        if self._selector is not None:
            self._selector.close()
        if self._server is not None:
            self._server.close()
        if self._socket is not None and not self._socket.closed:
            if self._monitor is not None:
                self._socket.disable_monitor()
            self._socket.close(linger=0)
        if self._monitor is not None:
            self._monitor.close(linger=0)
        auth = self._auth
        if auth is not None:
            self._auth = None
            auth.stop()
        if self._context is not None:
            self._context.term()
        with self._lock:
            self._open = 0

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _abort(sock: socket.socket) -> None:
    """Close with a reset: no TIME_WAIT left behind for every refused or dropped peer."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZAP User-Id the authenticator gave the connection (the client's public key under CURVE)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, KeyError, UnicodeDecodeError):
        return None
    return user if isinstance(user, str) else None
