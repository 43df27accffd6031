"""The decode side: one TP rank's blocks for each request, filled by the prefill's writes (WRITE) or by its reads (READ).

:class:`WriteReceiver` is the driver of ``specs/moriio/write_consumer.yaml``,
:class:`BlockReader` of ``read_consumer.yaml``; :class:`DecodeEngine` owns a
rank's blocks, transport and tracker, and once per step turns ``write_done``
messages and the statuses of its reads into events. Every block is
byte-checked against the prefill's KV for the transfer before it counts as
loaded; a block that was not is reported invalid.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine import Tracker
from ...spec import Spec
from ..nixl.blocks import KVBlocks
from ..report import Finished, Report
from .messages import Computed, Message, Release, RemoteBlocks, Stats, WriteDone
from .side import Side
from .specs import moriio_spec
from .transport import Extent, Transport, split_statuses


class BlockMismatch(RuntimeError):
    """The transfer ended but a block does not hold the prefill's bytes for the request."""


@dataclass(frozen=True)
class Source:
    """Where the prefill's computed blocks of a request are (READ mode): its endpoint and block addresses."""

    peer: str
    base: int
    block_bytes: int
    blocks: tuple[int, ...]


@dataclass
class Load:
    """One request's local blocks, the transfer id, the write_done count so far, and whether they were checked."""

    transfer_id: str
    blocks: tuple[int, ...]
    acks: int = 0
    verified: bool = False


class BlockLoader:
    """Actions both consumer specs share: pin the allocated blocks, byte-check them, unpin and report.

    ``_loads[key]`` is the ``dst_blocks`` record (:meth:`pin_dst`, :meth:`unpin_dst`).
    """

    def __init__(self, blocks: KVBlocks, transport: Transport, peer: str, rank: int = 0, acks: int = 1) -> None:
        self.blocks = blocks
        self.pool = blocks.pool
        self.transport = transport
        self.peer = peer
        self.rank = rank
        self.acks = acks
        self.report = Report()
        self.stats: Counter[str] = Counter()
        self._loads: dict[Hashable, Load] = {}

    @staticmethod
    def holder(key: Hashable) -> tuple[str, Hashable]:
        return ("moriio_recv", key)

    def _pin(self, key: Hashable, transfer_id: str, block_ids: Sequence[int]) -> None:
        self.pool.pin(self.holder(key), block_ids)
        self._loads[key] = Load(transfer_id, tuple(block_ids))

    def unpin_dst(self, key: Hashable, /) -> None:
        """Let go of the blocks and report the load; blocks not byte-checked are reported invalid."""
        load = self._loads.pop(key)
        self.pool.release(self.holder(key))
        self.report.recv(key, () if load.verified else load.blocks)

    def verify_blocks(self, key: Hashable, /) -> None:
        load = self._loads[key]
        wrong = self.blocks.wrong(load.blocks, load.transfer_id, 0)
        if wrong:
            self.stats["blocks_wrong"] += len(wrong)
            raise BlockMismatch(f"request {key!r}: blocks {wrong} do not hold transfer {load.transfer_id!r}'s KV")
        load.verified = True
        self.stats["blocks_verified"] += len(load.blocks)

    def count_done(self, key: Hashable) -> bool:
        """One more prefill rank's write_done for ``key``: True on the last expected one (or if not loading)."""
        load = self._loads.get(key)
        if load is None:
            return True
        load.acks += 1
        return load.acks >= self.acks

    def observe(self, key: Hashable) -> set[str]:
        return {"dst_blocks"} if self.pool.held_by(self.holder(key)) else set()


