"""What the MoRIIO drivers need of a transfer engine: the operations vLLM's ``moriio_engine.py`` uses.

MoRI's ``IOEngine`` registers memory, posts a batch of one-sided writes or
reads under a transfer uid (``Session.batch_write`` / ``batch_read``),
answers each with a ``TransferStatus`` that is polled, and leaves completion
messages to vLLM's own ZMQ sockets. The drivers see only this protocol;
:class:`~.plane.PlaneTransport` implements it over any agent of the data
plane (:mod:`kvfsm.drivers.dataplane`): the embedded one in process, a real
NIXL agent, or Mooncake's TransferEngine with pyzmq across processes.
:class:`kvfsm.harness.faults.FaultyAgent` wraps the agent to inject faults.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, Protocol

import torch

from ..dataplane import Extent
from ..dataplane import TransferError as TransferError  # what a post raises, re-exported for the drivers
from .messages import Message

Status = Literal["done", "pending", "failed"]
"""A posted batch: every transfer succeeded, some still in flight, or every one ended and one failed."""


class Transport(Protocol):
    """One engine's transfer endpoint: registered blocks, batches of writes or reads, and messages."""

    @property
    def name(self) -> str:
        """The address peers post to and notify."""
        ...

    def register(self, tensor: torch.Tensor) -> None: ...

    def write(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        """Post a batch writing each ``local`` extent to the same length at ``remote`` on ``peer``; a handle.

        Raises :class:`TransferError` when the batch cannot be posted at all.
        """
        ...

    def read(self, peer: str, local: Sequence[Extent], remote: Sequence[int], uid: str) -> object:
        """Post a batch reading each ``remote`` address on ``peer`` into the ``local`` extent; a handle."""
        ...

    def status(self, batch: object) -> Status:
        """The batch's status. Final answers are kept: polling again never asks the engine twice."""
        ...

    def release(self, batch: object) -> None:
        """Forget a batch, finished or not."""
        ...

    def notify(self, peer: str, message: Message) -> None:
        """Send a control message to ``peer`` (vLLM's ZMQ side channel); never blocks."""
        ...

    def messages(self) -> list[Message]:
        """Every well-formed message received since the last call; malformed ones are counted and dropped."""
        ...


def split_statuses(transport: Transport, batches: dict[Hashable, object]) -> tuple[list[Hashable], list[Hashable]]:
    """The keys whose batch is done and those whose batch failed, polling each once (a step's completions)."""
    done: list[Hashable] = []
    failed: list[Hashable] = []
    for key, batch in batches.items():
        status = transport.status(batch)
        if status == "done":
            done.append(key)
        elif status == "failed":
            failed.append(key)
    return done, failed
