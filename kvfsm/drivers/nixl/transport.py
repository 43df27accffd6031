"""What the NIXL drivers need of an agent: READ with a notification, transfer states, notifications in and out.

Two implementations: :class:`~.agent.NixlAgent` (a real ``nixl_agent`` with the
UCX backend on DRAM) and :class:`~.embedded.EmbeddedAgent` (in process, for the
demo and fast tests). The drivers see only this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

import torch

XferState = Literal["DONE", "PROC", "ERR"]
"""``check_xfer_state``'s answers: finished, still in flight (forever, for a stopped peer), failed."""

Extent = tuple[int, int]
"""``(address, length)`` of bytes in a registered tensor."""


class TransferError(RuntimeError):
    """A NIXL call failed: a dead peer (``nixlRemoteDisconnectError``), an unknown agent, a backend error."""

    def __init__(self, op: str, peer: str, cause: str) -> None:
        super().__init__(f"NIXL {op} with peer {peer!r} failed: {cause}")
        self.op = op
        self.peer = peer


class Transport(Protocol):
    """One agent: it registers its blocks, reads from peers, and sends and receives notifications."""

    @property
    def name(self) -> str: ...

    def register(self, tensor: torch.Tensor) -> None: ...

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's :meth:`add_peer`."""
        ...

    def add_peer(self, metadata: bytes) -> str:
        """Make a peer known; returns its agent name."""
        ...

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        """Post a READ of ``remote`` (the peer's memory) into ``local``; ``notif`` reaches the peer when it is done.

        Returns a handle for :meth:`state` and :meth:`release`; raises :class:`TransferError`.
        """
        ...

    def state(self, handle: object) -> XferState: ...

    def release(self, handle: object) -> None:
        """Release a handle, finished or not (a READ stuck on a stopped peer included)."""
        ...

    def send_notif(self, peer: str, message: bytes) -> None: ...

    def notifs(self) -> list[tuple[str, bytes]]:
        """Every notification received since the last call, each with the name of the agent that sent it
        (what a count of distinct readers tells apart: NIXL's ``get_new_notifs`` keys them by sender)."""
        ...
