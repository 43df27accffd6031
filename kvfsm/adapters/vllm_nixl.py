"""kvfsm's NIXL P/D connector as a real ``KVConnectorBase_V1``, shaped like vLLM's ``NixlConnector``, on :mod:`kvfsm.drivers.nixl`.

Configure vLLM with::

    KVTransferConfig(kv_connector="NixlConnector", kv_connector_module_path="kvfsm.adapters.vllm_nixl",
                     kv_role="kv_producer",            # or kv_consumer / kv_both
                     engine_id="prefill-0",
                     kv_connector_extra_config={"fabric": "embedded:pd", "prefill_tp": 2, "decode_tp": 1,
                                                "mla": True, "kv_bytes": 4096})

As in vLLM, a prefill request carries ``kv_transfer_params={"do_remote_decode":
True}``; its ``request_finished`` keeps the blocks (``delay_free``) and
returns the params the decode request is given (``do_remote_prefill``,
``remote_request_id`` = the prefill's own id, ``remote_engine_id``,
``remote_block_ids``). The decode scheduler answers ``get_num_new_matched_tokens``
with the whole prompt, loaded asynchronously; its worker READs the blocks
from the prefill ranks and notifies each with ``remote_request_id``.

Each WORKER role is one TP rank (``tp_rank`` in the extra config, else
vLLM's tensor-parallel rank): a :class:`~kvfsm.drivers.nixl.PrefillRank`
(``nixl_prefill.yaml``) and/or a :class:`~kvfsm.drivers.nixl.DecodeRank`
(``nixl_decode.yaml``) by ``kv_role``; which call fires which event on which
rank is the table in docs/nixl.md §3. vLLM's batched calls drive the
trackers in batches: a step's notifications go to ``deliver_many`` and its
finished READs to ``fire_many``.

The transport is the embedded fabric (``fabric: "embedded:<name>"``) or real
NIXL agents, UCX over DRAM (``fabric: "nixl:<name>"``, needs ``kvfsm[nixl]``);
either way every engine runs in one process, and the handshake is a
directory of prefill ranks by engine, standing in for vLLM's ZMQ side
channel. The rank's KV blocks are its own registered tensor, the stand-in for
vLLM's KV cache (a real deployment registers ``register_kv_caches``'
tensors instead, which this connector does not do yet).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..drivers.nixl import BlockReader, DecodeRank, Fabric, PeerInfo, PrefillRank, Topology
from ..drivers.nixl.transport import Transport
from .vllm_api import RequestStatus

VLLM = "vllm"
"""The ranks' pool holder of every block: vLLM's allocator owns them; the connector's holds sit on top."""

EMBEDDED = "embedded:"
REAL = "nixl:"
REMOTE_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids")
"""What a decode request's kv_transfer_params must carry (vLLM's connector also needs host and port)."""


@dataclass
class Directory:
    """The prefill ranks of each engine, and the embedded fabric if agents are not real: the handshake vLLM does
    over its side channel."""

    fabric: Fabric = field(default_factory=Fabric)
    peers: dict[str, dict[int, PeerInfo]] = field(default_factory=dict)

    REGISTRY: ClassVar[dict[str, Directory]] = {}

    @classmethod
    def named(cls, name: str) -> Directory:
        """The directory called ``name`` (the ``fabric`` setting), made on first use."""
        return cls.REGISTRY.setdefault(name, cls())

    @classmethod
    def forget(cls, name: str) -> None:
        """Drop a directory, so a later engine of the same name starts on an empty fabric."""
        cls.REGISTRY.pop(name, None)

    def handshake(self, engine_id: str) -> list[PeerInfo]:
        """Every prefill rank of ``engine_id`` (empty: that engine is unknown here)."""
        return list(self.peers.get(engine_id, {}).values())


@dataclass(frozen=True)
class NixlSettings:
    """``kv_connector_extra_config``: the fabric, the topology, this worker's rank, the deadlines, the reader."""

    fabric: str
    topology: Topology
    tp_rank: int | None = None
    params: Mapping[str, float] = field(default_factory=dict)
    reader: type[BlockReader] = BlockReader

    KNOWN: ClassVar[frozenset[str]] = frozenset(
        {"fabric", "prefill_tp", "decode_tp", "mla", "kv_bytes", "tp_rank", "abort_timeout", "read_timeout", "reader"}
    )

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> NixlSettings:
        unknown = sorted(set(extra) - cls.KNOWN)
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config has {unknown}, which NixlConnector does not read; it reads {sorted(cls.KNOWN)}"
            )
        fabric = str(extra.get("fabric", ""))
        if not any(fabric.startswith(kind) and fabric != kind for kind in (EMBEDDED, REAL)):
            raise ValueError(
                f"NixlConnector needs kv_connector_extra_config 'fabric': 'embedded:<name>' (kvfsm's in-process "
                f"NIXL stand-in) or 'nixl:<name>' (real NIXL agents), every engine in this process; not {fabric!r}"
            )
        topology = Topology(
            prefill_tp=int(extra.get("prefill_tp", 1)),
            decode_tp=int(extra.get("decode_tp", 1)),
            mla=bool(extra.get("mla", False)),
            kv_bytes=int(extra.get("kv_bytes", 4096)),
        )
        params = {k: float(extra[k]) for k in ("abort_timeout", "read_timeout") if k in extra}
        rank = int(extra["tp_rank"]) if "tp_rank" in extra else None
        return cls(fabric, topology, rank, params, _reader(str(extra.get("reader", ""))))


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


