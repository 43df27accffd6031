"""An in-process stand-in for the transfer engine: the same :class:`~.transport.Transport`, with stoppable and killable peers.

A :class:`Fabric` is the network (:mod:`kvfsm.drivers.fabric`, the one the
NIXL stand-in runs on too): endpoints find each other by name and a batch
copies bytes between registered tensors of the same process when its status
is first polled. A stopped peer leaves batches pending and swallows
messages (a SIGSTOPped process); a dead one fails every batch and refuses
every post. Messages go through the msgpack codec, as on the wire.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..dataplane import Extent
from ..fabric import Network, Node
from .messages import Message, decode_all, encode
from .transport import Status, TransferError


@dataclass
class _Batch:
    peer: str
    copies: list[tuple[int, int, int]]
    """(destination, source, length) per transfer."""
    valid: bool
    status: Status = "pending"


class Fabric(Network["EmbeddedTransport"]):
    """The MoRIIO endpoints of one process by name, and which of them are stopped or dead."""

    @property
    def endpoints(self) -> dict[str, EmbeddedTransport]:
        return self.nodes

    def endpoint(self, name: str) -> EmbeddedTransport:
        return self.join(name, EmbeddedTransport)


class EmbeddedTransport(Node):
    """A transfer endpoint in process: a batch lands on its first :meth:`status` unless the peer is stopped."""

    def __init__(self, name: str, fabric: Network[EmbeddedTransport]) -> None:
        super().__init__(name, fabric)
        self._inbox: list[bytes] = []
        self.live: set[int] = set()
        """Ids of batches posted and not yet released (empty once every request ended)."""
        self.dropped: Counter[str] = Counter()

    def write(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        target = self._peer(peer, "batch_write")
        copies = [(dst, src, n) for (src, n), dst in zip(local, remote, strict=True)]
        valid = all(self.registered(s, n) and target.registered(d, n) for d, s, n in copies)
        return self._post(_Batch(peer, copies, valid))

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        target = self._peer(peer, "batch_read")
        copies = [(dst, src, n) for (dst, n), src in zip(local, remote, strict=True)]
        valid = all(target.registered(s, n) and self.registered(d, n) for d, s, n in copies)
        return self._post(_Batch(peer, copies, valid))

    def status(self, batch: object) -> Status:
        if not isinstance(batch, _Batch):
            raise TypeError(f"not a batch of this transport: {batch!r}")
        if batch.status != "pending":
            return batch.status
        if batch.peer in self.fabric.dead or not batch.valid:  # "WRITE rejected by server"
            batch.status = "failed"
        elif batch.peer not in self.fabric.stopped:
            for dst, src, n in batch.copies:
                ctypes.memmove(dst, src, n)
            batch.status = "done"
        return batch.status

    def release(self, batch: object) -> None:
        self.live.discard(id(batch))

    def notify(self, peer: str, message: Message) -> None:
        target = self.fabric.reachable(peer)
        if target is None:
            self.dropped[type(message).__name__] += 1  # a PUSH to nobody: lost, never raised
            return
        target._inbox.append(encode(message))

    def deliver_raw(self, raw: bytes) -> None:
        """Put bytes in this endpoint's inbox as a peer would (a malformed frame, in the tests)."""
        self._inbox.append(raw)

    def messages(self) -> list[Message]:
        raw, self._inbox = self._inbox, []
        return decode_all(raw, self.dropped)

    def _post(self, batch: _Batch) -> _Batch:
        self.live.add(id(batch))
        return batch

    def _peer(self, name: str, op: str) -> EmbeddedTransport:
        if name in self.fabric.dead:
            raise TransferError(op, name, "the peer is dead")
        target: EmbeddedTransport | None = self.fabric.nodes.get(name)
        if target is None:
            raise TransferError(op, name, "no such peer")
        return target
