"""The in-process network behind every embedded stand-in of a transfer engine: nodes by name, which of them are
stopped or dead, and the bytes each registered.

A stopped node is a SIGSTOPped process: transfers to it stay in flight and
what is sent to it is swallowed. A dead one is a killed process: every call
that names it fails. Each protocol's embedded endpoint (the MoRIIO
transport, the NIXL agent) is a :class:`Node` of one :class:`Fabric`, which
keeps who is reachable and which memory is registered; the endpoint keeps
only what its protocol says about them (how a batch or a READ completes,
what its error says).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch


class Node:
    """One endpoint on a fabric: its name, and the address ranges it registered."""

    def __init__(self, name: str, fabric: Fabric[Any]) -> None:
        self._name = name
        self.fabric = fabric
        self._memory: list[tuple[int, int]] = []

    @property
    def name(self) -> str:
        """The name peers reach it by."""
        return self._name

    def register(self, tensor: torch.Tensor) -> None:
        self._memory.append((int(tensor.data_ptr()), tensor.numel() * tensor.element_size()))

    def registered(self, addr: int, n: int) -> bool:
        """Whether the ``n`` bytes at ``addr`` lie in one range this node registered."""
        return any(base <= addr and addr + n <= base + size for base, size in self._memory)


N = TypeVar("N", bound=Node)


class Fabric(Generic[N]):
    """The nodes of one process by name, and which of them are stopped or dead."""

    def __init__(self) -> None:
        self.nodes: dict[str, N] = {}
        self.stopped: set[str] = set()
        self.dead: set[str] = set()

    def join(self, name: str, make: Callable[[str, Fabric[N]], N]) -> N:
        """A new node named ``name``, made by ``make(name, fabric)``; a name already on the fabric is refused."""
        if name in self.nodes:
            raise ValueError(f"a node named {name!r} is already on this fabric")
        self.nodes[name] = node = make(name, self)
        return node

    def reachable(self, name: str) -> N | None:
        """The node a message to ``name`` reaches: None for an unknown, dead or stopped one (the message is lost)."""
        if name in self.dead or name in self.stopped:
            return None
        return self.nodes.get(name)

    def stop(self, name: str) -> None:
        self.stopped.add(name)

    def resume(self, name: str) -> None:
        self.stopped.discard(name)

    def kill(self, name: str) -> None:
        self.dead.add(name)
