"""The prefill side: one TP rank's hold on each request's blocks until they are written (WRITE) or read (READ).

:class:`BlockWriter` is the driver of ``specs/moriio/write_producer.yaml``,
:class:`BlockLender` of ``read_producer.yaml``; :class:`PrefillEngine` owns a
rank's blocks, transport and tracker, and once per step turns the messages
it received and the statuses of its posted writes into events. Every message
is routed by ``transfer_id`` (the spec says so); a ``remote_blocks`` that
arrives before its request was computed is kept until it is (vLLM's deferred
task the other way round), bounded in number.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine import Tracker
from ...spec import Spec
from ..block_pool import NoFreeBlocks
from ..nixl.blocks import KVBlocks
from ..report import Finished, Report
from .faults import FaultyTransport
from .messages import Computed, Message, Prefill, Release, RemoteBlocks, Stats, StatsQuery, WriteDone
from .side import Side
from .specs import moriio_spec
from .transport import Extent, Transport, split_statuses

EARLY_LIMIT = 4096
"""How many remote_blocks for requests not yet computed are kept (vLLM keeps 4096 terminal ids)."""

COMPUTED_LIMIT = 1 << 16
"""How many computed transfer ids are remembered, to tell an early message from a late one."""


def expected_acks(consumer_tp: int, producer_tp: int) -> int:
    """How many messages one rank waits for: ``consumer_tp // producer_tp`` when the consumer is larger, else 1."""
    if consumer_tp < 1 or producer_tp < 1:
        raise ValueError(f"TP sizes must be positive, not consumer {consumer_tp} / producer {producer_tp}")
    if consumer_tp > producer_tp and consumer_tp % producer_tp:
        raise ValueError(f"consumer TP {consumer_tp} is not a multiple of producer TP {producer_tp}")
    return consumer_tp // producer_tp if consumer_tp > producer_tp else 1


@dataclass
class Job:
    """One held request: the shared transfer id and its computed blocks."""

    transfer_id: str
    blocks: tuple[int, ...]
    written: bool = False


