"""The MoRIIO drivers set up for kvfsm's generated model-based tests (``kvfsm.testing``).

A generated test begins keys and fires events with no payload of its own,
and asks the driver to make its next action raise. The classes here are the
real drivers plus exactly that: :meth:`before_begin` allocates and fills a
request's blocks (the scheduler's part), :meth:`before_fire` gives
``remote_blocks`` the blocks of a real peer endpoint on the same
:class:`~kvfsm.drivers.fabric.Fabric`, and :meth:`inject_fault` makes the next call of
an action raise. Everything else is the production code path.

From the command line::

    kvfsm test kvfsm/specs/moriio/write_producer.yaml --driver kvfsm.showcase.moriio_modeltest:writer
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import Any

from ..drivers.fabric import Fabric
from ..drivers.moriio.consumer import BlockReader, Source, WriteReceiver
from ..drivers.moriio.messages import RemoteBlocks
from ..drivers.moriio.plane import PlaneTransport
from ..drivers.moriio.producer import BlockLender, BlockWriter
from ..drivers.nixl.blocks import KVBlocks

NUM_BLOCKS = 32
BLOCK_BYTES = 256
BLOCKS_PER_REQUEST = 2


class ModelRig:
    """The parts a model driver needs: its own blocks on an endpoint, a peer's blocks, faults to trip."""

    def __init__(self) -> None:
        self.fabric = Fabric()
        self.local = PlaneTransport(self.fabric.agent("local"))
        self.peer = PlaneTransport(self.fabric.agent("peer"))
        self.blocks = KVBlocks(NUM_BLOCKS, BLOCK_BYTES)
        self.peer_blocks = KVBlocks(NUM_BLOCKS, BLOCK_BYTES)
        self.local.register(self.blocks.tensor)
        self.peer.register(self.peer_blocks.tensor)
        self.armed: set[str] = set()
        self._ids = itertools.count(1)

    def trip(self, action: str) -> None:
        if action in self.armed:
            self.armed.discard(action)
            raise RuntimeError(f"injected fault in {action}")

    def allocate(self, key: Hashable, transfer_id: str) -> list[int]:
        """The scheduler's allocation for ``key``, filled with the KV of ``transfer_id`` (handed over at begin)."""
        blocks = self.blocks.pool.allocate(("scheduler", key), BLOCKS_PER_REQUEST)
        self.blocks.fill(blocks, transfer_id, 0)
        return blocks

    def let_go(self, key: Hashable) -> None:
        """The scheduler lets go of its allocation once the driver holds the blocks (or failed to)."""
        if self.blocks.pool.held_by(("scheduler", key)):
            self.blocks.pool.release(("scheduler", key))

    def peer_request(self, transfer_id: str) -> list[int]:
        """Blocks on the peer for ``transfer_id``, holding its KV (what the prefill computed)."""
        holder = ("peer", next(self._ids))
        blocks = self.peer_blocks.pool.allocate(holder, BLOCKS_PER_REQUEST)
        self.peer_blocks.fill(blocks, transfer_id, 0)
        self.peer_blocks.pool.release(holder)  # the bytes stay until the next request's fill
        return blocks

    def transfer_id(self, key: Hashable) -> str:
        return f"xfer-{key}-{next(self._ids)}"


class Planned:
    """What every model driver adds: a plan for a request begun without one, and faults on demand."""

    rig: ModelRig

    def trip_first(self, action: str, key: Hashable) -> None:
        """Trip the spec's first acquire: if it raises nothing else runs, so the scheduler lets go of its blocks."""
        try:
            self.rig.trip(action)
        except RuntimeError:
            self.rig.let_go(key)
            raise

    def before_begin(self, key: Hashable, resources: Collection[str]) -> Mapping[str, Any]:
        tid = self.rig.transfer_id(key)
        return {"transfer_id": tid, "block_ids": self.rig.allocate(key, tid)}

    def inject_fault(self, action: str) -> bool:
        self.rig.armed.add(action)
        return True