class WriteReceiver(BlockLoader):
    """Actions of ``moriio_write_consumer``: tell the prefill side where the blocks are."""

    def pin_dst(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None:
        self._pin(key, transfer_id, block_ids)

    def send_remote_blocks(self, key: Hashable, /) -> None:
        load = self._loads[key]
        message = RemoteBlocks(
            load.transfer_id, self.transport.name, self.blocks.base, self.blocks.block_bytes, list(load.blocks),
            self.rank,
        )  # fmt: skip
        self.transport.notify(self.peer, message)


class BlockReader(BlockLoader):
    """Actions of ``moriio_read_consumer``: read the prefill's blocks, and send ``release`` however the load ends.

    ``_sources[key]`` is kept with the ``dst_blocks`` record, ``_batches[key]``
    is the ``xfer`` one (:meth:`post_reads`, :meth:`release_reads`), ``_owed[key]``
    the ``peer_release`` one (:meth:`owe_release`, :meth:`send_release`).
    """

    def __init__(self, blocks: KVBlocks, transport: Transport, peer: str, rank: int = 0, acks: int = 1) -> None:
        super().__init__(blocks, transport, peer, rank, acks)
        self._sources: dict[Hashable, Source] = {}
        self._batches: dict[Hashable, object] = {}
        self._owed: dict[Hashable, tuple[str, str]] = {}

    def pin_dst(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int], remote_blocks: Source) -> None:
        if len(remote_blocks.blocks) < len(block_ids):
            raise ValueError(
                f"request {key!r}: {len(block_ids)} local blocks for {len(remote_blocks.blocks)} remote ones"
            )
        self._pin(key, transfer_id, block_ids)
        self._sources[key] = remote_blocks

    def owe_release(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int], remote_blocks: Source) -> None:
        self._owed[key] = (remote_blocks.peer, transfer_id)

    def send_release(self, key: Hashable, /) -> None:
        """Tell the prefill side its blocks are free to go: on success and on failure alike."""
        peer, transfer_id = self._owed.pop(key)
        self.transport.notify(peer, Release(transfer_id, self.rank))

    def post_reads(self, key: Hashable, /) -> None:
        load = self._loads[key]
        source = self._sources[key]
        n = self.blocks.block_bytes
        if source.block_bytes != n:
            raise ValueError(f"request {key!r}: remote blocks of {source.block_bytes} bytes, local of {n}")
        local: list[Extent] = [(self.blocks.addr(b), n) for b in load.blocks]
        remote = [source.base + b * n for b in source.blocks[len(source.blocks) - len(load.blocks) :]]
        self._batches[key] = self.transport.read(source.peer, local, remote, load.transfer_id)

    def release_reads(self, key: Hashable, /) -> None:
        self.transport.release(self._batches.pop(key))

    def statuses(self) -> tuple[list[Hashable], list[Hashable]]:
        """The requests whose reads all succeeded, and those whose reads ended with a failure."""
        return split_statuses(self.transport, self._batches)

    def unpin_dst(self, key: Hashable, /) -> None:
        self._sources.pop(key, None)
        super().unpin_dst(key)

    def observe(self, key: Hashable) -> set[str]:
        held = super().observe(key)
        if key in self._batches:
            held.add("xfer")
        if key in self._owed:
            held.add("peer_release")
        return held


class DecodeEngine(Side):
    """One decode TP rank: blocks registered with the transport, a tracker of loads, messages and statuses per step."""

    def __init__(
        self,
        transport: Transport,
        num_blocks: int,
        block_bytes: int,
        peer: str,
        *,
        mode: str = "write",
        rank: int = 0,
        acks: int = 1,
        params: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        spec: Spec | None = None,
        driver: type[WriteReceiver] | type[BlockReader] | None = None,
    ) -> None:
        super().__init__(transport, num_blocks, block_bytes, mode)
        kind = driver if driver is not None else WriteReceiver if mode == "write" else BlockReader
        self.driver: BlockLoader = kind(self.blocks, transport, peer, rank, acks)
        spec = spec if spec is not None else moriio_spec(f"{mode}_consumer")
        self.tracker = Tracker(spec, self.driver, params=params, clock=clock)
        self.sources: dict[str, Source] = {}
        """READ mode: where the prefill computed each transfer's blocks (its ``computed`` answers)."""
        self.replies: list[Stats] = []

    def start(self, request_id: str, transfer_id: str, n: int, source: Source | None = None) -> list[int]:
        """Allocate ``n`` blocks and start the load (WRITE: announce them; READ: read ``source``).

        Raises :class:`~kvfsm.drivers.block_pool.NoFreeBlocks` when the pool is full.
        """
        blocks = self.blocks.pool.allocate(request_id, n)
        if self.mode == "write":
            self._call(self.tracker.begin, request_id, transfer_id=transfer_id, block_ids=blocks)
            self._fire(request_id, "announce")
        else:
            if source is None:
                self.blocks.pool.release(request_id)
                raise ValueError(f"request {request_id!r}: READ mode needs the prefill's blocks (source)")
            self._call(self.tracker.begin, request_id, transfer_id=transfer_id, block_ids=blocks, remote_blocks=source)
            self._fire(request_id, "read")
        return blocks

    def abort(self, request_id: str) -> None:
        self._fire(request_id, "abort")

    def step(self, now: float | None = None) -> Finished:
        """Take write_done messages, finish the reads that ended, fire due deadlines; the scheduler frees what finished."""
        for message in self.transport.messages():
            self.on_message(message)
        if isinstance(self.driver, BlockReader):
            done, failed = self.driver.statuses()
            self._fire_many("complete", done)
            self._fire_many("fail", failed)
        self._poll(now)
        finished = self.driver.report.take()
        for key in finished.recving:
            self.blocks.pool.release(key)  # the scheduler's own allocation
        return finished

    def on_message(self, message: Message) -> None:
        if isinstance(message, WriteDone):
            self.counts["write_done"] += 1
            key = self.tracker.route("transfer_id", message.transfer_id)
            if key is None or self.driver.count_done(key):
                self._deliver("write_done", message.transfer_id)  # an unknown or finished id is counted there
        elif isinstance(message, Computed):
            self.sources[message.transfer_id] = Source(
                message.peer, message.base, message.block_bytes, tuple(message.blocks)
            )
        elif isinstance(message, Stats):
            self.replies.append(message)
        else:
            self.counts[f"unexpected:{type(message).__name__}"] += 1

    def stats(self) -> dict[str, object]:
        return {
            **self.side_stats(),
            "verified_blocks": self.driver.stats["blocks_verified"],
            "blocks_wrong": self.driver.stats["blocks_wrong"],
        }
