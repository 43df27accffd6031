"""Fault injection in front of a transport, decided per transfer id so that each transfer meets at most one fault.

:class:`FaultPlan` picks, from a hash of the seed and the transfer id, whether
a transfer is hit (a fraction ``rate``) and by which fault (uniformly among
``kinds``). Both engines wrap their transport in a :class:`FaultyTransport`
over the same plan and each applies the faults that happen on its side:

- ``failed_write`` / ``failed_read``: the batch is posted where it cannot
  succeed: to addresses the peer never registered (a NIXL agent, real or
  embedded, refuses the post), or (``unreachable`` given) to a peer nobody
  listens at. Mooncake answers both with -1, but a write its server rejected
  also stalls the other writes on that connection for about a second, so the
  Mooncake tests use the unreachable peer;
- ``raising_write`` / ``raising_read``: posting raises :class:`TransferError`;
- ``lost_write_done``, ``lost_release``, ``lost_remote_blocks`` (a remote that
  never sends its blocks): the message is not sent;
- ``duplicate_write_done``, ``duplicate_release``, ``duplicate_remote_blocks``:
  it is sent twice.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence

import torch

from ..dataplane import Extent
from .messages import Message, Release, RemoteBlocks, WriteDone
from .transport import Status, TransferError, Transport

WRITE_FAULTS = (
    "failed_write", "raising_write", "lost_write_done", "duplicate_write_done", "lost_remote_blocks",
    "duplicate_remote_blocks",
)  # fmt: skip
READ_FAULTS = ("failed_read", "raising_read", "lost_release", "duplicate_release")
UNREGISTERED = 4096
"""An address no engine registers: a transfer to it is refused by the engine that owns the peer's memory."""

_MESSAGES = {WriteDone: "write_done", Release: "release", RemoteBlocks: "remote_blocks"}


class FaultPlan:
    """Which transfer ids meet which fault: a fraction ``rate`` of them, one of ``kinds`` each."""

    def __init__(self, rate: float, kinds: Sequence[str], seed: int = 0) -> None:
        unknown = set(kinds) - set(WRITE_FAULTS) - set(READ_FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; choose from {WRITE_FAULTS + READ_FAULTS}")
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate must be within [0, 1], not {rate}")
        self.rate = rate
        self.kinds = tuple(kinds)
        self.seed = seed

    def fault(self, transfer_id: str) -> str | None:
        if not self.kinds:
            return None
        h = zlib.crc32(f"{self.seed}/{transfer_id}".encode())
        if (h % 10_000) >= self.rate * 10_000:
            return None
        return self.kinds[(h // 10_000) % len(self.kinds)]

    def count(self, transfer_ids: Sequence[str]) -> Counter[str]:
        """How many of ``transfer_ids`` each fault hits (what a run injects, known in advance)."""
        return Counter(f for f in map(self.fault, transfer_ids) if f is not None)


class FaultyTransport:
    """``inner`` with the faults of ``plan`` applied to its own batches and messages; ``injected`` counts them."""

    def __init__(self, inner: Transport, plan: FaultPlan, unreachable: str | None = None) -> None:
        self.inner = inner
        self.plan = plan
        self.unreachable = unreachable
        self.injected: Counter[str] = Counter()

    @property
    def name(self) -> str:
        return self.inner.name

    def register(self, tensor: torch.Tensor) -> None:
        self.inner.register(tensor)

    def write(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        target, where = self._posting("write", peer, remote, uid)
        return self.inner.write(target, local, where, uid)

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        target, where = self._posting("read", peer, remote, uid)
        return self.inner.read(target, local, where, uid)

    def status(self, batch: object) -> Status:
        return self.inner.status(batch)

    def release(self, batch: object) -> None:
        self.inner.release(batch)

    def notify(self, peer: str, message: Message) -> None:
        if not isinstance(message, (WriteDone, Release, RemoteBlocks)):
            self.inner.notify(peer, message)
            return
        name = _MESSAGES[type(message)]
        fault = self.plan.fault(message.transfer_id)
        if fault == f"lost_{name}":
            self.injected[fault] += 1
            return
        self.inner.notify(peer, message)
        if fault == f"duplicate_{name}":
            self.injected[fault] += 1
            self.inner.notify(peer, message)

    def messages(self) -> list[Message]:
        return self.inner.messages()

    def _posting(self, op: str, peer: str, remote: Sequence[int], uid: str) -> tuple[str, Sequence[int]]:
        """Where the batch really goes: ``(peer, remote)``, or a place it fails; raises for a raising fault."""
        fault = self.plan.fault(uid)
        if fault == f"raising_{op}":
            self.injected[fault] += 1
            raise TransferError(f"batch_{op}", peer, "injected failure")
        if fault == f"failed_{op}":
            self.injected[fault] += 1
            if self.unreachable is not None:
                return self.unreachable, remote
            return peer, [UNREGISTERED + i for i in range(len(remote))]
        return peer, remote
