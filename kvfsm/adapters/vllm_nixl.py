"""kvfsm's NIXL P/D connector as a real ``KVConnectorBase_V1``, shaped like vLLM's ``NixlConnector``, on :mod:`kvfsm.drivers.nixl`.

Configure vLLM with::

    KVTransferConfig(kv_connector="NixlConnector", kv_connector_module_path="kvfsm.adapters.vllm_nixl",
                     kv_role="kv_producer",            # the prefill engine; the decode engine: kv_consumer
                     engine_id="prefill-0",
                     kv_connector_extra_config={"fabric": "nixl", "side_channel_port": 5600})

As in vLLM, a prefill request carries ``kv_transfer_params={"do_remote_decode":
True}``; its ``request_finished`` keeps the blocks (``delay_free``) and
returns the params the decode request is given (``do_remote_prefill``,
``remote_request_id`` = the prefill's own id, ``remote_engine_id``,
``remote_block_ids``, and where the prefill's side channel is:
``remote_host``, ``remote_port``, ``remote_incarnation``). The decode
scheduler answers ``get_num_new_matched_tokens`` with the whole prompt,
loaded asynchronously; its worker READs the blocks from the prefill ranks
and notifies each with ``remote_request_id``.

**The blocks are vLLM's KV cache.** ``register_kv_caches`` hands each worker
vLLM's per-layer tensors; they are adopted as they are
(:meth:`~kvfsm.drivers.kv_cache.KVCache.of_layers`, by vLLM's placements) and registered with the
rank's NIXL agent, and a READ has one descriptor per (layer, block): it lands
where the decode engine's attention reads. (``kv_cache: "own"`` gives each
rank a tensor of its own instead, with a byte pattern the decode side checks:
for vLLM's Scheduler driven by a test, with no model.)

**The handshake crosses processes** as vLLM's does: each prefill worker's
``get_handshake_metadata`` (its agent's metadata and where its blocks are)
reaches the scheduler's ``set_xfer_handshake_metadata`` through vLLM's engine
core, which serves them all on a pyzmq side channel
(:mod:`kvfsm.drivers.nixl.side_channel`, ``side_channel_host`` /
``side_channel_port``, port 0 picks a free one); a decode worker asks the
``remote_host``/``remote_port`` a request names, once per prefill engine
start (``remote_incarnation``), with ``handshake_timeout``.

Each WORKER role is one TP rank (``tp_rank`` in the extra config, else
vLLM's tensor-parallel rank): a :class:`~kvfsm.drivers.nixl.PrefillRank`
(``nixl_prefill.yaml``) and/or a :class:`~kvfsm.drivers.nixl.DecodeRank`
(``nixl_decode.yaml``) by ``kv_role``; which call fires which event on which
rank is the table in docs/nixl.md §3. The transport is real NIXL agents, UCX
over DRAM (``fabric: "nixl"``, needs ``kvfsm[nixl]``), or the in-process
embedded fabric (``fabric: "embedded:<name>"``: every engine in one process).

**A notification may come before the hold.** A prefill worker takes the
decode side's notifications in ``get_finished``, apart from the step whose
``start_load_kv`` hands it ``request_finished``'s blocks, so a quick decode
can notify a rank that holds nothing for the request yet. Every notification
goes to the rank's tracker with its sender; ``nixl_prefill`` declares ``read``
early, so such a one is kept and applied at the hold, which then frees the
blocks at once. ``early_within`` in the extra config (seconds; the spec says 5)
bounds the wait: past it the notification is an ``early`` anomaly and the
blocks wait for ``abort_timeout``.
"""

from __future__ import annotations

import importlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..drivers.dataplane import DataPlane, TransferError
from ..drivers.kv_cache import KVLayout
from ..drivers.nixl import BlockReader, DecodeRank, Fabric, PeerInfo, PrefillRank, Topology, decode_spec
from ..drivers.nixl.memory import BlockMemory, CacheBlocks, segments
from ..drivers.nixl.side_channel import Handshake, HandshakeError, SideChannel, fetch, new_incarnation
from ..harness.faults import FaultyAgent
from ..harness.nixl import FAULTS, faulty
from .vllm_async import VLLM as VLLM
from .vllm_kv_cache import adopt_layers
from .vllm_pd import PDConnector, handshakes, held_for_decode, tp_rank
from .vllm_settings import check_keys, seconds

log = logging.getLogger(__name__)

EMBEDDED = "embedded:"
REAL = "nixl"
PREFILL_PARAMS = ("abort_timeout", "early_within")
"""``nixl_prefill``'s params a prefill rank takes from the extra config: the expiry, and how long a notification
that came before its request's hold waits for it."""
DECODE_PARAMS = ("read_timeout",)
"""``nixl_decode``'s params a decode rank takes from the extra config."""
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_port")
"""What a decode request's kv_transfer_params must carry (what the prefill's request_finished returned)."""

_FABRICS: dict[str, Fabric] = {}


def embedded_fabric(name: str) -> Fabric:
    """The embedded fabric called ``name`` (the ``fabric`` setting), made on first use: every engine on it is in
    this process."""
    return _FABRICS.setdefault(name, Fabric())


def forget_fabric(name: str) -> None:
    """Drop an embedded fabric, so a later engine of the same name starts on an empty one."""
    _FABRICS.pop(name, None)


@dataclass(frozen=True)
class Inject:
    """Faults injected in front of a decode rank's agent (``inject`` in the extra config): for fault tests."""

    rate: float
    faults: tuple[str, ...] = FAULTS
    seed: int = 0


@dataclass(frozen=True)
class NixlSettings:
    """``kv_connector_extra_config``: the fabric, the topology, the KV memory, this worker's rank, the deadlines,
    the side channel, the reader, injected faults."""

    fabric: str
    topology: Topology
    tp_rank: int | None = None
    params: Mapping[str, float] = field(default_factory=dict)
    reader: type[BlockReader] = BlockReader
    kv_cache: str = "vllm"
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    handshake_timeout: float = 5.0
    inject: Inject | None = None

    KNOWN: ClassVar[frozenset[str]] = frozenset(
        {"fabric", "prefill_tp", "decode_tp", "mla", "kv_bytes", "tp_rank", "abort_timeout", "early_within",
         "read_timeout", "reader", "kv_cache", "side_channel_host", "side_channel_port", "handshake_timeout", "inject"}
    )  # fmt: skip

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> NixlSettings:
        check_keys(extra, cls.KNOWN, "NixlConnector")
        fabric = str(extra.get("fabric", ""))
        if not (
            fabric == REAL or fabric.startswith(REAL + ":") or (fabric.startswith(EMBEDDED) and fabric != EMBEDDED)
        ):
            raise ValueError(
                f"NixlConnector needs kv_connector_extra_config 'fabric': 'nixl' (real NIXL agents) or "
                f"'embedded:<name>' (kvfsm's in-process NIXL stand-in, every engine in this process); not {fabric!r}"
            )
        kv_cache = str(extra.get("kv_cache", "vllm"))
        if kv_cache not in ("vllm", "own"):
            raise ValueError(
                f"kv_connector_extra_config 'kv_cache' is 'vllm' (vLLM's KV cache) or 'own', not {kv_cache!r}"
            )
        topology = Topology(
            prefill_tp=int(extra.get("prefill_tp", 1)),
            decode_tp=int(extra.get("decode_tp", 1)),
            mla=bool(extra.get("mla", False)),
            kv_bytes=int(extra.get("kv_bytes", 4096)),
        )
        params = seconds(extra, PREFILL_PARAMS + DECODE_PARAMS)
        rank = int(extra["tp_rank"]) if "tp_rank" in extra else None
        return cls(
            fabric, topology, rank, params, _reader(str(extra.get("reader", ""))), kv_cache,
            str(extra.get("side_channel_host", "127.0.0.1")), int(extra.get("side_channel_port", 0)),
            float(extra.get("handshake_timeout", 5.0)), _inject(extra.get("inject")),
        )  # fmt: skip

    @property
    def read_timeout(self) -> float:
        return float(self.params.get("read_timeout", decode_spec().params["read_timeout"]))


