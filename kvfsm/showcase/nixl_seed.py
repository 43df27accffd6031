"""Seed 004 as a driver: a decode reader that tells the skipped MLA prefill ranks the decode-local id.

vLLM #41974: with MLA and prefill TP > decode TP, ``_read_blocks_for_req``
reads one prefill rank (its READ carries the right id) and sends the others
``f"{req_id}:{world_size}"``, ``req_id`` being the decode side's id, where the
prefill ranks index their held blocks by their own (``meta.remote.request_id``).
This is the correct :class:`~kvfsm.drivers.nixl.BlockReader` with that one
message changed, kept to show what kvfsm makes of it: before it runs,
``kvfsm test`` fails it with the message it sent, whose id is the key where
``nixl_decode``'s ``outgoing: read: carries: remote_request_id``; at run time
the decode journal has a ``misaddressed`` anomaly, and each skipped rank keeps
the notification as one that may have come before its request (``read`` is
early in ``nixl_prefill``), drops it after ``early_within`` as an ``early``
anomaly in its ``request_id`` space (the id never begins there), and holds the
blocks until ``abort_timeout``.

The factories :func:`correct_reader` and :func:`seed_reader` make each reader
on an embedded fabric with two MLA prefill ranks, as ``kvfsm test`` needs it,
:func:`reads` the driver of the READs a request owns (``nixl_read``), and
:func:`holder` the prefill side's driver::

    kvfsm test kvfsm/specs/nixl_decode.yaml --driver kvfsm.showcase.nixl_seed:seed_reader \
        --driver reads=kvfsm.showcase.nixl_seed:reads
    kvfsm test kvfsm/specs/nixl_prefill.yaml --driver kvfsm.showcase.nixl_seed:holder
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

from ..drivers.fabric import Fabric
from ..drivers.nixl.blocks import KVBlocks
from ..drivers.nixl.decode import BlockReader, Load, PeerInfo, ReadHandles
from ..drivers.nixl.notif import encode
from ..drivers.nixl.prefill import BlockHolder
from ..drivers.nixl.topology import Topology

ENGINE = "prefill-engine"
BLOCKS_PER_REQUEST = 2


class LocalIdReader(BlockReader):
    """Notifies the skipped ranks with the decode-local id: seed 004's shape. Not for use."""

    def skipped_notif(self, key: Hashable, load: Load) -> bytes:
        return encode(str(key), self.topology.decode_tp)  # the bug: key is the decode-local id


class FabricReader(BlockReader):
    """A decode rank's reader on an embedded fabric with two MLA prefill ranks (it reads rank 0, notifies rank 1).

    What a model-based test needs beyond the actions: ``before_begin`` plays
    the prefill (its forward pass writes the request's KV under a fresh
    prefill request id) and the scheduler (it allocates the local blocks),
    and returns the payload vLLM's ``kv_transfer_params`` would carry.
    A model-based test may fire ``read`` on a request without beginning the
    READs ``DecodeRank.start_load`` posts before it: ``verify_blocks`` then
    plays them, writing the bytes they would have read.
    """

    def __init__(self) -> None:
        topology = Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=64)
        self.fabric = Fabric()
        self.prefill: list[KVBlocks] = []
        for rank in range(topology.prefill_tp):
            blocks = KVBlocks(256, topology.block_bytes(topology.prefill_tp))
            self.fabric.agent(f"p{rank}").register(blocks.tensor)
            self.prefill.append(blocks)
        agent = self.fabric.agent("d0")
        local = KVBlocks(64, topology.block_bytes(topology.decode_tp))
        agent.register(local.tensor)
        super().__init__(0, topology, agent, local)
        self.local = local
        for rank, blocks in enumerate(self.prefill):
            self.peers[ENGINE, rank] = PeerInfo(ENGINE, rank, f"p{rank}", b"", blocks.base, blocks.block_bytes)
        self._ids = itertools.count(1)
        self.posted: set[Hashable] = set()
        """Requests with a READ posted by :class:`FabricReads`."""

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> dict[str, Any]:
        remote_id = f"p-{next(self._ids)}"
        remote_blocks: list[int] = []
        for rank, blocks in enumerate(self.prefill):
            ids = blocks.pool.allocate(remote_id, BLOCKS_PER_REQUEST)
            lo, _ = self.topology.range(rank, self.topology.prefill_tp)
            blocks.fill(ids, remote_id, lo)
            remote_blocks = remote_blocks or ids
        if self.pool.held_by(key):
            self.pool.release(key)  # the scheduler's allocation for an earlier instance of the key
        local = self.pool.allocate(key, BLOCKS_PER_REQUEST)
        self.posted.discard(key)
        return {
            "remote_request_id": remote_id,
            "remote_engine_id": ENGINE,
            "block_ids": local,
            "remote_block_ids": remote_blocks,
        }

    def verify_blocks(self, key: Hashable, /) -> None:
        if key not in self.posted:
            load = self._loads[key]
            lo, _ = self.topology.range(self.rank, self.topology.decode_tp)
            self.local.fill(load.blocks, load.remote_request_id, lo)
        super().verify_blocks(key)


class FabricReads(ReadHandles):
    """The READs of a :class:`FabricReader`'s requests: ``before_begin`` names the one prefill rank MLA reads,
    and a READ is polled before its handle goes (the embedded agent copies the bytes when polled), as
    ``DecodeRank.step`` polls it before it fires ``done``."""

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> dict[str, Any]:
        return {"rank": self.reader.topology.plan(self.reader.rank).reads[0].prefill_rank}

    def post_read(self, key: Hashable, /, request_id: Hashable, rank: int) -> None:
        super().post_read(key, request_id, rank)
        assert isinstance(self.reader, FabricReader)
        self.reader.posted.add(request_id)

    def release_read(self, key: Hashable, /) -> None:
        self.state(key)
        super().release_read(key)


class FabricLocalIdReader(LocalIdReader, FabricReader):
    """Seed 004's reader on the same fabric."""


class PoolHolder(BlockHolder):
    """A prefill rank's holder whose ``before_begin`` plays the scheduler: it allocates the request's blocks."""

    def __init__(self) -> None:
        super().__init__(KVBlocks(64, 64))

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> dict[str, Any]:
        if self.pool.held_by(key):
            self.pool.release(key)  # the scheduler's allocation for an earlier instance of the key
        return {"block_ids": self.pool.allocate(key, BLOCKS_PER_REQUEST)}


def holder() -> PoolHolder:
    """``--driver`` factory: the prefill side's driver (the decode side's notifications are ``read`` deliveries)."""
    return PoolHolder()


def correct_reader() -> FabricReader:
    """``--driver`` factory: the correct reader, which notifies every prefill rank with the prefill's id."""
    return FabricReader()


def reads(reader: BlockReader) -> FabricReads:
    """``--driver reads=`` factory: the READs ``reader``'s requests own (``nixl_read``)."""
    return FabricReads(reader)


def seed_reader() -> FabricReader:
    """``--driver`` factory: seed 004's reader, which tells the skipped rank the decode-local id."""
    return FabricLocalIdReader()
