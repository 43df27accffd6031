"""The prefill side: one TP rank's hold on each request's blocks until they are written (WRITE) or read (READ).

:class:`BlockWriter` is the driver of ``specs/moriio/write_producer.yaml``,
:class:`BlockLender` of ``read_producer.yaml``; :class:`PrefillEngine` owns a
rank's blocks, transport and tracker, and once per step turns the messages
it received and the statuses of its posted writes into events. Every message
is routed by ``transfer_id`` (the spec says so); a ``remote_blocks`` that
arrives before its request was computed is kept until it is (vLLM's deferred
task the other way round), bounded in number. In WRITE mode a ``release``
from the decode side means it gave up on the transfer (vLLM's MoRIIO sends
it when a decode request is aborted): the request is aborted, its blocks
freed and nothing written; one that arrives before the request was computed
aborts it as soon as it is.
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
from ..nixl.memory import BlockLayout, BlockMemory, Part, read_extents
from ..report import Finished, Report
from .faults import FaultyTransport
from .messages import Computed, Message, Prefill, Release, RemoteBlocks, Stats, StatsQuery, WriteDone
from .side import Side, count_senders, counted_events
from .specs import moriio_spec
from .transport import Transport, split_statuses

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
    sent: tuple[int, int] = (0, 0)
    """Blocks and bytes the posted batch writes."""


class BlockHolder:
    """Actions both producer specs share: hold the computed blocks, free them and report finished_sending.

    ``_jobs[key]`` is the ``src_blocks`` record: taken by :meth:`hold_blocks`,
    dropped by :meth:`free_blocks`, so it lives exactly as long as the hold.
    """

    def __init__(self, blocks: BlockMemory, transport: Transport, rank: int = 0) -> None:
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
    :meth:`release_writes`). ``transfer_timeout`` (set by :class:`PrefillEngine`
    from the spec's params) is how long posted writes may stay in flight: a
    ``remote_blocks`` whose ``write_by`` comes sooner is refused, so no write
    can land in blocks the decode side has given back.
    """

    def __init__(self, blocks: BlockMemory, transport: Transport, rank: int = 0) -> None:
        super().__init__(blocks, transport, rank)
        self._batches: dict[Hashable, tuple[str, object]] = {}
        self.transfer_timeout = 0.0
        self.wall: Callable[[], float] = time.time
        """The clock ``write_by`` is read on: wall time, the one both engines share."""

    def post_writes(self, key: Hashable, /, remote_blocks: RemoteBlocks) -> None:
        """One batch writing the computed blocks into the decode side's, aligned at the end.

        The decode side may need fewer blocks than were computed (its own
        prefix cache had the first ones): the last ``len(remote blocks)`` are
        written. It may have more: they fill its last ones. A write is one
        extent per contiguous run on both sides (one per layer and block of
        vLLM's cache).
        """
        job = self._jobs[key]
        if remote_blocks.write_by and self.wall() + self.transfer_timeout > remote_blocks.write_by:
            raise TimeoutError(
                f"request {key!r}: the decode side stops waiting for transfer {job.transfer_id!r} in "
                f"{remote_blocks.write_by - self.wall():.2f} s, sooner than a write may take ({self.transfer_timeout} s)"
            )
        if remote_blocks.block_bytes != self.blocks.layout.block_bytes:
            raise ValueError(
                f"request {key!r}: remote blocks of {remote_blocks.block_bytes} B, local of "
                f"{self.blocks.layout.block_bytes} B (the engines must run the same model, block size and dtype)"
            )
        n = min(len(job.blocks), len(remote_blocks.blocks))
        src = job.blocks[len(job.blocks) - n :]
        dst = remote_blocks.blocks[len(remote_blocks.blocks) - n :]
        local, remote = read_extents(
            self.blocks.layout, src, 0, remote_layout(remote_blocks), dst, 0, remote_blocks.block_bytes
        )
        batch = self.transport.write(remote_blocks.peer, local, [a for a, _ in remote], job.transfer_id)
        self._batches[key] = (remote_blocks.peer, batch)
        self.stats["batches_posted"] += 1
        self.stats["extents_posted"] += len(local)
        self.stats["blocks_posted"] += n
        job.sent = (n, sum(size for _, size in local))

    def release_writes(self, key: Hashable, /) -> None:
        _, batch = self._batches.pop(key)
        self.transport.release(batch)

    def notify_write_done(self, key: Hashable, /) -> None:
        peer, _ = self._batches[key]
        job = self._jobs[key]
        job.written = True
        self.stats["batches_written"] += 1
        self.stats["blocks_written"] += job.sent[0]
        self.stats["bytes_written"] += job.sent[1]
        self.transport.notify(peer, WriteDone(job.transfer_id, self.rank))

    def statuses(self) -> tuple[list[Hashable], list[Hashable]]:
        """The requests whose writes all succeeded, and those whose writes ended with a failure."""
        return split_statuses(self.transport, {key: batch for key, (_, batch) in self._batches.items()})

    def observe(self, key: Hashable) -> set[str]:
        return super().observe(key) | ({"xfer"} if key in self._batches else set())