@dataclass(frozen=True)
class LoadOrder:
    """Decode: READ the prefill's ``remote_block_ids`` of ``remote_request_id`` into ``block_ids``."""

    request_id: str
    block_ids: list[int]
    remote_request_id: str
    remote_engine_id: str
    remote_block_ids: list[int]


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


class NixlConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """P/D over NIXL READs: the scheduler plans, each worker rank's Trackers hold, read, notify and report."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        config = self._kv_transfer_config
        self.settings = NixlSettings.parse(config.kv_connector_extra_config or {})
        self.engine_id = str(config.engine_id)
        self.kv_role = str(config.kv_role)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.directory = Directory.named(self.settings.fabric)
        self.clock: Callable[[], float] = time.monotonic
        """What the ranks' deadlines read; a test may set it before the first request."""
        # scheduler side: this step's plan
        self._meta = NixlMetadata()
        # worker side
        self.prefill: PrefillRank | None = None
        self.decode: DecodeRank | None = None
        self._invalid: set[int] = set()
        if role == KVConnectorRole.WORKER:
            self._make_ranks(int(kv_cache_config.num_blocks))

    def _agent(self, name: str) -> Transport:
        """A real NIXL agent (``nixl:`` fabrics) or one on the directory's embedded fabric."""
        if self.settings.fabric.startswith(REAL):
            from ..drivers.nixl.agent import NixlAgent

            return NixlAgent(name)
        return self.directory.fabric.agent(name)

    def _make_ranks(self, num_blocks: int) -> None:
        s = self.settings
        rank = s.tp_rank if s.tp_rank is not None else _tp_rank()
        params = dict(s.params)
        if self.kv_role in ("kv_producer", "kv_both"):
            prefill_params = {k: v for k, v in params.items() if k == "abort_timeout"}
            agent = self._agent(f"{self.engine_id}/prefill-{rank}")
            self.prefill = PrefillRank(rank, s.topology, agent, num_blocks, params=prefill_params, clock=self._now)
            self.prefill.blocks.pool.allocate(VLLM, num_blocks)
            b = self.prefill.blocks
            self.directory.peers.setdefault(self.engine_id, {})[rank] = PeerInfo(
                self.engine_id, rank, agent.name, agent.metadata(), b.base, b.block_bytes
            )
        if self.kv_role in ("kv_consumer", "kv_both"):
            decode_params = {k: v for k, v in params.items() if k == "read_timeout"}
            agent = self._agent(f"{self.engine_id}/decode-{rank}")
            self.decode = DecodeRank(
                rank, s.topology, agent, num_blocks, params=decode_params, clock=self._now, reader=s.reader
            )
            self.decode.blocks.pool.allocate(VLLM, num_blocks)

    def _now(self) -> float:
        return self.clock()

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """With ``do_remote_prefill``: every prompt token not computed locally, loaded asynchronously."""
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

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
                [int(b) for b in params["remote_block_ids"]],
            )
        )  # fmt: skip
        params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> NixlMetadata:
        meta, self._meta = self._meta, NixlMetadata()
        meta.finished = set(scheduler_output.finished_req_ids)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill request with ``do_remote_decode`` that ran to its length: keep its blocks for the READ."""
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None
        if not block_ids:
            return False, None
        self._meta.holds.append(HoldOrder(request.request_id, list(block_ids)))
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "tp_size": self.settings.topology.prefill_tp,
        }

    def shutdown(self) -> None:
        for rank in (self.prefill, self.decode):
            if rank is not None:
                rank.tracker.close()

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Nothing: each rank registers its own block tensor with its agent (see the module docstring)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """This step's aborts, holds and READs, in that order."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, NixlMetadata):
            raise TypeError(f"expected NixlMetadata, got {type(meta).__name__}")
        if self.decode is not None:
            for rid in sorted(meta.finished):
                if self.decode.tracker.state(rid) is not None and rid in self.decode.driver.reading():
                    self.decode.abort(rid)  # vLLM aborted it mid-read: the load reports its blocks invalid
        if self.prefill is not None:
            for hold in meta.holds:
                self.prefill.hold(hold.request_id, hold.block_ids)
        for load in meta.loads:
            self._load(load)

    def _load(self, load: LoadOrder) -> None:
        decode = self.decode
        if decode is None:
            raise RuntimeError(f"NixlConnector of engine {self.engine_id!r} is {self.kv_role}: it cannot load")
        if not any(engine == load.remote_engine_id for engine, _rank in decode.driver.peers):
            peers = self.directory.handshake(load.remote_engine_id)
            if not peers:  # vLLM: a failed handshake reports the request done with its blocks invalid
                decode.driver.report.recv(load.request_id, load.block_ids)
                return
            decode.handshake(peers)
        decode.start_load(
            load.request_id, load.remote_request_id, load.remote_engine_id, load.block_ids, load.remote_block_ids
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing per layer: a request runs only after its whole READ is reported."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: the decode side pulls the finished request's blocks."""

    def wait_for_save(self) -> None:
        """Nothing to wait for: vLLM keeps a held request's blocks until finished_sending."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """One step of each rank: notifications and expiries (finished_sending), READs polled (finished_recving)."""
        sending: set[Hashable] = set()
        recving: set[Hashable] = set()
        if self.prefill is not None:
            sending = self.prefill.step().sending
        if self.decode is not None:
            done = self.decode.step()
            recving = done.recving
            self._invalid |= done.invalid_blocks
        return _ids(sending), _ids(recving)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid


def _tp_rank() -> int:
    """vLLM's tensor-parallel rank of this worker (0 when vLLM's distributed state is not set up)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError, ImportError):
        return 0


def _ids(ids: set[Hashable]) -> set[str] | None:
    return {str(i) for i in ids} or None
