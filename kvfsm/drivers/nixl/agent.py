"""A real NIXL agent (UCX backend, DRAM) behind the :class:`~kvfsm.drivers.dataplane.DataPlane` protocol.

Importing this module sets ``UCX_MODULES=^ib`` (without it a process that made
a UCX agent can segfault at exit where ibverbs providers are installed) and
``NIXL_LOG_LEVEL=WARN`` (NIXL logs INFO to stdout) unless already set, then
imports ``nixl``: import it before anything else imports ``nixl``.
"""

from __future__ import annotations

import os

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from collections.abc import Sequence
from typing import Any

import torch

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("kvfsm.drivers.nixl.agent needs NIXL: pip install 'kvfsm[nixl]'", name="nixl") from exc

from ..dataplane import Extent, Op, TransferError, XferState


class NixlAgent:
    """``nixl_agent(name)`` with the UCX backend; every NIXL error comes out as :class:`TransferError`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self.agent: Any = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._registered: list[Any] = []

    @property
    def name(self) -> str:
        return self._name

    def register(self, tensor: torch.Tensor) -> None:
        self._registered.append(self.agent.register_memory(tensor))

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        try:
            name = self.agent.add_remote_agent(metadata)
        except Exception as exc:
            raise TransferError("add_remote_agent", "?", f"{type(exc).__name__}: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def post(self, op: Op, peer: str, local: Sequence[Extent], remote: Sequence[Extent], notif: bytes) -> object:
        agent = self.agent
        try:
            src = agent.get_xfer_descs([(a, n, 0) for a, n in local], "DRAM")
            dst = agent.get_xfer_descs([(a, n, 0) for a, n in remote], "DRAM")
            handle = agent.initialize_xfer(op, src, dst, peer, notif)
        except Exception as exc:
            raise TransferError("initialize_xfer", peer, f"{type(exc).__name__}: {exc}") from exc
        try:
            if agent.transfer(handle) == "ERR":
                raise TransferError("transfer", peer, "the backend answered ERR")
        except Exception as exc:
            agent.release_xfer_handle(handle)
            if isinstance(exc, TransferError):
                raise
            raise TransferError("transfer", peer, f"{type(exc).__name__}: {exc}") from exc
        return handle

    def state(self, handle: object) -> XferState:
        try:
            answer = self.agent.check_xfer_state(handle)
        except Exception:
            return "ERR"
        return "DONE" if answer == "DONE" else "PROC" if answer == "PROC" else "ERR"

    def release(self, handle: object) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            raise TransferError("release_xfer_handle", "?", f"{type(exc).__name__}: {exc}") from exc

    def send_notif(self, peer: str, message: bytes) -> None:
        try:
            self.agent.send_notif(peer, message)
        except Exception as exc:
            raise TransferError("send_notif", peer, f"{type(exc).__name__}: {exc}") from exc

    def notifs(self) -> list[tuple[str, bytes]]:
        return [(peer, m) for peer, messages in self.agent.get_new_notifs().items() for m in messages]
