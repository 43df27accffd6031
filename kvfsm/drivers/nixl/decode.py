"""The decode side: one TP rank's READs of a request's blocks from the prefill ranks, and the notifications it owes.

:class:`BlockReader` is the driver of ``specs/nixl_decode.yaml`` and
:class:`ReadHandles` of ``specs/nixl_read.yaml``, the one READ per prefill
rank that a request owns; :class:`DecodeRank` owns a rank's blocks, agent and
the two trackers, and polls the READs once per step. A request's blocks stay
pinned until every one of its READs is DONE or broken: releasing a NIXL handle
does not cancel its READ (docs/nixl.md §6). Every id this side puts on the wire is the
prefill's request id (``remote_request_id``): the one place that chooses it
is :meth:`BlockReader.notif_id`, and every message is reported to the
driver's :class:`~kvfsm.engine.outbox.Outbox` with the id it really carries,
so one naming another space's id is caught where it leaves (the spec's
``outgoing: read: carries: remote_request_id``). Each block is byte-checked
after its READ when the blocks are kvfsm's own (:class:`~.blocks.KVBlocks`); vLLM's KV cache
(:class:`~.memory.CacheBlocks`) holds the model's bytes, so there the check is
that every READ ended ``DONE``.
"""

from __future__ import annotations

import base64
import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic

from ...engine import Tracker
from ...engine.outbox import Outbox
from ...engine.tracker import Observer
from ...errors import ActionError, Anomaly
from ...observe import drain_outcomes
from ...spec import Spec, load
from ...spec.bundled import SPECS
from ...spec.model import split_params
from ..dataplane import DataPlane, Extent, TransferError, XferState
from ..report import Finished, RecvReport, Report
from .blocks import M, own_blocks
from .memory import BlockLayout, BlockMemory, read_extents
from .notif import encode, parse
from .topology import Topology

REMOTE_ID = "remote_request_id"
"""The id space of the prefill side's request ids, as the decode spec links them at begin."""

NOTIFY = "read"
"""The spec's outgoing message to the prefill side: every READ's notification and every ``send_notif``."""


@cache
def decode_spec() -> Spec:
    """The bundled ``nixl_decode`` spec, loaded once."""
    return load(SPECS / "nixl_decode.yaml")


@cache
def read_spec() -> Spec:
    """The bundled ``nixl_read`` spec (one READ, owned by a ``nixl_decode`` request), loaded once."""
    return load(SPECS / "nixl_read.yaml")


