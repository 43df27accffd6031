"""MoRIIO's transport: the operations vLLM's ``moriio_engine.py`` uses, over any agent of the data plane
(:mod:`kvfsm.drivers.dataplane`), READ and WRITE mode.

MoRI's ``IOEngine`` registers memory, posts a batch of one-sided writes or
reads under a transfer uid (``Session.batch_write`` / ``batch_read``),
answers each with a ``TransferStatus`` that is polled, and leaves completion
messages to vLLM's own ZMQ sockets. The drivers see only
:class:`PlaneTransport`, which does the same over an agent. A batch is one READ or WRITE of every block (on NIXL, ``initialize_xfer`` +
``transfer``), its status the agent's ``state`` (``check_xfer_state``). The
control messages ride the agent's notifications (``send_notif`` /
``get_new_notifs``), msgpack-encoded, and a message to a dead peer is lost
and counted, as a ZMQ PUSH to nobody is. The agent is a real NIXL agent
(:class:`~kvfsm.drivers.nixl.agent.NixlAgent`, UCX on DRAM; NIXL has no
transfer timeout, so the specs' ``transfer_timeout`` is the only bound) or
the embedded one (:class:`~kvfsm.drivers.fabric.EmbeddedAgent`, with peers
that can be stopped or killed): the same code runs on both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import Literal

import torch

from ..dataplane import DataPlane, Extent, Op, TransferError
from .messages import Message, decode_all, encode

Status = Literal["done", "pending", "failed"]
"""A posted batch: every transfer succeeded, some still in flight, or every one ended and one failed."""


class PlaneTransport:
    """One engine's transfer endpoint over a data-plane agent: registered blocks, batches of writes or reads
    (a handle each, its :meth:`status` polled, then released), and messages."""

    def __init__(self, agent: DataPlane) -> None:
        self.agent = agent
        self.dropped: Counter[str] = Counter()
        """Messages lost (``dead_peer``: sent to a dead peer) and received frames dropped (``malformed``)."""

    @property
    def name(self) -> str:
        return self.agent.name

    def metadata(self) -> bytes:
        return self.agent.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.agent.add_peer(metadata)

    def register(self, tensor: torch.Tensor) -> None:
        self.agent.register(tensor)

    def write(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        return self._post("WRITE", peer, local, remote)

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        return self._post("READ", peer, local, remote)

    def _post(self, op: Op, peer: str, local: Sequence[Extent], remote: Sequence[int]) -> object:
        try:
            return self.agent.post(op, peer, local, [(a, n) for a, (_, n) in zip(remote, local, strict=True)], b"")
        except TransferError as exc:
            raise TransferError(f"batch_{op.lower()}", peer, f"{exc.op}: {exc.cause}") from exc

    def status(self, batch: object) -> Status:
        state = self.agent.state(batch)
        return "done" if state == "DONE" else "pending" if state == "PROC" else "failed"

    def release(self, batch: object) -> None:
        self.agent.release(batch)

    def notify(self, peer: str, message: Message) -> None:
        try:
            self.agent.send_notif(peer, encode(message))
        except TransferError:
            self.dropped["dead_peer"] += 1  # like a ZMQ PUSH to nobody: lost, never raised

    def messages(self) -> list[Message]:
        return decode_all([message for _sender, message in self.agent.notifs()], self.dropped)


def split_statuses(transport: PlaneTransport, batches: dict[Hashable, object]) -> tuple[list[Hashable], list[Hashable]]:
    """The keys whose batch is done and those whose batch failed, polling each once (a step's completions)."""
    done: list[Hashable] = []
    failed: list[Hashable] = []
    for key, batch in batches.items():
        status = transport.status(batch)
        if status == "done":
            done.append(key)
        elif status == "failed":
            failed.append(key)
    return done, failed
