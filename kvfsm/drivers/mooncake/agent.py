"""Mooncake's TransferEngine (tcp, P2PHANDSHAKE) as an agent of the data plane (:mod:`kvfsm.drivers.dataplane`),
with pyzmq for the notifications; imports ``zmq``, and ``mooncake`` when an agent is made.

A WRITE is one ``transfer_submit_write`` per extent; its state is the
``transfer_check_status`` of each. That call frees Mooncake's batch once it
answers a final value (1 done, -1 failed), and polling it again is undefined
(it reads "pending" again): so each final answer is kept and never asked
twice, and an id of 0 (the submit itself failed) is never polled. A transfer
is reported only when every write in it is final, because a write that
answered -1 has been seen to land later (dependencies_measured.md §7); the
caller's deadline bounds the wait. The TransferEngine has no asynchronous
single READ, so a READ is refused at the post.

Notifications go over ZMQ PUSH/PULL, two frames each (the sender's name, the
message), as vLLM's MoRIIO connector sends its messages over its own ZMQ
sockets. An agent's name is ``"<TransferEngine session>|<ZMQ endpoint>"``; a
peer that is only ever notified (a prefill rank the decode side announces
its blocks to) may be named by its endpoint alone, ``"|tcp://host:port"``
(:func:`notify_only`), as vLLM's router names a prefill engine's notify port.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from ..dataplane import Extent, Op, TransferError, XferState

PENDING, DONE = 0, 1
UNREACHABLE = "127.0.0.1:1|tcp://127.0.0.1:1"
"""A peer nobody listens at: a write to it fails in the engine (submit answers id 0)."""


def mooncake_engine() -> Any:
    """A Mooncake TransferEngine on loopback (tcp, P2PHANDSHAKE); ImportError says how to install it."""
    try:
        from mooncake.engine import TransferEngine  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ImportError(
            f"this needs Mooncake's TransferEngine: pip install 'kvfsm[mooncake]' "
            f"(and Debian libibverbs1 --no-install-recommends); import failed: {exc}"
        ) from exc
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # glog to stderr otherwise, a line per handshake
    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"TransferEngine.initialize on 127.0.0.1 (tcp, P2PHANDSHAKE) returned {rc}")
    return engine


class Mailbox:
    """A PULL socket on loopback for this agent's notifications, and a PUSH socket per peer it notifies."""

    def __init__(self, host: str = "127.0.0.1", hwm: int = 100_000, port: int = 0) -> None:
        """``port`` 0 binds a free one; another binds that one (a prefill rank the router names by it)."""
        self.context = zmq.Context()
        self.pull = self.context.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, hwm)
        try:
            if port:
                self.pull.bind(f"tcp://{host}:{port}")
            else:
                port = self.pull.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self.pull.close(0)
            self.context.term()
            raise TransferError("bind", f"tcp://{host}:{port}", f"{exc} (is another engine on that port?)") from exc
        self.endpoint = f"tcp://{host}:{port}"
        self.hwm = hwm
        self.dropped: Counter[str] = Counter()
        """``backlog``: a peer's queue was full, the notification dropped; ``malformed``: a received one was not
        two frames, a sender's name and a message."""
        self._push: dict[str, zmq.Socket[bytes]] = {}

    def send(self, endpoint: str, sender: str, message: bytes) -> None:
        """Queue ``message`` for ``endpoint``; a full queue drops it (counted), it never blocks."""
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        try:
            sock.send_multipart([sender.encode(), message], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped["backlog"] += 1

    def take(self) -> list[tuple[str, bytes]]:
        """Every notification waiting, as ``(sender, message)``; one not framed so is counted and dropped."""
        out: list[tuple[str, bytes]] = []
        while True:
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                sender, message = frames
                out.append((sender.decode(), message))
            except ValueError:  # not two frames, or a sender that is not UTF-8
                self.dropped["malformed"] += 1

    def wait(self, seconds: float) -> bool:
        """Block until a notification is waiting or ``seconds`` have passed; True if one is."""
        return bool(self.pull.poll(int(seconds * 1000)))

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(0)
        self.pull.close(0)
        self.context.term()


@dataclass(eq=False)  # a handle: hashed by identity, as NIXL's are
class _Writes:
    ids: list[int]
    peer: str
    notif: bytes
    final: dict[int, int] = field(default_factory=dict)
    """Index into ``ids`` → final answer (1 or negative), kept so that no id is polled after it ended."""


class MooncakeAgent:
    """One TransferEngine (its memory registered with it) and mailbox, behind the data plane's surface."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """``port``: the mailbox's (0: a free one)."""
        self.mailbox = Mailbox(host, port=port)
        try:
            self.engine: Any = mooncake_engine()
        except BaseException:
            self.mailbox.close()
            raise
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.live = 0
        """Transfers posted and not yet released."""
        self.posted: Counter[str] = Counter()
        """``transfers`` (``transfer_submit_write`` calls), ``bytes`` they carry, ``refused`` (submit answered 0)."""

    @property
    def name(self) -> str:
        return f"{self.session}|{self.mailbox.endpoint}"

    def register(self, tensor: torch.Tensor) -> None:
        rc = self.engine.register_memory(int(tensor.data_ptr()), tensor.numel() * tensor.element_size())
        if rc != 0:
            raise TransferError("register_memory", self.session, f"returned {rc}")

    def metadata(self) -> bytes:
        return self.name.encode()  # P2PHANDSHAKE: the session is all a peer needs

    def add_peer(self, metadata: bytes) -> str:
        return metadata.decode()

    def post(self, op: Op, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        if op != "WRITE":
            raise TransferError(op, peer, "the TransferEngine has no asynchronous single READ; write instead")
        session = _session(peer)
        submit = self.engine.transfer_submit_write
        ids = [submit(session, src, dst, n) for (src, n), (dst, _) in zip(local, remote, strict=True)]
        self.live += 1
        self.posted["transfers"] += len(ids)
        self.posted["bytes"] += sum(n for _, n in local)
        self.posted["refused"] += ids.count(0)
        return _Writes(ids, peer, notif)

    def state(self, handle: object) -> XferState:
        if not isinstance(handle, _Writes):
            raise TypeError(f"not a transfer of this agent: {handle!r}")
        if len(handle.final) == len(handle.ids):
            return _answer(handle)
        for i, tid in enumerate(handle.ids):
            if i in handle.final:
                continue
            rc = self.engine.transfer_check_status(tid) if tid != 0 else -1
            if rc != PENDING:
                handle.final[i] = rc
        if len(handle.final) < len(handle.ids):
            return "PROC"
        answer = _answer(handle)
        if answer == "DONE" and handle.notif:
            self.send_notif(handle.peer, handle.notif)
        return answer

    def release(self, handle: object) -> None:
        self.live -= 1

    def send_notif(self, peer: str, message: bytes) -> None:
        self.mailbox.send(_endpoint(peer), self.name, message)

    def notifs(self) -> list[tuple[str, bytes]]:
        return self.mailbox.take()

    def close(self) -> None:
        self.mailbox.close()


def notify_only(host: str, port: int) -> str:
    """The name of a peer this side only notifies, by its mailbox: ``"|tcp://host:port"``."""
    return f"|tcp://{host}:{port}"


def _answer(writes: _Writes) -> XferState:
    return "DONE" if all(rc == DONE for rc in writes.final.values()) else "ERR"


def _session(peer: str) -> str:
    session, sep, _ = peer.partition("|")
    if not sep or not session:
        raise TransferError("resolve", peer, "a peer name is '<TransferEngine session>|<ZMQ endpoint>'")
    return session


def _endpoint(peer: str) -> str:
    _, sep, endpoint = peer.partition("|")
    if not sep or not endpoint.startswith("tcp://"):
        raise TransferError("resolve", peer, "a peer name is '<TransferEngine session>|<ZMQ endpoint>'")
    return endpoint
