"""The NIXL handshake across engine processes: a prefill engine serves its ranks' agent metadata and block layouts on
a pyzmq socket, a decode worker asks for them with a deadline.

vLLM's ``NixlConnector`` does the same over its "side channel": a ROUTER
socket in the prefill engine's scheduler process answers ``GET_META`` with
every worker's ``NixlAgentMetadata``, and the decode side finds it at the
``remote_host``/``remote_port`` the prefill's ``kv_transfer_params`` carry.
Here the answer is one :class:`Handshake`: the engine id, an *incarnation*
(new each time the engine starts, so a decode side can tell a restarted
prefill from the one it knew) and one :class:`~.decode.PeerInfo` per rank,
JSON in a two-frame reply. The serving thread answers a malformed request
with an error and keeps going; :func:`fetch` gives up after its timeout
(a dead or stopped prefill never answers) with :class:`HandshakeError`.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from .decode import PeerInfo

PROTOCOL = b"kvfsm-nixl/1"
"""Frame 0 of a request: the protocol and its version (another version is refused, never guessed at)."""
GET_META = b"GET_META"
OK = b"ok"
ERROR = b"error"
MAX_REQUEST = 256
"""Bytes a request frame may have: a request is two short constants."""


class HandshakeError(RuntimeError):
    """No usable handshake from a prefill engine: nobody answered in time, or the answer was refused."""


@dataclass(frozen=True)
class Handshake:
    """What a prefill engine tells a decode worker: who it is, which start of it this is, and its ranks."""

    engine_id: str
    incarnation: str
    peers: tuple[PeerInfo, ...]

    def encode(self) -> bytes:
        return json.dumps(
            {"engine_id": self.engine_id, "incarnation": self.incarnation, "peers": [p.to_json() for p in self.peers]}
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Handshake:
        """Parse a reply; anything that is not a handshake is a ValueError saying what is wrong with it."""
        try:
            data = json.loads(raw)
            engine_id, incarnation, peers = data["engine_id"], data["incarnation"], data["peers"]
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"not a NIXL handshake ({type(exc).__name__}: {exc})") from None
        if not isinstance(engine_id, str) or not isinstance(incarnation, str) or not isinstance(peers, list):
            raise ValueError("not a NIXL handshake: engine_id and incarnation must be strings, peers a list")
        return cls(engine_id, incarnation, tuple(PeerInfo.from_json(p) for p in peers))

    def ranks(self, engine_id: str, tp: int) -> list[PeerInfo]:
        """The peers, checked: from ``engine_id``, exactly ranks ``0 .. tp-1``; else a ValueError that says why."""
        if self.engine_id != engine_id:
            raise ValueError(f"the side channel serves engine {self.engine_id!r}, not {engine_id!r}")
        ranks = sorted(p.rank for p in self.peers)
        if ranks != list(range(tp)) or any(p.engine_id != engine_id for p in self.peers):
            raise ValueError(f"engine {engine_id!r} announced ranks {ranks}; this side expects prefill TP {tp}")
        return sorted(self.peers, key=lambda p: p.rank)


def new_incarnation() -> str:
    """A fresh incarnation for an engine that starts."""
    return uuid.uuid4().hex[:12]


@dataclass
class SideChannelStats:
    served: int = 0
    refused: Counter[str] = field(default_factory=Counter)


class SideChannel:
    """Serves one :class:`Handshake` on ``tcp://host:port`` (``port=0``: a free one) from a thread, until :meth:`close`."""

    def __init__(self, handshake: Handshake, *, host: str = "127.0.0.1", port: int = 0, poll_ms: int = 100) -> None:
        self.handshake = handshake
        self._payload = handshake.encode()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, 64 * 1024)
        try:
            if port:
                self._socket.bind(f"tcp://{host}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            self._context.term()
            raise HandshakeError(f"the NIXL side channel cannot listen on {host}:{port}: {exc}") from exc
        self.host = host
        self.port = port
        self.stats = SideChannelStats()
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvfsm-nixl-side-channel:{port}", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(self._poll_ms):
                    self._answer(self._socket.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                continue
            except zmq.ContextTerminated:
                return
            except Exception as exc:  # the channel outlives anything a request can cause
                self.stats.refused[f"internal:{type(exc).__name__}"] += 1

    def _answer(self, frames: Sequence[bytes]) -> None:
        # A REQ client's request reaches a ROUTER as [identity, b"", *frames].
        if len(frames) < 2 or frames[1] != b"":
            self.stats.refused["envelope"] += 1
            return
        identity, body = frames[0], list(frames[2:])
        if len(body) != 2 or any(len(f) > MAX_REQUEST for f in body):
            reason, detail = "frames", f"a request is [{PROTOCOL!r}, {GET_META!r}]"
        elif body[0] != PROTOCOL:
            reason, detail = "protocol", f"this side speaks {PROTOCOL!r}, not {body[0][:32]!r}"
        elif body[1] != GET_META:
            reason, detail = "request", f"unknown request {body[1][:32]!r}"
        else:
            self.stats.served += 1  # counted before the answer leaves: a client that has it finds it counted
            self._socket.send_multipart([identity, b"", OK, self._payload])
            return
        self.stats.refused[reason] += 1
        self._socket.send_multipart([identity, b"", ERROR, detail.encode()])

    def close(self) -> None:
        """Stop serving and close the socket (idempotent)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        if not self._socket.closed:
            self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> SideChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch(host: str, port: int, *, timeout: float) -> Handshake:
    """Ask the side channel at ``host:port`` for its handshake; :class:`HandshakeError` after ``timeout`` seconds."""
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    try:
        ms = max(1, int(timeout * 1000))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, ms)
        sock.setsockopt(zmq.SNDTIMEO, ms)
        sock.setsockopt(zmq.MAXMSGSIZE, 16 * 1024 * 1024)
        where = f"tcp://{host}:{port}"
        try:
            sock.connect(where)
            sock.send_multipart([PROTOCOL, GET_META])
            reply = sock.recv_multipart()
        except zmq.Again:
            raise HandshakeError(f"the NIXL side channel at {where} did not answer within {timeout} s") from None
        except zmq.ZMQError as exc:
            raise HandshakeError(f"the NIXL side channel at {where} failed: {exc}") from None
        if len(reply) != 2 or reply[0] not in (OK, ERROR):
            raise HandshakeError(f"the NIXL side channel at {where} answered {len(reply)} frame(s), not [status, body]")
        if reply[0] == ERROR:
            raise HandshakeError(f"the NIXL side channel at {where} refused the request: {reply[1][:200]!r}")
        try:
            return Handshake.decode(reply[1])
        except ValueError as exc:
            raise HandshakeError(f"the NIXL side channel at {where}: {exc}") from None
    finally:
        sock.close(linger=0)
        context.term()