def _reader(ref: str) -> type[BlockReader]:
    """The decode driver class ``MODULE:CLASS`` names (default: the correct :class:`BlockReader`)."""
    if not ref:
        return BlockReader
    module, _, name = ref.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"kv_connector_extra_config 'reader': cannot load {ref!r} (MODULE:CLASS): {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, BlockReader)):
        raise ValueError(f"kv_connector_extra_config 'reader': {ref!r} is not a BlockReader subclass")
    return cls


def _inject(spec: Any) -> Inject | None:
    if spec is None:
        return None
    if not isinstance(spec, Mapping) or "rate" not in spec or set(spec) - {"rate", "faults", "seed"}:
        raise ValueError(
            f"kv_connector_extra_config 'inject' is {{'rate': R, 'faults': [...], 'seed': N}}, not {spec!r}"
        )
    faults = tuple(spec.get("faults", FAULTS))
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config 'inject': unknown faults {sorted(unknown)}; choose from {FAULTS}")
    return Inject(float(spec["rate"]), faults, int(spec.get("seed", 0)))


@dataclass(frozen=True)
class LoadOrder:
    """Decode: READ the prefill's ``remote_block_ids`` of ``remote_request_id`` into ``block_ids``."""

    request_id: str
    block_ids: list[int]
    remote_request_id: str
    remote_engine_id: str
    remote_block_ids: list[int]
    remote_host: str = ""
    remote_port: int = 0
    remote_incarnation: str = ""
    """Which start of the prefill engine computed the blocks (a handshake with another start is stale)."""


@dataclass(frozen=True)
class HoldOrder:
    """Prefill: hold a finished request's blocks for the decode side's READ (vLLM keeps them until finished_sending)."""

    request_id: str
    block_ids: list[int]


