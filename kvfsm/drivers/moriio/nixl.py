"""The transport over NIXL: the NIXL driver's agents (:class:`~kvfsm.drivers.nixl.agent.NixlAgent`), READ mode.

A batch is one NIXL READ of every block (``initialize_xfer`` + ``transfer``),
its status ``check_xfer_state``; NIXL has no transfer timeout, so the read
consumer's ``transfer_timeout`` is the only bound. The control messages ride
NIXL notifications (``send_notif`` / ``get_new_notifs``), msgpack-encoded. A
NIXL agent here posts READs only, so this transport serves READ mode; WRITE
mode runs on the embedded and Mooncake transports.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from ..nixl.agent import NixlAgent
from ..nixl.transport import TransferError as NixlError
from .messages import Message, decode_all, encode
from .transport import Extent, Status, TransferError


class NixlTransport:
    """One NIXL agent (UCX backend, DRAM) behind the MoRIIO :class:`~.transport.Transport` protocol."""

    def __init__(self, name: str) -> None:
        self.agent = NixlAgent(name)
        self.dropped: Counter[str] = Counter()

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
        raise TransferError("batch_write", peer, "this transport posts NIXL READs only; use READ mode")

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        try:
            return self.agent.read(peer, local, [(a, n) for a, (_, n) in zip(remote, local, strict=True)], b"")
        except NixlError as exc:
            raise TransferError("batch_read", peer, str(exc)) from exc

    def status(self, batch: object) -> Status:
        state = self.agent.state(batch)
        return "done" if state == "DONE" else "pending" if state == "PROC" else "failed"

    def release(self, batch: object) -> None:
        self.agent.release(batch)

    def notify(self, peer: str, message: Message) -> None:
        try:
            self.agent.send_notif(peer, encode(message))
        except NixlError:
            self.dropped["dead_peer"] += 1  # like a ZMQ PUSH to nobody: lost, never raised

    def messages(self) -> list[Message]:
        return decode_all([message for _sender, message in self.agent.notifs()], self.dropped)
