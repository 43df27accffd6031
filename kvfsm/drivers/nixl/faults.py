"""Fault injection in front of a data-plane agent: failed transfers, lost, duplicated and malformed notifications.

A seeded fraction of posted transfers (READs, on the NIXL decode side) is hit
by one fault, chosen uniformly: the post raises (a failed transfer), the
transfer goes out without its notification (lost), is followed by a second
copy of its notification (duplicated), or is followed by a message the peer
cannot parse (malformed). ``injected`` counts each.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import torch

from ..dataplane import DataPlane, Extent, Op, TransferError, XferState

FAULTS = ("failed_transfer", "lost_notif", "duplicate_notif", "malformed_notif")
MALFORMED = (b"no-colon", b"p-1:", b":4", b"p-1:four", b"p-1:0", b"\xff\xfe:1", b"")


class FaultyAgent:
    """``inner`` with a fraction ``rate`` of posted transfers hit by one of :data:`FAULTS`."""

    def __init__(self, inner: DataPlane, rate: float, seed: int = 0, faults: Sequence[str] = FAULTS) -> None:
        unknown = set(faults) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
        self.inner = inner
        self.rate = rate
        self.faults = tuple(faults)
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(seed)

    @property
    def name(self) -> str:
        return self.inner.name

    def register(self, tensor: torch.Tensor) -> None:
        self.inner.register(tensor)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def add_peer(self, metadata: bytes) -> str:
        return self.inner.add_peer(metadata)

    def post(self, op: Op, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        fault = self._rng.choice(self.faults) if self._rng.random() < self.rate else None
        if fault is not None:
            self.injected[fault] += 1
        if fault == "failed_transfer":
            raise TransferError("transfer", peer, "injected failure")
        handle = self.inner.post(op, peer, local, remote, b"" if fault == "lost_notif" else notif)
        if fault == "duplicate_notif":
            self.inner.send_notif(peer, notif)
        elif fault == "malformed_notif":
            self.inner.send_notif(peer, self._rng.choice(MALFORMED[:-1]))
        return handle

    def state(self, handle: object) -> XferState:
        return self.inner.state(handle)

    def release(self, handle: object) -> None:
        self.inner.release(handle)

    def send_notif(self, peer: str, message: bytes) -> None:
        self.inner.send_notif(peer, message)

    def notifs(self) -> list[tuple[str, bytes]]:
        return self.inner.notifs()