@dataclass(frozen=True)
class PeerInfo:
    """What a handshake tells the decode side about one prefill rank: its agent and where its blocks are.

    ``base`` and ``block_bytes`` describe blocks one after the other in one
    tensor; ``layout``, when set, says where they really are (vLLM's
    per-layer cache: one part per layer).
    """

    engine_id: str
    rank: int
    agent: str
    metadata: bytes
    base: int
    block_bytes: int
    layout: BlockLayout | None = None

    @classmethod
    def of(cls, engine_id: str, rank: int, agent: DataPlane, layout: BlockLayout) -> PeerInfo:
        """A rank's entry in its engine's handshake: its agent's name and metadata, and its blocks' layout."""
        return cls(engine_id, rank, agent.name, agent.metadata(), layout.parts[0].base, layout.block_bytes, layout)

    @property
    def block_layout(self) -> BlockLayout:
        """Where block ``b``'s bytes are on the peer."""
        return self.layout if self.layout is not None else BlockLayout.contiguous(self.base, self.block_bytes)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine_id": self.engine_id, "rank": self.rank, "agent": self.agent,
            "metadata": base64.b64encode(self.metadata).decode(), "base": self.base, "block_bytes": self.block_bytes,
        }  # fmt: skip
        if self.layout is not None:
            out["layout"] = self.layout.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PeerInfo:
        """Parse a peer's entry (it came off the network): a missing or mistyped field is a ValueError naming it."""
        try:
            layout = data.get("layout")
            return cls(
                str(data["engine_id"]), int(data["rank"]), str(data["agent"]),
                base64.b64decode(data["metadata"], validate=True), int(data["base"]), int(data["block_bytes"]),
                None if layout is None else BlockLayout.from_json(layout),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a NIXL peer entry ({type(exc).__name__}: {exc})") from None


class BlockMismatch(RuntimeError):
    """A READ finished but the blocks do not hold the prefill's bytes for the request."""


@dataclass
class Load:
    """What a load reads: the prefill's request id and engine, the local blocks and the prefill's block ids."""

    remote_request_id: str
    engine_id: str
    blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


class BlockReader(RecvReport):
    """Actions of ``nixl_decode``: owe the report, pin the allocated blocks, notify, byte-check, release.

    ``_owed`` is the ``recv_report`` record (:meth:`owe_recv_report`; :meth:`report_recv`, or
    :meth:`report_loaded` on the checked edge) and ``_loads`` the ``dst_blocks`` one (taken by
    :meth:`pin_dst`, dropped by :meth:`unpin_dst`): each lives exactly as long as its resource. The READs
    are :class:`ReadHandles`' (``nixl_read``); :meth:`read_for` says what each one reads.
    """

    def __init__(self, rank: int, topology: Topology, agent: DataPlane, blocks: BlockMemory) -> None:
        self.rank = rank
        self.topology = topology
        self.agent = agent
        self.blocks = blocks
        self.pool = blocks.pool
        self.report = Report()
        self.peers: dict[tuple[str, int], PeerInfo] = {}
        self.stats: Counter[str] = Counter()
        self._owed: dict[Hashable, tuple[int, ...]] = {}
        self._loads: dict[Hashable, Load] = {}
        self.outbox = Outbox(decode_spec())
        """Every message this rank sends, checked against the space the spec says it carries (once bound)."""

    @staticmethod
    def holder(key: Hashable) -> tuple[str, Hashable]:
        return ("nixl_recv", key)

    # -- the ids on the wire ----------------------------------------------------------

    def notif_id(self, key: Hashable, load: Load) -> str:
        """The id a prefill rank knows the request by: always the prefill's, never ``key``."""
        return load.remote_request_id

    def notif(self, key: Hashable, load: Load) -> bytes:
        """The message each READ carries to the rank it reads."""
        return encode(self.notif_id(key, load), self.topology.decode_tp)

    def skipped_notif(self, key: Hashable, load: Load) -> bytes:
        """The message for the prefill ranks MLA lets this rank skip: the same id, sent by ``send_notif``."""
        return self.notif(key, load)

    def _outgoing(self, key: Hashable, message: bytes) -> bytes:
        """Report the id ``message`` carries on the wire (however it was chosen) to the outbox; returns it unchanged."""
        notif = parse(message)
        self.outbox.sent(key, NOTIFY, notif.request_id if notif is not None else message)
        return message

    # -- dst_blocks -----------------------------------------------------------------

    def pin_dst(
        self,
        key: Hashable,
        /,
        remote_request_id: str,
        remote_engine_id: str,
        block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
    ) -> None:
        if len(remote_block_ids) < len(block_ids):
            raise ValueError(
                f"request {key!r}: {len(block_ids)} local blocks for {len(remote_block_ids)} remote ones; "
                "a load reads the last len(block_ids) remote blocks (the rest is a local prefix hit)"
            )
        self.pool.pin(self.holder(key), block_ids)
        self._loads[key] = Load(remote_request_id, remote_engine_id, tuple(block_ids), tuple(remote_block_ids))

    def unpin_dst(self, key: Hashable, /) -> None:
        if self._loads.pop(key).blocks:
            self.pool.release(self.holder(key))

    # -- the READs (nixl_read) and the notifications -------------------------------

    def ranks_to_read(self, key: Hashable) -> tuple[int, ...]:
        """The prefill ranks ``key``'s load READs: one ``nixl_read`` each (none for a full prefix hit)."""
        if not self._loads[key].blocks:
            return ()
        return tuple(piece.prefill_rank for piece in self.topology.plan(self.rank).reads)

    def read_for(self, key: Hashable, rank: int) -> tuple[str, list[Extent], list[Extent], bytes]:
        """What ``key``'s READ from prefill ``rank`` posts: the peer agent, local and remote extents, and the
        notification it carries (reported to the outbox here, as it leaves)."""
        load = self._loads[key]
        pieces = [piece for piece in self.topology.plan(self.rank).reads if piece.prefill_rank == rank]
        if not pieces:
            raise ValueError(f"request {key!r}: decode rank {self.rank} reads nothing from prefill rank {rank}")
        piece = pieces[0]
        peer = self._peer(load.engine_id, rank)
        remote_blocks = load.remote_blocks[len(load.remote_blocks) - len(load.blocks) :]
        local, remote = read_extents(
            self.blocks.layout, load.blocks, piece.dst, peer.block_layout, remote_blocks, piece.src, piece.length
        )
        return peer.agent, local, remote, self._outgoing(key, self.notif(key, load))

    def notify_skipped(self, key: Hashable, /) -> None:
        """Tell the prefill ranks this load posts no READ to: those MLA lets it skip, and every rank it would
        read from when a full prefix hit reads nothing. A rank that cannot be told frees its copy at expiry."""
        load = self._loads[key]
        plan = self.topology.plan(self.rank)
        told = [] if load.blocks else [piece.prefill_rank for piece in plan.reads]
        for rank, message in [(r, self.notif(key, load)) for r in told] + [
            (r, self.skipped_notif(key, load)) for r in plan.notify_only
        ]:
            try:
                self.agent.send_notif(self._peer(load.engine_id, rank).agent, self._outgoing(key, message))
            except TransferError:
                self.stats["notify_failed"] += 1

    # -- the check --------------------------------------------------------------------

    def verify_blocks(self, key: Hashable, /) -> None:
        """Byte-check every block against the prefill's KV for the request; a mismatch fails the load.

        vLLM's cache holds the model's bytes, which nothing here can predict:
        every READ ended ``DONE`` (the only way to ``complete``) is the check.
        """
        load = self._loads[key]
        lo, _ = self.topology.range(self.rank, self.topology.decode_tp)
        first = len(load.remote_blocks) - len(load.blocks)
        wrong = self.blocks.wrong(load.blocks, load.remote_request_id, lo, first)
        if wrong:
            raise BlockMismatch(f"request {key!r}: blocks {wrong} do not hold {load.remote_request_id!r}'s KV")
        self.stats["blocks_read"] += len(load.blocks)
        if wrong is not None:
            self.stats["blocks_verified"] += len(load.blocks)

    def observe(self, key: Hashable) -> set[str]:
        held = set()
        if self.owes(key):
            held.add("recv_report")
        if key in self._loads:
            held.add("dst_blocks")
        return held

    def _peer(self, engine_id: str, rank: int) -> PeerInfo:
        peer = self.peers.get((engine_id, rank))
        if peer is None:
            raise TransferError("handshake", f"{engine_id}/{rank}", "no handshake with this prefill rank")
        return peer


class ReadHandles:
    """Actions of ``nixl_read``: post one READ (what it reads comes from the request's :class:`BlockReader`),
    release its handle once it has stopped. ``_handles`` is the ``handle`` record."""

    def __init__(self, reader: BlockReader) -> None:
        self.reader = reader
        self._handles: dict[Hashable, object] = {}

    def post_read(self, key: Hashable, /, request_id: Hashable, rank: int) -> None:
        peer, local, remote, message = self.reader.read_for(request_id, rank)
        self._handles[key] = self.reader.agent.post("READ", peer, local, remote, message)
        self.reader.stats["reads"] += 1
        self.reader.stats["descriptors"] += len(local)

    def release_read(self, key: Hashable, /) -> None:
        self.reader.agent.release(self._handles.pop(key))

    def state(self, key: Hashable) -> XferState:
        """``check_xfer_state`` of ``key``'s handle: ``ERR`` also when the peer is dead."""
        return self.reader.agent.state(self._handles[key])

    def observe(self, key: Hashable) -> set[str]:
        return {"handle"} if key in self._handles else set()


class DecodeRank(Generic[M]):
    """One decode TP rank: blocks registered with its agent, a tracker of loads, transfer handles polled per step."""

    def __init__(
        self,
        rank: int,
        topology: Topology,
        agent: DataPlane,
        num_blocks: int,
        *,
        params: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        reader: type[BlockReader] = BlockReader,
        handles: type[ReadHandles] = ReadHandles,
        observer: Observer | None = None,
        on_anomaly: Callable[[Anomaly], None] | None = None,
        blocks: M | None = None,
    ) -> None:
        """``observer`` and ``on_anomaly`` go to the tracker (a journal is both); a misaddressed message is an
        anomaly too. ``blocks`` is the memory READs land in (vLLM's cache, :class:`~.memory.CacheBlocks`);
        without it the rank owns ``num_blocks`` :class:`KVBlocks`."""
        self.rank = rank
        self.topology = topology
        self.agent = agent
        self.blocks: M = own_blocks(blocks, num_blocks, topology.block_bytes(topology.decode_tp))
        for tensor in self.blocks.tensors():
            agent.register(tensor)
        self.driver = reader(rank, topology, agent, self.blocks)
        spec, child = decode_spec(), read_spec()
        own, reads = split_params(params, spec, child)
        self.tracker = Tracker(spec, self.driver, params=own, clock=clock, observer=observer, on_anomaly=on_anomaly)
        self.handles = handles(self.driver)
        self.reads = Tracker(child, self.handles, params=reads, clock=clock, on_anomaly=on_anomaly, parent=self.tracker)
        """One ``nixl_read`` per READ, owned by its request: the request unpins only after its last READ stops."""
        self.driver.outbox.bind(self.tracker)
        self.outcomes: Counter[str] = Counter()
        self.read_outcomes: Counter[str] = Counter()
        """How the READs ended: ``done``, ``broken``."""
        self.errors: list[ActionError] = []

    def handshake(self, peers: Sequence[PeerInfo]) -> None:
        """Make the prefill ranks known (vLLM's ``add_remote_agent`` after the side-channel handshake); a rank
        already known under the same engine is replaced (its engine restarted)."""
        for peer in peers:
            self.agent.add_peer(peer.metadata)
            self.driver.peers[(peer.engine_id, peer.rank)] = peer

    def knows(self, engine_id: str) -> bool:
        """Whether a handshake with ``engine_id`` has made its ranks known."""
        return any(engine == engine_id for engine, _rank in self.driver.peers)

    def fail_load(
        self, request_id: str, remote_request_id: str, remote_engine_id: str, block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
    ) -> None:  # fmt: skip
        """A load that cannot start (no handshake with its prefill engine): it ends ``failed`` at once, and its
        blocks are reported invalid with the next finished_recving, as vLLM does after a failed handshake."""
        self._begin_then("fail", request_id, remote_request_id, remote_engine_id, block_ids, remote_block_ids)

    def start_load(
        self, request_id: str, remote_request_id: str, remote_engine_id: str, block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
    ) -> None:  # fmt: skip
        """vLLM's start_load_kv for one request: pin the blocks and post one READ per prefill rank it reads.

        A READ that cannot be posted fails the request, which waits in ``failing`` for those already posted."""
        self._begin_then("read", request_id, remote_request_id, remote_engine_id, block_ids, remote_block_ids)

    def _begin_then(
        self, event: str, request_id: str, remote_request_id: str, remote_engine_id: str, block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
    ) -> None:  # fmt: skip
        """Begin the load, then fire ``event``; not if a pin refused (more local blocks than remote ones, unusable
        ids): nothing is held, and undoing ``recv_report`` reported the load with every block invalid."""
        try:
            self.tracker.begin(
                request_id,
                remote_request_id=remote_request_id,
                remote_engine_id=remote_engine_id,
                block_ids=list(block_ids),
                remote_block_ids=list(remote_block_ids),
            )  # fmt: skip (the spec links remote_request_id at begin)
        except ActionError as exc:
            self.errors.append(exc)
            return
        if event == "read":
            for rank in self.driver.ranks_to_read(request_id):
                try:
                    self.reads.begin((request_id, rank), request_id=request_id, rank=rank)
                except ActionError as exc:  # not posted: nothing held for it; the request gives up
                    self.errors.append(exc)
                    event = "fail"
                    break
        self._fire(request_id, event)

    def abort(self, request_id: str) -> None:
        self._fire(request_id, "abort")

    def step(self, now: float | None = None) -> Finished:
        """Once per scheduler step: end the READs that are DONE or broken (one batch each; their requests hear
        of it from the engine), fire due deadlines, drain the report."""
        ended: dict[str, list[Hashable]] = {"DONE": [], "ERR": []}
        for key, state in self.reads.snapshot():
            if state == "in_flight":
                answer = self.handles.state(key)
                if answer != "PROC":
                    ended[answer].append(key)
        for answer, event in (("DONE", "done"), ("ERR", "broken")):
            if ended[answer]:
                try:
                    self.reads.fire_many(event, ended[answer])
                except ActionError as exc:  # each key is already in a defined state; keep the story
                    self.errors.append(exc)
        self.tracker.poll(now)
        drain_outcomes(self.reads, self.read_outcomes)
        drain_outcomes(self.tracker, self.outcomes)
        return self.driver.report.take()

    def reading(self) -> list[Hashable]:
        """Requests with a READ in flight (reading, or giving up and waiting for it to stop)."""
        return [key for key, _state in self.tracker.snapshot() if self.tracker.owned(key)]

    def leaked(self) -> dict[Hashable, tuple[int, ...]]:
        """Holders of blocks other than the scheduler's own allocations: empty unless the connector leaked."""
        return {h: b for h, b in self.blocks.pool.holdings().items() if isinstance(h, tuple)}

    def _fire(self, key: Hashable, event: str) -> None:
        try:
            self.tracker.fire(key, event)
        except ActionError as exc:  # the instance is already in a defined state (failed); keep the story
            self.errors.append(exc)
