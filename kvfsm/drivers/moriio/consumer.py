"""The decode side: one TP rank's blocks for each request, filled by the prefill's writes (WRITE) or by its reads (READ).

:class:`WriteReceiver` is the driver of ``specs/moriio/write_consumer.yaml``,
:class:`BlockReader` of ``read_consumer.yaml``; :class:`DecodeEngine` owns a
rank's blocks, transport and tracker, and once per step turns ``write_done``
messages and the statuses of its reads into events. Every block is
byte-checked against the prefill's KV for the transfer before it counts as
loaded (on kvfsm's own blocks; vLLM's cache holds the model's KV, which only
the tokens generated from it can check); a block that was not is reported
invalid. In WRITE mode an aborted load sends the prefill a ``release`` and
keeps its blocks until the prefill answers (``released``, or ``write_done``
when its writes landed first) or the load's deadline passes: the spec's
``aborting``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ...engine import Tracker
from ...spec import Spec
from ..dataplane import Extent
from ..nixl.blocks import KVBlocks
from ..nixl.memory import BlockMemory
from ..report import Finished, RecvReport, Report
from .messages import Computed, LayoutPart, Message, Release, Released, RemoteBlocks, Stats, WriteDone
from .plane import PlaneTransport, split_statuses
from .side import Side, count_senders, counted_events
from .specs import moriio_spec


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
    """One request's local blocks and the transfer id."""

    transfer_id: str
    blocks: tuple[int, ...]
    peer: str = ""
    """WRITE mode: the prefill rank this load announces its blocks to (the engine's ``peer`` if empty)."""


class BlockLoader(RecvReport):
    """Actions both consumer specs share: owe vLLM the load's report, pin the allocated blocks, byte-check them.

    ``_owed[key]`` is the ``recv_report`` record (:meth:`owe_recv_report`; :meth:`report_recv`, or
    :meth:`report_loaded` on the edge that byte-checked the blocks), ``_loads[key]`` the ``dst_blocks`` one
    (:meth:`pin_dst`, :meth:`unpin_dst`). Who has written the blocks is the spec's to count
    (``count: writers``), not this driver's.
    """

    def __init__(self, blocks: BlockMemory, transport: PlaneTransport, peer: str, rank: int = 0) -> None:
        self.blocks = blocks
        self.pool = blocks.pool
        self.transport = transport
        self.peer = peer
        self.rank = rank
        self.report = Report()
        self.stats: Counter[str] = Counter()
        self._owed: dict[Hashable, tuple[int, ...]] = {}
        self._loads: dict[Hashable, Load] = {}

    @staticmethod
    def holder(key: Hashable) -> tuple[str, Hashable]:
        return ("moriio_recv", key)

    def _pin(self, key: Hashable, transfer_id: str, block_ids: Sequence[int]) -> None:
        self.pool.pin(self.holder(key), block_ids)
        self._loads[key] = Load(transfer_id, tuple(block_ids))

    def unpin_dst(self, key: Hashable, /) -> None:
        self._loads.pop(key)
        self.pool.release(self.holder(key))

    def verify_blocks(self, key: Hashable, /) -> None:
        """Byte-check the blocks against the prefill's KV; on vLLM's cache (which cannot tell) count them unchecked."""
        load = self._loads[key]
        wrong = self.blocks.wrong(load.blocks, load.transfer_id, 0)
        if wrong:
            self.stats["blocks_wrong"] += len(wrong)
            raise BlockMismatch(f"request {key!r}: blocks {wrong} do not hold transfer {load.transfer_id!r}'s KV")
        self.stats["blocks_verified" if wrong is not None else "blocks_unchecked"] += len(load.blocks)

    def observe(self, key: Hashable) -> set[str]:
        held = {"dst_blocks"} if self.pool.held_by(self.holder(key)) else set()
        if self.owes(key):
            held.add("recv_report")
        return held