class BlockHolder:
    """Actions both producer specs share: hold the computed blocks, free them and report finished_sending.

    ``_jobs[key]`` is the ``src_blocks`` record: taken by :meth:`hold_blocks`,
    dropped by :meth:`free_blocks`, so it lives exactly as long as the hold.
    """

    def __init__(self, blocks: KVBlocks, transport: Transport, rank: int = 0) -> None:
        self.blocks = blocks
        self.pool = blocks.pool
        self.transport = transport
        self.rank = rank
        self.report = Report()
        self.stats: Counter[str] = Counter()
        self._jobs: dict[Hashable, Job] = {}

    @staticmethod
    def holder(key: Hashable) -> tuple[str, Hashable]:
        return ("moriio_send", key)

    def hold_blocks(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None:
        self.pool.pin(self.holder(key), block_ids)
        self._jobs[key] = Job(transfer_id, tuple(block_ids))

    def free_blocks(self, key: Hashable, /) -> None:
        """vLLM's ``_mark_request_done``: whatever the outcome, drop the hold and report finished_sending."""
        del self._jobs[key]
        self.pool.release(self.holder(key))
        self.report.send(key)

    def observe(self, key: Hashable) -> set[str]:
        return {"src_blocks"} if self.pool.held_by(self.holder(key)) else set()


class BlockWriter(BlockHolder):
    """Actions of ``moriio_write_producer``: post the writes into the decode side's blocks, tell it when they landed.

    ``_batches[key]`` is the ``xfer`` record (:meth:`post_writes`,
    :meth:`release_writes`).
    """

    def __init__(self, blocks: KVBlocks, transport: Transport, rank: int = 0) -> None:
        super().__init__(blocks, transport, rank)
        self._batches: dict[Hashable, tuple[str, object]] = {}

    def post_writes(self, key: Hashable, /, remote_blocks: RemoteBlocks) -> None:
        """One batch writing every computed block to the decode side's last ``len(blocks)`` blocks."""
        job = self._jobs[key]
        targets = remote_blocks.blocks
        if len(targets) < len(job.blocks):
            raise ValueError(f"request {key!r}: {len(job.blocks)} blocks to write into {len(targets)} remote ones")
        n = self.blocks.block_bytes
        if remote_blocks.block_bytes != n:
            raise ValueError(f"request {key!r}: remote blocks of {remote_blocks.block_bytes} bytes, local of {n}")
        local: list[Extent] = [(self.blocks.addr(b), n) for b in job.blocks]
        remote = [remote_blocks.base + b * n for b in targets[len(targets) - len(job.blocks) :]]
        batch = self.transport.write(remote_blocks.peer, local, remote, job.transfer_id)
        self._batches[key] = (remote_blocks.peer, batch)

    def release_writes(self, key: Hashable, /) -> None:
        _, batch = self._batches.pop(key)
        self.transport.release(batch)

    def notify_write_done(self, key: Hashable, /) -> None:
        peer, _ = self._batches[key]
        job = self._jobs[key]
        job.written = True
        self.transport.notify(peer, WriteDone(job.transfer_id, self.rank))

    def statuses(self) -> tuple[list[Hashable], list[Hashable]]:
        """The requests whose writes all succeeded, and those whose writes ended with a failure."""
        return split_statuses(self.transport, {key: batch for key, (_, batch) in self._batches.items()})

    def observe(self, key: Hashable) -> set[str]:
        return super().observe(key) | ({"xfer"} if key in self._batches else set())


class BlockLender(BlockHolder):
    """Actions of ``moriio_read_producer``: the blocks wait for the decode side's releases (counted)."""

    def __init__(self, blocks: KVBlocks, transport: Transport, rank: int = 0, acks: int = 1) -> None:
        super().__init__(blocks, transport, rank)
        self.acks = acks
        self._released: Counter[str] = Counter()

    def count_release(self, transfer_id: str) -> bool:
        """One more decode rank is done with ``transfer_id``: True on the last expected one."""
        self._released[transfer_id] += 1
        if self._released[transfer_id] >= self.acks:
            del self._released[transfer_id]
            return True
        return False

    def free_blocks(self, key: Hashable, /) -> None:
        self._released.pop(self._jobs[key].transfer_id, None)
        super().free_blocks(key)


class PrefillEngine(Side):
    """One prefill TP rank: its blocks registered with the transport, a tracker of held requests, messages in."""

    def __init__(
        self,
        transport: Transport,
        num_blocks: int,
        block_bytes: int,
        *,
        mode: str = "write",
        rank: int = 0,
        acks: int = 1,
        params: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        spec: Spec | None = None,
        driver: type[BlockWriter] | type[BlockLender] | None = None,
    ) -> None:
        super().__init__(transport, num_blocks, block_bytes, mode)
        kind = driver if driver is not None else BlockWriter if mode == "write" else BlockLender
        self.driver: BlockHolder = kind(self.blocks, transport, rank)
        if isinstance(self.driver, BlockLender):
            self.driver.acks = acks
        spec = spec if spec is not None else moriio_spec(f"{mode}_producer")
        self.tracker = Tracker(spec, self.driver, params=params, clock=clock)
        self.queued: OrderedDict[str, Prefill] = OrderedDict()
        """Requests waiting for free blocks, in arrival order (vLLM's waiting queue)."""
        self._early: OrderedDict[str, RemoteBlocks] = OrderedDict()
        self._computed: OrderedDict[str, None] = OrderedDict()
        """The latest transfer ids computed here: a message for one of them goes to the tracker (late or not)."""

    # -- requests -----------------------------------------------------------------------

    def compute(self, request_id: str, transfer_id: str, n: int) -> list[int]:
        """The forward pass and request_finished: allocate, write the KV, hand the blocks to the connector.

        Raises :class:`NoFreeBlocks` when the pool cannot hold the request (the caller queues it).
        """
        blocks = self.blocks.pool.allocate(request_id, n)
        self.blocks.fill(blocks, transfer_id, 0)
        try:
            self._call(self.tracker.begin, request_id, transfer_id=transfer_id, block_ids=blocks)
        finally:
            self.blocks.pool.release(request_id)  # delay_free: the connector's hold keeps them
        self._computed[transfer_id] = None
        while len(self._computed) > COMPUTED_LIMIT:
            self._computed.popitem(last=False)
        early = self._early.pop(transfer_id, None)
        if early is not None:
            self._deliver("remote_blocks", transfer_id, remote_blocks=early)
        return blocks

    def abort(self, request_id: str) -> None:
        self._fire(request_id, "abort")

    # -- once per step ------------------------------------------------------------------

    def step(self, now: float | None = None) -> Finished:
        """Take the messages, finish the writes that ended, fire due deadlines, admit queued requests."""
        for message in self.transport.messages():
            self.on_message(message)
        if isinstance(self.driver, BlockWriter):
            done, failed = self.driver.statuses()
            self._fire_many("complete", done)
            self._fire_many("fail", failed)
        self._poll(now)
        self._admit()
        return self.driver.report.take()

    def on_message(self, message: Message) -> None:
        if isinstance(message, RemoteBlocks):
            self.counts["remote_blocks"] += 1
            if message.transfer_id not in self._computed:  # decode was quicker than the forward pass
                self._keep_early(message)
            else:
                self._deliver("remote_blocks", message.transfer_id, remote_blocks=message)
        elif isinstance(message, Release):
            self.counts["release"] += 1
            if not isinstance(self.driver, BlockLender) or self.driver.count_release(message.transfer_id):
                self._deliver("release", message.transfer_id)
        elif isinstance(message, Prefill):
            self.queued[message.transfer_id] = message
            self._admit()
        elif isinstance(message, StatsQuery):
            self.transport.notify(message.reply_to, Stats(self.stats()))
        else:
            self.counts[f"unexpected:{type(message).__name__}"] += 1

    def stats(self) -> dict[str, object]:
        """Held requests, blocks held, outcomes, counts and anomalies, for the load report."""
        return {
            **self.side_stats(),
            "queued": len(self.queued),
            "faults": dict(self.transport.injected) if isinstance(self.transport, FaultyTransport) else {},
        }

    # -- internals ----------------------------------------------------------------------

    def _keep_early(self, message: RemoteBlocks) -> None:
        self._early[message.transfer_id] = message
        while len(self._early) > EARLY_LIMIT:
            self._early.popitem(last=False)
            self.counts["early_dropped"] += 1

    def _admit(self) -> None:
        while self.queued:
            transfer_id, job = next(iter(self.queued.items()))
            try:
                blocks = self.compute(job.request_id, transfer_id, job.n)
            except NoFreeBlocks:
                return
            del self.queued[transfer_id]
            if self.mode == "read":
                b = self.blocks
                self.transport.notify(
                    job.reply_to, Computed(transfer_id, self.transport.name, b.base, b.block_bytes, blocks)
                )
