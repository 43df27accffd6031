"""Optional CURVE authentication (pyzmq's ``zmq.auth``): only peers holding an allowed key reach the listener.

Without it anyone who can reach the port can send ABORT for any room. With
it, the ZAP handshake refuses a client whose public key is not allowed (its
messages never arrive), and the listener drops a message whose ``peer`` is
not the name that key was issued to, so one peer cannot abort or complete
another's request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True)
class ClientKey:
    """What a connecting peer needs: its own key pair and the listener's public key (all Z85)."""

    name: str
    public: bytes
    secret: bytes
    server_public: bytes

    def apply(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` a CURVE client of the listener (before ``connect``)."""
        socket.curve_publickey = self.public
        socket.curve_secretkey = self.secret
        socket.curve_serverkey = self.server_public


class _Allowed:
    """The ZAP credentials callback: a client key is allowed exactly when it was issued to a peer."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = frozenset(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class Curve:
    """The listener's key pair and the client keys it accepts, each issued to one peer name.

    It holds keys only: each :class:`~kvfsm.wire.Listener` given a curve
    starts an authenticator of its own (:meth:`authenticate`) and stops it in
    ``close()``, so a listener restarted with new keys, or a second one with
    other keys in the same process, never meets a stale one.
    """

    def __init__(self, public: bytes, secret: bytes, clients: Mapping[str, bytes]) -> None:
        self.public = public
        self.secret = secret
        self.names = {key.decode("ascii"): name for name, key in clients.items()}
        """Client public key (Z85 text, the ZAP User-Id) → the peer name it may use."""

    @classmethod
    def generate(cls, peers: Iterable[str]) -> tuple[Curve, dict[str, ClientKey]]:
        """A fresh listener key pair and one client key per peer name."""
        public, secret = zmq.curve_keypair()
        keys: dict[str, ClientKey] = {}
        for name in peers:
            cpub, csec = zmq.curve_keypair()
            keys[name] = ClientKey(name, cpub, csec, public)
        return cls(public, secret, {name: key.public for name, key in keys.items()}), keys

    def authenticate(self, context: zmq.Context[zmq.Socket[bytes]]) -> ThreadAuthenticator:
        """Start a ZAP authenticator on ``context`` that allows exactly these client keys; the caller stops it.

        ZAP binds ``inproc://zeromq.zap.01`` once per context, so the context
        must be one no other authenticator runs on (the listener makes its own).
        """
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; install pyzmq's bundled libzmq (pip install pyzmq)")
        auth = ThreadAuthenticator(context)
        auth.start()
        try:
            auth.configure_curve_callback("*", credentials_provider=_Allowed(k.encode("ascii") for k in self.names))
        except BaseException:
            auth.stop()
            raise
        return auth

    def serve(self, socket: zmq.Socket[bytes]) -> None:
        """Make ``socket`` a CURVE server with this key pair (before ``bind``)."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def may_speak_for(self, user_id: str | None, peer: str) -> bool:
        """Whether the connection authenticated as ``user_id`` may send messages signed ``peer``."""
        return user_id is not None and self.names.get(user_id) == peer

    def close(self) -> None:
        """Nothing to release: the listener owns the authenticator. Kept for callers written before it did."""
