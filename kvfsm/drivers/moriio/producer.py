"""The prefill side: one TP rank's hold on each request's blocks until they are written (WRITE) or read (READ).

:class:`BlockWriter` is the driver of ``specs/moriio/write_producer.yaml``,
:class:`BlockLender` of ``read_producer.yaml``; :class:`PrefillEngine` owns a
rank's blocks, transport and tracker, and once per step turns the messages
it received and the statuses of its posted writes into events. Every message
is routed by ``transfer_id`` (the spec says so). In WRITE mode a ``release``
from the decode side means it gave up on the transfer (vLLM's MoRIIO sends
it when a decode request is aborted): a request whose writes have not started
is aborted with nothing written, one whose writes are posted drains them, and
either answers ``released`` once nothing more can land, since the decode side
keeps its blocks until then. A message that names a transfer not computed here
yet is the spec's to keep (``early:`` on ``remote_blocks`` and ``release``):
the tracker applies it when the hold begins, or drops it as an ``early``
anomaly past its window.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine import Tracker
from ...errors import ActionError, Failure
from ...spec import Spec
from ..block_pool import NoFreeBlocks
from ..dataplane import Extent
from ..nixl.blocks import KVBlocks
from ..nixl.memory import BlockLayout, BlockMemory, Part, read_extents
from ..report import Finished, Report, SendReport
from .messages import Computed, Message, Prefill, Release, Released, RemoteBlocks, Stats, StatsQuery, WriteDone
from .plane import PlaneTransport, split_statuses
from .side import Side, count_senders, counted_events
from .specs import moriio_spec


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
    sent: tuple[int, int] = (0, 0)
    """Blocks and bytes the posted batch writes."""


WITHDRAWN = object()
"""The batch of a request whose writes were withdrawn before they were posted: nothing is in flight."""


class BlockHolder(SendReport):
    """Actions both producer specs share: owe vLLM finished_sending, hold the computed blocks, free them.

    ``_owed`` is the ``send_report`` record (:class:`~kvfsm.drivers.report.SendReport`'s
    actions); ``_jobs[key]`` the ``src_blocks`` one: taken by
    :meth:`hold_blocks`, dropped by :meth:`free_blocks`, so it lives exactly
    as long as the hold.
    """

    def __init__(self, blocks: BlockMemory, transport: PlaneTransport, rank: int = 0) -> None:
        self.blocks = blocks
        self.pool = blocks.pool
        self.transport = transport
        self.rank = rank
        self.report = Report()
        self.stats: Counter[str] = Counter()
        self._owed: set[Hashable] = set()
        self._jobs: dict[Hashable, Job] = {}

    @staticmethod
    def holder(key: Hashable) -> tuple[str, Hashable]:
        return ("moriio_send", key)

    def hold_blocks(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None:
        self.pool.pin(self.holder(key), block_ids)
        self._jobs[key] = Job(transfer_id, tuple(block_ids))

    def free_blocks(self, key: Hashable, /) -> None:
        del self._jobs[key]
        self.pool.release(self.holder(key))

    def observe(self, key: Hashable) -> set[str]:
        held = {"src_blocks"} if self.pool.held_by(self.holder(key)) else set()
        if key in self._owed:
            held.add("send_report")
        return held


class BlockWriter(BlockHolder):
    """Actions of ``moriio_write_producer``: post the writes into the decode side's blocks, tell it when they landed.

    ``_batches[key]`` is the ``xfer`` record (:meth:`post_writes`,
    :meth:`release_writes`): the peer and the posted batch, None while the
    batch is held back (:meth:`hold_back_writes`). ``transfer_timeout`` (set by
    :class:`PrefillEngine` from the spec's params) is how long posted writes
    may stay in flight: a ``remote_blocks`` whose ``write_by`` comes sooner is
    refused, so no write can land in blocks the decode side has given back.
    """

    def __init__(self, blocks: BlockMemory, transport: PlaneTransport, rank: int = 0) -> None:
        super().__init__(blocks, transport, rank)
        self._batches: dict[Hashable, tuple[str, object | None]] = {}
        self._held_back: dict[Hashable, tuple[str, list[Extent], list[int], str]] | None = None
        """While not None: the batches :meth:`post_writes` prepared and did not post yet (:meth:`hold_back_writes`)."""
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
        job.sent = (n, sum(size for _, size in local))
        if self._held_back is not None:
            self._batches[key] = (remote_blocks.peer, None)
            self._held_back[key] = (remote_blocks.peer, local, [a for a, _ in remote], job.transfer_id)
        else:
            self._post(key, remote_blocks.peer, local, [a for a, _ in remote], job.transfer_id)

    def _post(self, key: Hashable, peer: str, local: list[Extent], remote: list[int], transfer_id: str) -> None:
        batch = self.transport.write(peer, local, remote, transfer_id)
        self._batches[key] = (peer, batch)
        self.stats["batches_posted"] += 1
        self.stats["extents_posted"] += len(local)
        self.stats["blocks_posted"] += self._jobs[key].sent[0]

    def hold_back_writes(self) -> None:
        """Until :meth:`post_held_back`, :meth:`post_writes` prepares each batch and keeps it unposted.

        The tracker applies the messages it kept for a transfer in one call (at begin, oldest first): a
        ``release`` applied after its ``remote_blocks`` then withdraws the batch before it was ever posted.
        """
        self._held_back = {}

    def post_held_back(self) -> dict[Hashable, Exception]:
        """Post the batches held back since :meth:`hold_back_writes` and not withdrawn; the requests whose post
        raised, with the error (their batch is gone: the caller fails them)."""
        held, self._held_back = self._held_back or {}, None
        raised: dict[Hashable, Exception] = {}
        for key, (peer, local, remote, transfer_id) in held.items():
            try:
                self._post(key, peer, local, remote, transfer_id)
            except Exception as exc:  # what post_writes would have raised: TransferError, a dead peer
                raised[key] = exc
        return raised

    def release_writes(self, key: Hashable, /) -> None:
        _, batch = self._batches.pop(key)
        if self._held_back is not None and self._held_back.pop(key, None) is not None:
            self.stats["batches_withdrawn"] += 1  # never posted: nothing can land
        elif batch is not None and batch is not WITHDRAWN:
            self.transport.release(batch)

    def withdraw_writes(self, key: Hashable, /, reply_to: str) -> None:
        """The decode side gave up while the writes were due (``release`` in ``writing``): a batch not posted yet is
        withdrawn (complete at once, nothing written); a posted one cannot be recalled and is waited for. Either way
        ``released`` goes, when it has ended, to the peer the writes go to (``reply_to`` names it too)."""
        if self._held_back is not None and self._held_back.pop(key, None) is not None:
            peer, _ = self._batches[key]
            self._batches[key] = (peer, WITHDRAWN)
            self.stats["batches_withdrawn"] += 1

    def notify_released(self, key: Hashable, /, reply_to: str | None = None) -> None:
        """Answer the decode side's ``release``: this rank writes no more into the request's blocks. ``reply_to``: where
        the ``release`` said to answer; None once writes were posted (``draining``): to the peer they went to."""
        job = self._jobs[key]
        peer = reply_to if reply_to is not None else self._batches[key][0]
        if not peer:  # a release from a decode request that never announced blocks: nobody waits
            self.stats["released_unaddressed"] += 1
            return
        self.transport.notify(peer, Released(job.transfer_id, self.rank))
        self.stats["released_sent"] += 1

    def notify_write_done(self, key: Hashable, /) -> None:
        peer, _ = self._batches[key]
        job = self._jobs[key]
        self.stats["batches_written"] += 1
        self.stats["blocks_written"] += job.sent[0]
        self.stats["bytes_written"] += job.sent[1]
        self.transport.notify(peer, WriteDone(job.transfer_id, self.rank))

    def statuses(self) -> tuple[list[Hashable], list[Hashable]]:
        """The requests whose writes all succeeded (a withdrawn batch at once), and those whose writes failed."""
        posted = {key: b for key, (_, b) in self._batches.items() if b is not None and b is not WITHDRAWN}
        done, failed = split_statuses(self.transport, posted)
        return done + [key for key, (_, b) in self._batches.items() if b is WITHDRAWN], failed

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
        transport: PlaneTransport,
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
        faults: Mapping[str, int] | None = None,
    ) -> None:
        """``blocks``: the rank's block memory (vLLM's cache); kvfsm's own ``num_blocks`` × ``block_bytes`` if None.
        ``acks`` (READ mode): how many decode ranks read each request's blocks (:func:`expected_acks`), the
        spec's ``readers``; None leaves it to ``params`` or the spec. ``faults``: the live count of what a fault
        wrapper in front of the transport injected, reported in :meth:`stats` (a peer process's only way to say it)."""
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
        self._faults = faults

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

        The messages the tracker kept for ``transfer_id`` (``early:``) are applied as the hold begins, oldest
        first; writes they start are posted only once all of them have been applied, so a ``release`` kept after
        its ``remote_blocks`` still means nothing is written. If the hold cannot even begin, the request is
        reported finished_sending all the same (undoing ``send_report``, the spec's first acquire): its owner must
        not keep the blocks for a hold that does not exist.
        """
        writer = self.driver if isinstance(self.driver, BlockWriter) else None
        if writer is not None:
            writer.hold_back_writes()
        try:
            self._call(self.tracker.begin, request_id, transfer_id=transfer_id, block_ids=list(block_ids))
        finally:
            raised = writer.post_held_back() if writer is not None else {}
        for key, exc in raised.items():  # as if post_writes had raised: the spec's on_error
            self._fire(key, "fail")
            state = self.tracker.state(key) or "failed"
            self.errors.append(ActionError([Failure(key, "remote_blocks", "post_writes", "acquire", exc, state)]))

    def abort(self, request_id: str) -> None:
        self._fire(request_id, "abort")

    # -- once per step ------------------------------------------------------------------

    def step(self, now: float | None = None) -> Finished:
        """Take the messages, finish the writes that ended, fire due deadlines, admit queued requests.

        Of one step's messages the ``release`` ones go first: a decode side
        that gave up on a transfer must never see it written, even when its
        ``remote_blocks`` waited in the same batch (a prefill that was stalled).
        Messages for a transfer not computed yet wait in the tracker until
        :meth:`hold`, which keeps the same rule for them.
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
        """One message, to the tracker by ``transfer_id``: one for a transfer not computed yet is the spec's to keep."""
        if isinstance(message, RemoteBlocks):
            self.counts["remote_blocks"] += 1
            self._deliver("remote_blocks", message.transfer_id, remote_blocks=message)
        elif isinstance(message, Release):  # WRITE: the decode side gave up (answer it); READ: its reads ended
            self.counts["release"] += 1
            reply = {"reply_to": message.reply_to} if self.mode == "write" else {}
            self._heard("release", message.transfer_id, message.rank, **reply)
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
            "transfers": dict(self.driver.stats),
            "faults": dict(self._faults) if self._faults is not None else {},
        }

    # -- internals ----------------------------------------------------------------------

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
