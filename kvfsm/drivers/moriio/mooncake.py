"""The transport over Mooncake's TransferEngine (tcp, P2PHANDSHAKE) with pyzmq for the control messages.

A batch is one ``transfer_submit_write`` per block; its status is the
``transfer_check_status`` of each. That call frees Mooncake's batch once it
answers a final value (1 done, -1 failed), and polling it again is undefined
(it reads "pending" again): so each final answer is kept and never asked
twice, and an id of 0 (the submit itself failed) is never polled. A batch is
reported only when every transfer in it is final, because a write that
answered -1 has been seen to land later (dependencies_measured.md §7); the
request's ``transfer_timeout`` bounds the wait.

The control messages (``remote_blocks``, ``write_done``, ``release``) go
over ZMQ PUSH/PULL on loopback, as vLLM's MoRIIO connector sends them. A
peer's name is ``"<TransferEngine session>|<ZMQ endpoint>"``; a peer that is
only ever notified (a prefill rank the decode side announces its blocks to)
may be named by its endpoint alone, ``"|tcp://host:port"`` (:func:`notify_only`),
as vLLM's router names a prefill engine's notify port.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from ..dataplane import Extent
from ..pd.transport import mooncake_engine
from .messages import Message, decode_all, encode
from .transport import Status, TransferError

PENDING, DONE = 0, 1
UNREACHABLE = "127.0.0.1:1|tcp://127.0.0.1:1"
"""A peer nobody listens at: a write to it fails in the engine (submit answers id 0)."""


@dataclass
class _Batch:
    ids: list[int]
    final: dict[int, int] = field(default_factory=dict)
    """Index into ``ids`` → final answer (1 or negative), kept so that no id is polled after it ended."""


class Mailbox:
    """A PULL socket on loopback for this engine's messages, and a PUSH socket per peer it writes to."""

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
        self._push: dict[str, zmq.Socket[bytes]] = {}

    def send(self, endpoint: str, frame: bytes) -> None:
        """Queue ``frame`` for ``endpoint``; a full queue drops it (counted), it never blocks."""
        sock = self._push.get(endpoint)
        if sock is None:
            sock = self.context.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.hwm)
            sock.connect(endpoint)
            self._push[endpoint] = sock
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped["backlog"] += 1

    def take(self) -> list[bytes]:
        frames = []
        while True:
            try:
                frames.append(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def wait(self, seconds: float) -> bool:
        """Block until a message is waiting or ``seconds`` have passed; True if one is."""
        return bool(self.pull.poll(int(seconds * 1000)))

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(0)
        self.pull.close(0)
        self.context.term()


class MooncakeTransport:
    """One engine's TransferEngine (its blocks registered with it) and mailbox."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """``port``: the mailbox's (0: a free one)."""
        self.mailbox = Mailbox(host, port=port)
        try:
            self.engine: Any = mooncake_engine()
        except BaseException:
            self.mailbox.close()
            raise
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"
        self.dropped = self.mailbox.dropped
        self.live = 0
        """Batches posted and not yet released."""
        self.posted: Counter[str] = Counter()
        """``transfers`` (``transfer_submit_write`` calls), ``bytes`` they carry, ``refused`` (submit answered 0)."""

    @property
    def name(self) -> str:
        return f"{self.session}|{self.mailbox.endpoint}"

    def register(self, tensor: torch.Tensor) -> None:
        rc = self.engine.register_memory(int(tensor.data_ptr()), tensor.numel() * tensor.element_size())
        if rc != 0:
            raise TransferError("register_memory", self.session, f"returned {rc}")

    def write(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        session = _session(peer)
        submit = self.engine.transfer_submit_write
        ids = [submit(session, src, dst, n) for (src, n), dst in zip(local, remote, strict=True)]
        self.live += 1
        self.posted["transfers"] += len(ids)
        self.posted["bytes"] += sum(n for _, n in local)
        self.posted["refused"] += ids.count(0)
        return _Batch(ids)

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        raise TransferError("batch_read", peer, "TransferEngine has no asynchronous single read; use WRITE mode")

    def status(self, batch: object) -> Status:
        if not isinstance(batch, _Batch):
            raise TypeError(f"not a batch of this transport: {batch!r}")
        for i, tid in enumerate(batch.ids):
            if i in batch.final:
                continue
            rc = self.engine.transfer_check_status(tid) if tid != 0 else -1
            if rc != PENDING:
                batch.final[i] = rc
        if len(batch.final) < len(batch.ids):
            return "pending"
        return "done" if all(rc == DONE for rc in batch.final.values()) else "failed"

    def release(self, batch: object) -> None:
        self.live -= 1

    def notify(self, peer: str, message: Message) -> None:
        self.mailbox.send(_endpoint(peer), encode(message))

    def messages(self) -> list[Message]:
        return decode_all(self.mailbox.take(), self.dropped)

    def close(self) -> None:
        self.mailbox.close()


def notify_only(host: str, port: int) -> str:
    """The name of a peer this side only sends messages to, by its mailbox: ``"|tcp://host:port"``."""
    return f"|tcp://{host}:{port}"


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