class WriteReceiver(BlockLoader):
    """Actions of ``moriio_write_consumer``: tell the prefill side where the blocks are.

    ``announce_to[key]``, set before ``begin``, names the prefill rank of a
    load when loads go to different prefill engines (vLLM's requests name
    theirs); it becomes part of the ``dst_blocks`` record. ``recv_timeout``
    (set by :class:`DecodeEngine` from the spec's params, with ``bound_writes``)
    puts a ``write_by`` in ``remote_blocks``: when this side will stop waiting
    and give the blocks back.
    """

    def __init__(self, blocks: BlockMemory, transport: PlaneTransport, peer: str, rank: int = 0) -> None:
        super().__init__(blocks, transport, peer, rank)
        self.announce_to: dict[Hashable, str] = {}
        self._granted: set[Hashable] = set()
        """The ``write_grant`` record: loads whose ``remote_blocks`` went out and was neither revoked nor used."""
        self.recv_timeout = 0.0
        self.wall: Callable[[], float] = time.time
        parts = [LayoutPart(p.base, p.stride, list(p.runs)) for p in blocks.layout.parts]
        self._layout = [] if isinstance(blocks, KVBlocks) else parts
        self._base = blocks.base if isinstance(blocks, KVBlocks) else 0

    def pin_dst(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None:
        peer = self.announce_to.pop(key, "")
        self._pin(key, transfer_id, block_ids)
        self._loads[key].peer = peer

    def send_remote_blocks(self, key: Hashable, /) -> None:
        """Take ``write_grant``: tell the prefill rank where the blocks are, and when this side stops waiting."""
        load = self._loads[key]
        write_by = self.wall() + self.recv_timeout if self.recv_timeout > 0 else 0.0
        message = RemoteBlocks(
            load.transfer_id, self.transport.name, self._base, self.blocks.layout.block_bytes, list(load.blocks),
            self.rank, self._layout, write_by,
        )  # fmt: skip
        self.transport.notify(load.peer or self.peer, message)
        self._granted.add(key)
        self.stats["blocks_announced"] += len(load.blocks)

    def send_release(self, key: Hashable, /) -> None:
        """Revoke ``write_grant``: tell the prefill rank the load gave up, to write no more and answer ``released``.

        If it raises, the spec has already moved the load to ``aborting``: the blocks stay held until an answer or
        the load's deadline, by which no write can still be in flight (``write_by``).
        """
        self._granted.remove(key)
        load = self._loads[key]
        self.transport.notify(load.peer or self.peer, Release(load.transfer_id, self.rank, self.transport.name))
        self.stats["release_sent"] += 1

    def forget_grant(self, key: Hashable, /) -> None:
        """The writes are over (``write_done``, or the deadline past ``write_by``): nothing to revoke."""
        self._granted.remove(key)

    def observe(self, key: Hashable) -> set[str]:
        return super().observe(key) | ({"write_grant"} if key in self._granted else set())


class BlockReader(BlockLoader):
    """Actions of ``moriio_read_consumer``: read the prefill's blocks, and send ``release`` however the load ends.

    ``_sources[key]`` is kept with the ``dst_blocks`` record, ``_batches[key]``
    is the ``xfer`` one (:meth:`post_reads`, :meth:`release_reads`), ``_releases[key]``
    the ``peer_release`` one (:meth:`owe_release`, :meth:`send_release`).
    """

    def __init__(self, blocks: BlockMemory, transport: PlaneTransport, peer: str, rank: int = 0) -> None:
        super().__init__(blocks, transport, peer, rank)
        self._sources: dict[Hashable, Source] = {}
        self._batches: dict[Hashable, object] = {}
        self._releases: dict[Hashable, tuple[str, str]] = {}

    def pin_dst(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int], remote_blocks: Source) -> None:
        if len(remote_blocks.blocks) < len(block_ids):
            raise ValueError(
                f"request {key!r}: {len(block_ids)} local blocks for {len(remote_blocks.blocks)} remote ones"
            )
        self._pin(key, transfer_id, block_ids)
        self._sources[key] = remote_blocks

    def owe_release(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int], remote_blocks: Source) -> None:
        self._releases[key] = (remote_blocks.peer, transfer_id)

    def send_release(self, key: Hashable, /) -> None:
        """Tell the prefill side its blocks are free to go: on success and on failure alike."""
        peer, transfer_id = self._releases.pop(key)
        self.transport.notify(peer, Release(transfer_id, self.rank))

    def post_reads(self, key: Hashable, /) -> None:
        load = self._loads[key]
        source = self._sources[key]
        if not isinstance(self.blocks, KVBlocks):
            raise TypeError("READ mode reads into kvfsm's own blocks; on vLLM's cache the connector runs WRITE mode")
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
        if key in self._releases:
            held.add("peer_release")
        return held


