"""An in-process stand-in for the transfer engine: the same :class:`~.transport.Transport`, with stoppable and killable peers.

A :class:`Fabric` is the network: endpoints find each other by name and a
batch copies bytes between registered tensors of the same process when its
status is first polled. A stopped peer leaves batches pending and swallows
messages (a SIGSTOPped process); a dead one fails every batch and refuses
every post. Messages go through the msgpack codec, as on the wire.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .messages import Message, decode_all, encode
from .transport import Extent, Status, TransferError


@dataclass
class _Batch:
    peer: str
    copies: list[tuple[int, int, int]]
    """(destination, source, length) per transfer."""
    valid: bool
    status: Status = "pending"


@dataclass
class Fabric:
    """The endpoints of one process by name, and which of them are stopped or dead."""

    endpoints: dict[str, EmbeddedTransport] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)
    dead: set[str] = field(default_factory=set)

    def endpoint(self, name: str) -> EmbeddedTransport:
        if name in self.endpoints:
            raise ValueError(f"an endpoint named {name!r} is already on this fabric")
        self.endpoints[name] = transport = EmbeddedTransport(name, self)
        return transport


class EmbeddedTransport:
    """A transfer endpoint in process: a batch lands on its first :meth:`status` unless the peer is stopped."""

    def __init__(self, name: str, fabric: Fabric) -> None:
        self._name = name
        self.fabric = fabric
        self._memory: list[tuple[int, int]] = []
        self._inbox: list[bytes] = []
        self.live: set[int] = set()
        """Ids of batches posted and not yet released (empty once every request ended)."""
        self.dropped: Counter[str] = Counter()

    @property
    def name(self) -> str:
        return self._name

    def register(self, tensor: torch.Tensor) -> None:
        self._memory.append((int(tensor.data_ptr()), tensor.numel() * tensor.element_size()))

    def write(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        target = self._peer(peer, "batch_write")
        copies = [(dst, src, n) for (src, n), dst in zip(local, remote, strict=True)]
        valid = all(self._registered(s, n) and target._registered(d, n) for d, s, n in copies)
        return self._post(_Batch(peer, copies, valid))

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        target = self._peer(peer, "batch_read")
        copies = [(dst, src, n) for (dst, n), src in zip(local, remote, strict=True)]
        valid = all(target._registered(s, n) and self._registered(d, n) for d, s, n in copies)
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
        target = self.fabric.endpoints.get(peer)
        if target is None or peer in self.fabric.dead or peer in self.fabric.stopped:
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
        target = self.fabric.endpoints.get(name)
        if target is None:
            raise TransferError(op, name, "no such peer")
        return target

    def _registered(self, addr: int, n: int) -> bool:
        return any(base <= addr and addr + n <= base + size for base, size in self._memory)
