"""The in-process fabric of the data plane (:mod:`kvfsm.drivers.dataplane`): its agents by name, which of them are
stopped or dead, and the bytes each registered.

A stopped agent is a SIGSTOPped process: transfers to it stay in flight and
what is sent to it is swallowed. A dead one is a killed process: every call
that names it fails. Every embedded stand-in runs on it: the NIXL ranks, the
MoRIIO engines (through their transport), and the P/D job's writes into the
shared file both processes map.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .dataplane import Extent, Op, TransferError, XferState


class Fabric:
    """The data plane's agents of one process, by name, and which of them are stopped or dead."""

    def __init__(self) -> None:
        self.agents: dict[str, EmbeddedAgent] = {}
        self.stopped: set[str] = set()
        self.dead: set[str] = set()

    def agent(self, name: str) -> EmbeddedAgent:
        """A new agent named ``name``; a name already on the fabric is refused."""
        if name in self.agents:
            raise ValueError(f"an agent named {name!r} is already on this fabric")
        self.agents[name] = agent = EmbeddedAgent(name, self)
        return agent

    def stop(self, name: str) -> None:
        self.stopped.add(name)

    def resume(self, name: str) -> None:
        self.stopped.discard(name)

    def kill(self, name: str) -> None:
        self.dead.add(name)


@dataclass
class _Xfer:
    op: Op
    peer: str
    local: tuple[Extent, ...]
    remote: tuple[Extent, ...]
    notif: bytes
    done: bool = False


class EmbeddedAgent:
    """A :class:`~kvfsm.drivers.dataplane.DataPlane` agent in process, with NIXL's answers: a transfer completes
    on the next :meth:`state` unless the peer is stopped (``PROC``, its notification held back); a killed peer
    makes every call that names it raise (``nixlRemoteDisconnectError``), and a transfer to it end ``ERR``."""

    def __init__(self, name: str, fabric: Fabric) -> None:
        self._name = name
        self.fabric = fabric
        self._memory: list[tuple[int, int]] = []
        self._inbox: list[tuple[str, bytes]] = []
        self._xfers: dict[int, _Xfer] = {}
        self._ids = itertools.count(1)

    @property
    def name(self) -> str:
        """The name peers reach it by."""
        return self._name

    def register(self, tensor: torch.Tensor) -> None:
        self._memory.append((int(tensor.data_ptr()), tensor.numel() * tensor.element_size()))

    def registered(self, addr: int, n: int) -> bool:
        """Whether the ``n`` bytes at ``addr`` lie in one range this agent registered."""
        return any(base <= addr and addr + n <= base + size for base, size in self._memory)

    def metadata(self) -> bytes:
        return self._name.encode()

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        self._peer(name, "add_remote_agent")
        return name

    def post(self, op: Op, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        target = self._peer(peer, "transfer")
        if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote, strict=False)):
            raise TransferError("initialize_xfer", peer, "local and remote descriptor lists differ")
        for addr, n in remote:
            target._check_registered(addr, n, peer)
        for addr, n in local:
            self._check_registered(addr, n, self._name)
        handle = next(self._ids)
        self._xfers[handle] = _Xfer(op, peer, tuple(local), tuple(remote), notif)
        return handle

    def state(self, handle: object) -> XferState:
        xfer = self._xfers[handle]  # type: ignore[index]
        if xfer.done:
            return "DONE"
        if xfer.peer in self.fabric.dead:
            return "ERR"
        if xfer.peer in self.fabric.stopped:
            return "PROC"
        for (here, n), (there, _) in zip(xfer.local, xfer.remote, strict=True):
            if xfer.op == "READ":
                ctypes.memmove(here, there, n)
            else:
                ctypes.memmove(there, here, n)
        xfer.done = True
        if xfer.notif:
            self.fabric.agents[xfer.peer]._inbox.append((self._name, xfer.notif))
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
        agent: EmbeddedAgent | None = self.fabric.agents.get(name)
        if agent is None:
            raise TransferError(op, name, "NIXL_ERR_NOT_FOUND (no such agent)")
        return agent

    def _check_registered(self, addr: int, n: int, who: str) -> None:
        if not self.registered(addr, n):
            raise TransferError("initialize_xfer", who, f"bytes {addr:#x}+{n} are not registered with {who!r}")
