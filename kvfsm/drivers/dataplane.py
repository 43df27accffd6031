"""The data plane a transfer driver is written against: registered memory, one-sided reads and writes, their
state, and notifications that name their sender.

Its shape is NIXL's agent API (``register_memory``; ``initialize_xfer`` of a
READ or a WRITE that notifies the peer when it is done; ``check_xfer_state``;
``release_xfer_handle``; ``send_notif``; ``get_new_notifs``, keyed by sender),
the smallest one that covers the transfer systems kvfsm drives. It is
implemented by :class:`~kvfsm.drivers.nixl.agent.NixlAgent` (a real NIXL
agent) and by :class:`~kvfsm.drivers.fabric.EmbeddedAgent` (in process, on
the one embedded fabric) and :class:`~kvfsm.drivers.mooncake.agent.MooncakeAgent`
(Mooncake's TransferEngine, WRITEs, with pyzmq); the harness's
:class:`~kvfsm.harness.faults.FaultyAgent` wraps any of them. The NIXL drivers and MoRIIO's NIXL transport are written over it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch

XferState = Literal["DONE", "PROC", "ERR"]
"""``check_xfer_state``'s answers: finished, still in flight (forever, for a stopped peer), failed."""

Op = Literal["READ", "WRITE"]
"""A READ copies the peer's memory into this side's; a WRITE copies this side's into the peer's."""

Extent = tuple[int, int]
"""``(address, length)`` of bytes in registered memory."""


class TransferError(RuntimeError):
    """A data-plane call failed: a dead peer (``nixlRemoteDisconnectError``), an unknown one, unregistered
    memory, a backend error."""

    def __init__(self, op: str, peer: str, cause: str) -> None:
        super().__init__(f"{op} with peer {peer!r} failed: {cause}")
        self.op = op
        self.peer = peer
        self.cause = cause


class DataPlane(Protocol):
    """One agent: it registers its memory, posts READs and WRITEs to peers, and sends and receives notifications."""

    @property
    def name(self) -> str:
        """The name peers reach this agent by."""
        ...

    def register(self, tensor: torch.Tensor) -> None: ...

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`add_peer`."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Make a peer known; returns its agent name."""
        ...

    def post(self, op: Op, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        """Post a READ of ``remote`` (the peer's memory) into ``local``, or a WRITE of ``local`` to ``remote``;
        a non-empty ``notif`` reaches the peer when it is done.

        Returns a handle for :meth:`state` and :meth:`release` (hashable, by identity); raises
        :class:`TransferError`.
        """
        ...

    def state(self, handle: object) -> XferState: ...

    def release(self, handle: object) -> None:
        """Release a handle, finished or not (a transfer stuck on a stopped peer included)."""
        ...

    def send_notif(self, peer: str, message: bytes) -> None: ...

    def notifs(self) -> list[tuple[str, bytes]]:
        """Every notification received since the last call, each with the name of the agent that sent it
        (what a count of distinct readers tells apart: NIXL's ``get_new_notifs`` keys them by sender)."""
        ...