def remote_layout(message: RemoteBlocks) -> BlockLayout:
    """Where the decode side's blocks are, as its ``remote_blocks`` says (one run per block without a layout)."""
    if not message.layout:
        return BlockLayout.contiguous(message.base, message.block_bytes)
    layout = BlockLayout(tuple(Part(p.base, p.stride, tuple((o, n) for o, n in p.runs)) for p in message.layout))
    if layout.block_bytes != message.block_bytes:
        raise ValueError(f"remote_blocks describes blocks of {layout.block_bytes} B but says {message.block_bytes} B")
    return layout


class BlockLender(BlockHolder):
    """Actions of ``moriio_read_producer``: the blocks wait for the decode side's releases.

    Who has released them is the spec's to count (``count: readers``), not this driver's.
    """


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
        acks: int | None = None,
        params: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        spec: Spec | None = None,
        driver: type[BlockWriter] | type[BlockLender] | None = None,
        blocks: BlockMemory | None = None,
    ) -> None:
        """``blocks``: the rank's block memory (vLLM's cache); kvfsm's own ``num_blocks`` × ``block_bytes`` if None.
        ``acks`` (READ mode): how many decode ranks read each request's blocks (:func:`expected_acks`), the
        spec's ``readers``; None leaves it to ``params`` or the spec."""
        super().__init__(transport, num_blocks, block_bytes, mode, blocks)
        kind = driver if driver is not None else BlockWriter if mode == "write" else BlockLender
        self.driver: BlockHolder = kind(self.blocks, transport, rank)
        spec = spec if spec is not None else moriio_spec(f"{mode}_producer")
        params = count_senders(spec, "release", acks, params) if mode == "read" else params
        self.tracker = Tracker(spec, self.driver, params=params, clock=clock)
        self.counted = counted_events(spec)
        if isinstance(self.driver, BlockWriter) and "writing" in spec.states:
            self.driver.transfer_timeout = self.tracker.timeout("writing") or 0.0
        self.queued: OrderedDict[str, Prefill] = OrderedDict()
        """Requests waiting for free blocks, in arrival order (vLLM's waiting queue)."""
        self._early: OrderedDict[str, RemoteBlocks] = OrderedDict()
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        """WRITE mode: transfers the decode side gave up on before they were computed here."""
        self._computed: OrderedDict[str, None] = OrderedDict()
        """The latest transfer ids computed here: a message for one of them goes to the tracker (late or not)."""

    # -- requests -----------------------------------------------------------------------

    def compute(self, request_id: str, transfer_id: str, n: int) -> list[int]:
        """The forward pass and request_finished: allocate, write the KV, hand the blocks to the connector.

        Raises :class:`NoFreeBlocks` when the pool cannot hold the request (the caller queues it).
        """
        if not isinstance(self.blocks, KVBlocks):
            raise TypeError("compute() writes kvfsm's own byte pattern; a rank on vLLM's cache is given blocks (hold)")
        blocks = self.blocks.pool.allocate(request_id, n)
        self.blocks.fill(blocks, transfer_id, 0)
        try:
            self.hold(request_id, transfer_id, blocks)
        finally:
            self.blocks.pool.release(request_id)  # delay_free: the connector's hold keeps them
        return blocks

    def hold(self, request_id: str, transfer_id: str, block_ids: Sequence[int]) -> None:
        """request_finished handed over ``block_ids`` (delay_free): hold them for ``transfer_id``'s writes or reads.

        A ``remote_blocks`` that came first is delivered now; a ``release`` that came first aborts at once. If the
        hold cannot even begin, the request is reported finished_sending at once: its owner must not keep the
        blocks for a hold that does not exist.
        """
        self._call(self.tracker.begin, request_id, transfer_id=transfer_id, block_ids=list(block_ids))
        if self.tracker.state(request_id) is None:  # begin refused (hold_blocks raised): nothing holds them
            self.driver.report.send(request_id)  # vLLM still keeps them for us (delay_free) until it hears
        self._computed[transfer_id] = None
        while len(self._computed) > COMPUTED_LIMIT:
            self._computed.popitem(last=False)
        early = self._early.pop(transfer_id, None)
        if transfer_id in self._cancelled:
            del self._cancelled[transfer_id]
            self.counts["cancelled_early"] += 1
            self._fire(request_id, "abort")
        elif early is not None:
            self._deliver("remote_blocks", transfer_id, remote_blocks=early)

    def abort(self, request_id: str) -> None:
        self._fire(request_id, "abort")

    # -- once per step ------------------------------------------------------------------

    def step(self, now: float | None = None) -> Finished:
        """Take the messages, finish the writes that ended, fire due deadlines, admit queued requests.

        Of one step's messages the ``release`` ones go first: a decode side
        that gave up on a transfer must never see it written, even when its
        ``remote_blocks`` waited in the same batch (a prefill that was stalled).
        """
        messages = self.transport.messages()
        messages.sort(key=lambda m: not isinstance(m, Release))  # stable: otherwise in arrival order
        for message in messages:
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
            if message.transfer_id in self._cancelled:
                self.counts["remote_blocks_cancelled"] += 1
            elif message.transfer_id not in self._computed:  # decode was quicker than the forward pass
                self._keep_early(message)
            else:
                self._deliver("remote_blocks", message.transfer_id, remote_blocks=message)
        elif isinstance(message, Release):
            self.counts["release"] += 1
            if self.mode == "write":
                self._cancel(message.transfer_id)
            else:
                self._heard("release", message.transfer_id, message.rank)
        elif isinstance(message, Prefill):
            self.queued[message.transfer_id] = message
            self._admit()
        elif isinstance(message, StatsQuery):
            self.transport.notify(message.reply_to, Stats(self.stats()))
        else:
            self.counts[f"unexpected:{type(message).__name__}"] += 1

    def _cancel(self, transfer_id: str) -> None:
        """The decode side gave up on ``transfer_id`` (WRITE mode): abort it here, or as soon as it is computed."""
        key = self.tracker.route("transfer_id", transfer_id)
        if key is not None:
            self.counts["cancelled"] += 1
            self._fire(key, "abort")
        elif transfer_id not in self._computed:
            self._early.pop(transfer_id, None)
            self._cancelled[transfer_id] = None
            while len(self._cancelled) > EARLY_LIMIT:
                self._cancelled.popitem(last=False)
                self.counts["cancelled_dropped"] += 1
        # else: it has ended already (written, failed, expired): nothing to undo

    def stats(self) -> dict[str, object]:
        """Held requests, blocks held, outcomes, counts and anomalies, for the load report."""
        return {
            **self.side_stats(),
            "queued": len(self.queued),
            "transfers": dict(self.driver.stats),
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
                assert isinstance(b, KVBlocks)  # compute() refuses any other memory
                self.transport.notify(
                    job.reply_to, Computed(transfer_id, self.transport.name, b.base, b.block_bytes, blocks)
                )