class DecodeEngine(Side):
    """One decode TP rank: blocks registered with the transport, a tracker of loads, messages and statuses per step."""

    def __init__(
        self,
        transport: PlaneTransport,
        num_blocks: int,
        block_bytes: int,
        peer: str,
        *,
        mode: str = "write",
        rank: int = 0,
        acks: int | None = None,
        params: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        spec: Spec | None = None,
        driver: type[WriteReceiver] | type[BlockReader] | None = None,
        blocks: BlockMemory | None = None,
        bound_writes: bool = False,
    ) -> None:
        """``blocks``: the rank's block memory (vLLM's cache); kvfsm's own ``num_blocks`` × ``block_bytes`` if None.
        ``peer``: the prefill rank loads announce to unless :meth:`load` names another. ``bound_writes`` (WRITE
        mode): every ``remote_blocks`` says when this side stops waiting (``recv_timeout`` from now, as
        ``write_by``), and the prefill refuses writes that could still be in flight then, so none lands in blocks
        given back, however late the message reached it. Without it, safety rests on the timeouts' order alone
        (``recv_timeout`` above the prefill's ``defer_timeout + transfer_timeout``), which a prefill that computes
        a request after its ``remote_blocks`` came does not keep. ``acks`` (WRITE mode): how many prefill ranks
        write into each load (:func:`~.producer.expected_acks`), the spec's ``writers``; None leaves it to
        ``params`` or the spec."""
        super().__init__(transport, num_blocks, block_bytes, mode, blocks)
        kind = driver if driver is not None else WriteReceiver if mode == "write" else BlockReader
        self.driver: BlockLoader = kind(self.blocks, transport, peer, rank)
        spec = spec if spec is not None else moriio_spec(f"{mode}_consumer")
        params = count_senders(spec, "write_done", acks, params) if mode == "write" else params
        self.tracker = Tracker(spec, self.driver, params=params, clock=clock)
        self.counted = counted_events(spec)
        if bound_writes and isinstance(self.driver, WriteReceiver) and "recv_timeout" in self.tracker.params:
            self.driver.recv_timeout = float(self.tracker.params["recv_timeout"].value)  # the `load` phase's deadline
        self.on_computed: Callable[[str, Source], object] | None = None
        """READ mode: told where the prefill computed a transfer's blocks (its ``computed`` answer to a
        ``prefill``), by whoever sent the ``prefill`` and starts the load with it (a load runner)."""
        self.replies: list[Stats] = []
        self._allocated: set[Hashable] = set()
        """Requests whose blocks :meth:`start` allocated (the scheduler's part): freed when their load ends."""

    def start(self, request_id: str, transfer_id: str, n: int, source: Source | None = None) -> list[int]:
        """Allocate ``n`` blocks and start the load (WRITE: announce them; READ: read ``source``).

        Raises :class:`~kvfsm.drivers.block_pool.NoFreeBlocks` when the pool is full.
        """
        if self.mode == "read" and source is None:
            raise ValueError(f"request {request_id!r}: READ mode needs the prefill's blocks (source)")
        blocks = self.blocks.pool.allocate(request_id, n)
        self._allocated.add(request_id)
        if self.mode == "write":
            self.load(request_id, transfer_id, blocks)
        else:
            self._call(self.tracker.begin, request_id, transfer_id=transfer_id, block_ids=blocks, remote_blocks=source)
            self._fire(request_id, "read")
        return blocks

    def load(self, request_id: str, transfer_id: str, block_ids: Sequence[int], peer: str = "") -> None:
        """WRITE mode: load into ``block_ids``, which the caller allocated (vLLM's scheduler), announcing them to
        ``peer`` (default: the engine's ``peer``); the caller frees them once the load is reported finished. A load
        that cannot even begin is reported at once, its blocks invalid: the caller must never wait for it."""
        if self.mode != "write" or not isinstance(self.driver, WriteReceiver):
            raise ValueError("load() announces blocks for the prefill to write (WRITE mode); READ mode uses start()")
        if peer:
            self.driver.announce_to[request_id] = peer
        try:
            self._call(self.tracker.begin, request_id, transfer_id=transfer_id, block_ids=list(block_ids))
        finally:
            self.driver.announce_to.pop(request_id, None)
        if self.tracker.state(request_id) is not None:  # else pin_dst raised: undoing recv_report reported it
            self._fire(request_id, "announce")

    def abort(self, request_id: str) -> None:
        """Abort ``request_id``'s load. In WRITE mode, once its blocks were announced, the spec sends the prefill a
        ``release`` and keeps the blocks until the prefill has stopped writing (``aborting``)."""
        self._fire(request_id, "abort")

    def waiting(self) -> int:
        """Loads waiting for the prefill side (WRITE: announced, no write_done yet, or aborted and not yet answered;
        READ: reads in flight)."""
        census = self.tracker.census()
        return census.get("waiting", 0) + census.get("aborting", 0) + census.get("reading", 0)

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
            if key in self._allocated:
                self._allocated.discard(key)
                self.blocks.pool.release(key)  # the scheduler's own allocation
        return finished

    def on_message(self, message: Message) -> None:
        if isinstance(message, WriteDone):
            self.counts["write_done"] += 1
            self._heard("write_done", message.transfer_id, message.rank)  # an unknown or finished id: an anomaly
        elif isinstance(message, Released):
            self.counts["released"] += 1
            self._heard("released", message.transfer_id, message.rank)
        elif isinstance(message, Computed) and self.on_computed is not None:
            self.on_computed(
                message.transfer_id, Source(message.peer, message.base, message.block_bytes, tuple(message.blocks))
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
            "transfers": dict(self.driver.stats),
        }
