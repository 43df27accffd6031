"""An in-process stand-in for NIXL agents: same :class:`~.transport.Transport`, with peers that can be stopped or killed.

A :class:`Fabric` is the network (:mod:`kvfsm.drivers.fabric`, the one the
MoRIIO stand-in runs on too): agents find each other by name and a READ
copies bytes between registered tensors of the same process. A stopped peer
leaves READs in ``PROC`` and swallows notifications (as a SIGSTOPped process
does); a killed one makes every call to it raise (``nixlRemoteDisconnectError``).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ..fabric import Fabric as Network
from ..fabric import Node
from .transport import Extent, TransferError, XferState


@dataclass
class _Xfer:
    peer: str
    local: tuple[Extent, ...]
    remote: tuple[Extent, ...]
    notif: bytes
    done: bool = False


class Fabric(Network["EmbeddedAgent"]):
    """The NIXL agents of one process, by name, and which of them are stopped or dead."""

    @property
    def agents(self) -> dict[str, EmbeddedAgent]:
        return self.nodes

    def agent(self, name: str) -> EmbeddedAgent:
        return self.join(name, EmbeddedAgent)


class EmbeddedAgent(Node):
    """A NIXL agent in process: READs complete on the next :meth:`state` unless the peer is stopped."""

    def __init__(self, name: str, fabric: Network[EmbeddedAgent]) -> None:
        super().__init__(name, fabric)
        self._inbox: list[tuple[str, bytes]] = []
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)

    def metadata(self) -> bytes:
        return self._name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        self._peer(name, "add_remote_agent")
        return name

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        target = self._peer(peer, "transfer")
        if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote, strict=False)):
            raise TransferError("initialize_xfer", peer, "local and remote descriptor lists differ")
        for addr, n in remote:
            target._check_registered(addr, n, peer)
        for addr, n in local:
            self._check_registered(addr, n, self._name)
        handle = next(self._ids)
        self._xfers[handle] = _Xfer(peer, tuple(local), tuple(remote), notif)
        return handle

    def state(self, handle: object) -> XferState:
        xfer = self._xfers[handle]  # type: ignore[index]
        if xfer.done:
            return "DONE"
        if xfer.peer in self.fabric.dead:
            return "ERR"
        if xfer.peer in self.fabric.stopped:
            return "PROC"
        for (dst, n), (src, _) in zip(xfer.local, xfer.remote, strict=True):
            ctypes.memmove(dst, src, n)
        xfer.done = True
        if xfer.notif:
            self.fabric.nodes[xfer.peer]._inbox.append((self._name, xfer.notif))
        return "DONE"

    def release(self, handle: object) -> None:
        if self._xfers.pop(handle, None) is None:  # type: ignore[call-overload]
            raise TransferError("release_xfer_handle", "?", f"handle {handle!r} is not live")

    def send_notif(self, peer: str, message: bytes) -> None:
        target = self._peer(peer, "send_notif")
        if peer not in self.fabric.stopped:
            target._inbox.append((self._name, message))

    def notifs(self) -> list[tuple[str, bytes]]:
        out, self._inbox = self._inbox, []
        return out

    def live_handles(self) -> int:
        """Handles posted and not yet released (0 once every request ended)."""
        return len(self._xfers)

    def _peer(self, name: str, op: str) -> EmbeddedAgent:
        if name in self.fabric.dead:
            raise TransferError(op, name, "NIXL_ERR_REMOTE_DISCONNECT (the peer is dead)")
        agent: EmbeddedAgent | None = self.fabric.nodes.get(name)
        if agent is None:
            raise TransferError(op, name, "NIXL_ERR_NOT_FOUND (no such agent)")
        return agent

    def _check_registered(self, addr: int, n: int, who: str) -> None:
        if not self.registered(addr, n):
            raise TransferError("initialize_xfer", who, f"bytes {addr:#x}+{n} are not registered with {who!r}")