class HandsOver(Planned):
    """The scheduler hands its blocks to the connector at begin (delay_free), and lets go of them either way."""

    def owe_send_report(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None:
        self.trip_first("owe_send_report", key)
        super().owe_send_report(key, transfer_id, block_ids)  # type: ignore[misc]

    def hold_blocks(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None:
        try:
            self.rig.trip("hold_blocks")
            super().hold_blocks(key, transfer_id, block_ids)  # type: ignore[misc]
        finally:
            self.rig.let_go(key)


class ModelWriter(HandsOver, BlockWriter):
    """:class:`BlockWriter` for ``write_producer.yaml`` under a generated test."""

    def __init__(self) -> None:
        self.rig = ModelRig()
        super().__init__(self.rig.blocks, self.rig.local)

    def before_fire(self, key: Hashable, event: str, taken: Collection[str]) -> Mapping[str, Any]:
        if event == "release":  # the decode side gave up: it waits on its endpoint for released
            return {"reply_to": self.rig.peer.name}
        if event != "remote_blocks":
            return {}
        p = self.rig.peer_blocks
        blocks = self.rig.peer_request(f"xfer-{key}")
        return {"remote_blocks": RemoteBlocks(f"xfer-{key}", self.rig.peer.name, p.base, p.block_bytes, blocks)}

    def post_writes(self, key: Hashable, /, remote_blocks: RemoteBlocks) -> None:
        self.rig.trip("post_writes")
        super().post_writes(key, remote_blocks)

    def notify_write_done(self, key: Hashable, /) -> None:
        self.rig.trip("notify_write_done")
        super().notify_write_done(key)

    def withdraw_writes(self, key: Hashable, /, reply_to: str) -> None:
        self.rig.trip("withdraw_writes")
        super().withdraw_writes(key, reply_to)

    def notify_released(self, key: Hashable, /, reply_to: str | None = None) -> None:
        self.rig.trip("notify_released")
        super().notify_released(key, reply_to)


class ModelLender(HandsOver, BlockLender):
    """:class:`BlockLender` for ``read_producer.yaml`` under a generated test."""

    def __init__(self) -> None:
        self.rig = ModelRig()
        super().__init__(self.rig.blocks, self.rig.local)


class Receives(Planned):
    """A consumer's report is owed before its blocks are pinned."""

    def owe_recv_report(self, key: Hashable, /, block_ids: Iterable[int], **begin: object) -> None:
        self.trip_first("owe_recv_report", key)
        super().owe_recv_report(key, block_ids, **begin)  # type: ignore[misc]


class ModelReceiver(Receives, WriteReceiver):
    """:class:`WriteReceiver` for ``write_consumer.yaml``: the peer's writes land as soon as the blocks are announced."""

    def __init__(self) -> None:
        self.rig = ModelRig()
        super().__init__(self.rig.blocks, self.rig.local, self.rig.peer.name)

    def pin_dst(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None:
        try:
            self.rig.trip("pin_dst")
            super().pin_dst(key, transfer_id, block_ids)
        finally:
            self.rig.let_go(key)

    def send_remote_blocks(self, key: Hashable, /) -> None:
        self.rig.trip("send_remote_blocks")
        super().send_remote_blocks(key)

    def verify_blocks(self, key: Hashable, /) -> None:
        self.rig.trip("verify_blocks")
        super().verify_blocks(key)


class ModelReader(Receives, BlockReader):
    """:class:`BlockReader` for ``read_consumer.yaml``, reading from a peer endpoint that holds the KV."""

    def __init__(self) -> None:
        self.rig = ModelRig()
        super().__init__(self.rig.blocks, self.rig.local, self.rig.peer.name)

    def before_begin(self, key: Hashable, resources: Collection[str]) -> Mapping[str, Any]:
        tid = self.rig.transfer_id(key)
        blocks = self.rig.blocks.pool.allocate(("scheduler", key), BLOCKS_PER_REQUEST)
        p = self.rig.peer_blocks
        source = Source(self.rig.peer.name, p.base, p.block_bytes, tuple(self.rig.peer_request(tid)))
        return {"transfer_id": tid, "block_ids": blocks, "remote_blocks": source}

    def pin_dst(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int], remote_blocks: Source) -> None:
        try:
            self.rig.trip("pin_dst")
            super().pin_dst(key, transfer_id, block_ids, remote_blocks)
        finally:
            self.rig.let_go(key)

    def owe_release(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int], remote_blocks: Source) -> None:
        self.rig.trip("owe_release")
        super().owe_release(key, transfer_id, block_ids, remote_blocks)

    def post_reads(self, key: Hashable, /) -> None:
        self.rig.trip("post_reads")
        super().post_reads(key)
        self.rig.local.status(self._batches[key])  # the read lands now; `complete` may come at any step

    def verify_blocks(self, key: Hashable, /) -> None:
        self.rig.trip("verify_blocks")
        super().verify_blocks(key)


FACTORIES: dict[str, Callable[[], object]] = {
    "write_producer": ModelWriter,
    "read_producer": ModelLender,
    "write_consumer": ModelReceiver,
    "read_consumer": ModelReader,
}
writer, lender, receiver, reader = ModelWriter, ModelLender, ModelReceiver, ModelReader