@dataclass
class NixlMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler to worker, once per step."""

    loads: list[LoadOrder] = field(default_factory=list)
    holds: list[HoldOrder] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    """Requests vLLM finished since the last step: a READ still running for one is aborted."""


@dataclass
class NixlHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """One prefill worker rank's handshake entry, from ``get_handshake_metadata`` to the scheduler's side channel."""

    peer: PeerInfo


class NixlConnector(PDConnector[PrefillRank[BlockMemory], DecodeRank[BlockMemory]]):
    """P/D over NIXL READs: the scheduler plans and serves the handshake, each worker rank's Trackers hold, read,
    notify and report."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = NixlSettings.parse(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = int(vllm_config.cache_config.block_size)
        self.clock: Callable[[], float] = time.monotonic
        """What the ranks' deadlines read; a test may set it before the first request."""
        # scheduler side: this step's plan, and the side channel the prefill ranks are found on
        self._meta = NixlMetadata()
        self.side_channel: SideChannel | None = None
        # worker side
        self._known: dict[str, str] = {}
        """Prefill engines this decode rank has shaken hands with, and the incarnation it met."""
        self._refused: dict[tuple[str, str, int, str], float] = {}
        """Handshakes that failed, and when: not retried for ``read_timeout``, so a dead prefill costs one wait."""
        self.handshakes: Counter[str] = Counter()
        """``done`` and ``failed`` handshakes, ``skipped`` loads failed at once by an earlier failure."""
        if role == KVConnectorRole.WORKER:
            self.num_blocks = int(kv_cache_config.num_blocks)
            if self.settings.kv_cache == "own":
                self._make_ranks(None)

    # -- the ranks --------------------------------------------------------------------

    def _agent(self, name: str) -> DataPlane:
        """A real NIXL agent (a name unique to this start) or one on the embedded fabric."""
        if self.settings.fabric.startswith(EMBEDDED):
            return embedded_fabric(self.settings.fabric).agent(name)
        from ..drivers.nixl.agent import NixlAgent

        return NixlAgent(f"{name}/{uuid.uuid4().hex[:8]}")

    def _make_ranks(self, memory: CacheBlocks | None) -> None:
        """This worker's ranks, over vLLM's cache (``memory``) or, without it, over blocks of their own."""
        s = self.settings
        rank = tp_rank(s.tp_rank)
        topology = s.topology if memory is None else _topology_of(s.topology, memory.block_bytes)
        if self.kv_role in ("kv_producer", "kv_both"):
            agent = self._agent(f"{self.engine_id}/prefill-{rank}")
            params = {k: v for k, v in s.params.items() if k in PREFILL_PARAMS}
            self.prefill = PrefillRank(
                rank, topology, agent, self.num_blocks, params=params, clock=self._now, blocks=memory
            )
            self.prefill.blocks.pool.allocate(VLLM, self.num_blocks)
        if self.kv_role in ("kv_consumer", "kv_both"):
            agent = self._agent(f"{self.engine_id}/decode-{rank}")
            if s.inject is not None:
                agent = faulty(agent, s.inject.rate, s.inject.seed, s.inject.faults)
            params = {k: v for k, v in s.params.items() if k in DECODE_PARAMS}
            self.decode = DecodeRank(
                rank, topology, agent, self.num_blocks, params=params, clock=self._now, reader=s.reader, blocks=memory
            )
            if self.prefill is None or self.prefill.blocks is not self.decode.blocks:
                self.decode.blocks.pool.allocate(VLLM, self.num_blocks)

    def _now(self) -> float:
        return self.clock()

    # -- scheduler side -------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, Any]) -> None:
        """vLLM's engine core hands over every worker's :meth:`get_handshake_metadata`: serve them on the side
        channel, where a decode worker finds them by the ``remote_host``/``remote_port`` of a request."""
        peers = [meta.peer for _, meta in handshakes(metadata, NixlHandshakeMetadata)]
        if not peers:
            return  # a decode-only engine: nothing to serve
        handshake = Handshake(self.engine_id, new_incarnation(), tuple(peers))
        handshake.ranks(self.engine_id, self.settings.topology.prefill_tp)  # every rank, or a clear error now
        if self.side_channel is not None:
            self.side_channel.close()
        s = self.settings
        self.side_channel = SideChannel(handshake, host=s.side_channel_host, port=s.side_channel_port)
        log.info("NixlConnector %s: side channel on %s", self.engine_id, self.side_channel.endpoint)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Queue the READ of the prefill's blocks into the request's new ones (once: do_remote_prefill is cleared)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        missing = [k for k in REMOTE_KEYS if params.get(k) is None]
        if missing:
            raise ValueError(
                f"request {request.request_id!r}: kv_transfer_params lack {missing}; a decode request needs the "
                "params the prefill's request_finished returned"
            )
        local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        self._meta.loads.append(
            LoadOrder(
                request.request_id, local, str(params["remote_request_id"]), str(params["remote_engine_id"]),
                [int(b) for b in params["remote_block_ids"]], str(params["remote_host"]), int(params["remote_port"]),
                str(params.get("remote_incarnation", "")),
            )
        )  # fmt: skip
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> NixlMetadata:
        meta, self._meta = self._meta, NixlMetadata()
        meta.finished = set(scheduler_output.finished_req_ids)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill request with ``do_remote_decode`` that ran to its length: keep its blocks for the READ."""
        if not held_for_decode(request) or not block_ids:
            return False, None
        channel = self.side_channel
        if channel is None:
            raise RuntimeError(
                f"NixlConnector of engine {self.engine_id!r} ({self.kv_role}) has no side channel: vLLM never called "
                "set_xfer_handshake_metadata with its workers' handshakes, so no decode engine could find its blocks"
            )
        self._meta.holds.append(HoldOrder(request.request_id, list(block_ids)))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": channel.host,
            "remote_port": channel.port,
            "remote_incarnation": channel.handshake.incarnation,
            "tp_size": self.settings.topology.prefill_tp,
        }

    def shutdown(self) -> None:
        self._close_ranks()
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer KV cache (what vLLM 0.32 and 0.33 register) and register it with the ranks' agents:
        the decode side READs straight into the blocks the model attends over."""
        if self.settings.kv_cache == "own":
            raise ValueError(
                "NixlConnector has kv_cache 'own' (blocks of its own, for a scheduler without a model), but vLLM "
                "registered its KV cache: drop 'kv_cache' from kv_connector_extra_config to transfer vLLM's blocks"
            )
        if self.prefill is not None or self.decode is not None:
            raise RuntimeError("register_kv_caches called twice: the ranks already registered vLLM's cache")
        config = self._kv_cache_config
        self._make_ranks(CacheBlocks(adopt_layers(kv_caches, config, _layout_of(config))))

    def get_handshake_metadata(self) -> NixlHandshakeMetadata | None:
        """This rank's entry of its engine's handshake (prefill roles): its agent and where its blocks are."""
        if self.prefill is None:
            return None
        return NixlHandshakeMetadata(
            PeerInfo.of(self.engine_id, self.prefill.rank, self.prefill.agent, self.prefill.blocks.layout)
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """This step's aborts, holds and READs, in that order."""
        meta = self._step_metadata(NixlMetadata)
        self._require_ranks()
        if self.decode is not None:
            for rid in sorted(meta.finished):
                if self.decode.tracker.accepts(rid, "abort"):  # vLLM finished it while its load is live:
                    self.decode.abort(rid)  # the load reports its blocks invalid
        if self.prefill is not None:
            for hold in meta.holds:
                self.prefill.hold(hold.request_id, hold.block_ids)
        for load in meta.loads:
            self._load(load)

    def _require_ranks(self) -> None:
        if self.prefill is None and self.decode is None:
            raise RuntimeError(
                f"NixlConnector of engine {self.engine_id!r} has no blocks: vLLM has not called register_kv_caches "
                "(kv_cache 'own' gives a scheduler without a model blocks of its own)"
            )

    def _load(self, load: LoadOrder) -> None:
        decode = self.decode
        if decode is None:
            raise RuntimeError(f"NixlConnector of engine {self.engine_id!r} is {self.kv_role}: it cannot load")
        try:
            self._handshake(decode, load)
        except HandshakeError as exc:  # vLLM: a failed handshake reports the request done with its blocks invalid
            log.warning("NixlConnector %s: request %s cannot load: %s", self.engine_id, load.request_id, exc)
            decode.fail_load(
                load.request_id, load.remote_request_id, load.remote_engine_id, load.block_ids, load.remote_block_ids
            )
            return
        decode.start_load(
            load.request_id, load.remote_request_id, load.remote_engine_id, load.block_ids, load.remote_block_ids
        )

    def _handshake(self, decode: DecodeRank[BlockMemory], load: LoadOrder) -> None:
        """Know ``load``'s prefill engine, in the start that computed its blocks: ask its side channel once."""
        engine = load.remote_engine_id
        met = self._known.get(engine)
        if met is not None and (not load.remote_incarnation or met == load.remote_incarnation):
            return
        key = (engine, load.remote_host, load.remote_port, load.remote_incarnation)
        now = self._now()
        refused = self._refused.get(key)
        if refused is not None and now - refused < self.settings.read_timeout:
            self.handshakes["skipped"] += 1
            raise HandshakeError(f"the handshake with {engine!r} failed {now - refused:.1f} s ago; not retried yet")
        try:
            answer = fetch(load.remote_host, load.remote_port, timeout=self.settings.handshake_timeout)
            if load.remote_incarnation and answer.incarnation != load.remote_incarnation:
                raise HandshakeError(
                    f"{engine!r} at {load.remote_host}:{load.remote_port} is incarnation {answer.incarnation!r}, but "
                    f"the request was prefilled by {load.remote_incarnation!r}: that start of the engine is gone"
                )
            peers = answer.ranks(engine, decode.topology.prefill_tp)
            self._check_layouts(decode, peers)
            decode.handshake(peers)
        except (HandshakeError, ValueError, TransferError) as exc:
            self._refused[key] = now
            self.handshakes["failed"] += 1
            raise HandshakeError(str(exc)) from exc
        self._known[engine] = answer.incarnation
        self.handshakes["done"] += 1

    @staticmethod
    def _check_layouts(decode: DecodeRank[BlockMemory], peers: Sequence[PeerInfo]) -> None:
        """Every READ the plan makes fits both sides' blocks (ValueError otherwise: the engines run different models)."""
        ranks = {p.rank: p for p in peers}
        for piece in decode.topology.plan(decode.rank).reads:
            segments(decode.blocks.layout, piece.dst, ranks[piece.prefill_rank].block_layout, piece.src, piece.length)

    # -- what it did ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters of this half: the side channel (scheduler), or each rank's outcomes and transfers (worker)."""
        out: dict[str, Any] = {"engine_id": self.engine_id, "kv_role": self.kv_role}
        if self.side_channel is not None:
            channel = self.side_channel
            out["side_channel"] = {
                "endpoint": channel.endpoint, "served": channel.stats.served, "refused": dict(channel.stats.refused),
                "incarnation": channel.handshake.incarnation,
            }  # fmt: skip
        if self.prefill is not None:
            p = self.prefill
            out["prefill"] = {
                "live": p.tracker.live(), "outcomes": dict(p.outcomes), "counts": dict(p.stats()),
                "anomalies": dict(p.anomalies), "held_blocks": _held(p.blocks.pool.holdings()),
            }  # fmt: skip
        if self.decode is not None:
            d = self.decode
            injected = d.agent.injected if isinstance(d.agent, FaultyAgent) else Counter()
            out["decode"] = {
                "live": d.tracker.live(), "outcomes": dict(d.outcomes), "transfers": dict(d.driver.stats),
                "handshakes": dict(self.handshakes), "action_errors": len(d.errors), "injected": dict(injected),
                "held_blocks": _held(d.blocks.pool.holdings()),
            }  # fmt: skip
        return out


def _held(holdings: Mapping[Hashable, tuple[int, ...]]) -> int:
    """Blocks the connector holds on top of vLLM's own allocation."""
    return sum(len(blocks) for holder, blocks in holdings.items() if holder != VLLM)


def _layout_of(kv_cache_config: Any) -> KVLayout:
    """The KV block layout of vLLM's ``KVCacheConfig`` (one full-attention group: K and V of each layer)."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            f"NixlConnector serves one KV-cache group, this model has {len(groups)}; run vLLM with "
            "disable_hybrid_kv_cache_manager=True or a model with one attention type"
        )
    spec = groups[0].kv_cache_spec
    return KVLayout(2 * len(groups[0].layer_names), spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype)


def _topology_of(configured: Topology, block_bytes: int) -> Topology:
    """The configured topology with the block size vLLM's cache really has (one rank's share of every head)."""
    if not configured.mla and configured.prefill_tp != configured.decode_tp:
        raise ValueError(
            f"prefill TP {configured.prefill_tp} and decode TP {configured.decode_tp} without MLA need READs of a "
            "slice of the heads of each layer; NixlConnector reads whole blocks of vLLM's cache (equal TP, or MLA)"
        )
    tp = 1 if configured.mla else configured.prefill_tp
    return replace(configured, kv_bytes=block_bytes * tp)
