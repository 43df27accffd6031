"""kvfsm's Mooncake store connector as a real ``KVConnectorBase_V1``, on :class:`~kvfsm.drivers.mooncake.MooncakeStoreWorker`.

Configure vLLM with::

    KVTransferConfig(kv_connector="MooncakeStoreConnector", kv_connector_module_path="kvfsm.adapters.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"master_address": "127.0.0.1:50051"})

The shape is vLLM's own Mooncake store connector (seed 000): the scheduler
looks prefixes up in the store (``batch_is_exist``) and sends the loads and
the stores to the worker in the metadata; a finished request's blocks are
kept by vLLM (``delay_free``) until the worker reports it in
``finished_sending``. Everything the worker holds is a Tracker instance of
``mooncake_store_send.yaml`` or ``mooncake_store_load.yaml``, and what vLLM
is owed is recorded by their releases, so a store call that raises can no
longer keep a request's blocks forever.

The worker moves the bytes of vLLM's own KV cache, whatever layout vLLM
registered (``register_kv_caches``: one tensor per layer; or the cross-layer
cache): its registered block buffer is a staging copy, one row per vLLM
block, so each store key is one run of bytes. A store job copies vLLM's
blocks into their rows before it puts them; a load copies the rows it got
into vLLM's blocks before it reports them, so a request vLLM resumes after
finished_recving attends over the loaded KV.

Unlike the CPU-offload connector, phase A pins nothing: the store may evict a
hit before the worker reads it (vLLM's connector has the same window). The
worker then reports every block of that load invalid and vLLM recomputes
them, so nothing stale is ever read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorRole, SupportsHMA
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..drivers.kv_cache import KVCache
from ..drivers.mooncake import BlockBuffer, EmbeddedMaster, KVStore, MooncakeStoreWorker, block_key, connect
from ..drivers.mooncake.embedded import connect_embedded
from .vllm_api import RequestStatus
from .vllm_async import VLLM as VLLM
from .vllm_async import AsyncConnector
from .vllm_kv_cache import adopt_cross_layers, adopt_layers, layout_of
from .vllm_settings import check_keys, seconds


@dataclass(frozen=True)
class LoadOrder:
    """Fill ``block_ids`` from the store keys of ``block_hashes`` (one each)."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[Any]


@dataclass(frozen=True)
class SaveOrder:
    """Store a finished request's ``block_ids`` under ``block_hashes``; vLLM keeps them until finished_sending."""

    request_id: str
    block_ids: list[int]
    block_hashes: list[Any]


@dataclass
class MooncakeStoreMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler to worker, once per step."""

    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    """Requests vLLM finished since the last step: a load still running for one is aborted."""


@dataclass
class StoreConnectorStats:
    """What the scheduler side asked for: lookups in the store, the hits, the loads and stores it ordered."""

    lookups: int = 0
    """Prefixes asked of the store (``batch_is_exist``); vLLM asks again each step a request waits."""
    hits: int = 0
    hit_tokens: int = 0
    loads_sent: int = 0
    load_blocks_sent: int = 0
    stores_sent: int = 0
    store_blocks_sent: int = 0


@dataclass(frozen=True)
class MooncakeSettings:
    """``kv_connector_extra_config``: where the store is, the key prefix, the worker's deadlines."""

    master_address: str
    prefix: str = "kv"
    load_threads: int = 2
    params: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> MooncakeSettings:
        deadlines = ("store_timeout", "load_timeout")
        check_keys(extra, {"master_address", "prefix", "load_threads", *deadlines}, "MooncakeStoreConnector")
        if "master_address" not in extra:
            raise ValueError(
                "MooncakeStoreConnector needs kv_connector_extra_config 'master_address': a mooncake_master's "
                "'host:port', or 'embedded:N' for kvfsm's in-process stand-in"
            )
        return cls(
            str(extra["master_address"]),
            str(extra.get("prefix", "kv")),
            int(extra.get("load_threads", 2)),
            seconds(extra, deadlines),
        )

    def connect(self) -> KVStore:
        """A store client: the embedded master registered under the address, or a real one over TCP."""
        if self.master_address.startswith("embedded:"):
            master = EmbeddedMaster.lookup(self.master_address)
            if master is None:
                raise ValueError(f"no embedded master is registered as {self.master_address!r}; start one first")
            return connect_embedded(master)
        return connect(self.master_address)


class MooncakeStoreConnector(AsyncConnector, SupportsHMA):  # type: ignore[misc]
    """Store-backed prefix cache: the scheduler looks up and plans, the worker's Trackers hold and report."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.layout, self.num_gpu_blocks = layout_of(kv_cache_config, "MooncakeStoreConnector")
        self.settings = MooncakeSettings.parse(self._kv_transfer_config.kv_connector_extra_config or {})
        self.store = self.settings.connect()
        self.block_size = self.layout.block_size
        # scheduler side: this step's plan
        self._hits: dict[str, tuple[int, list[Any]]] = {}
        """Phase A's answer per request: (first block, hashes of the hit), re-asked each step. Nothing is pinned
        here (the scheduler's process holds no store lease): the worker's ``load_order`` looks up again under the
        load spec, which reports a hit evicted since with every block invalid."""
        self._meta = MooncakeStoreMetadata()
        self.scheduler_stats = StoreConnectorStats()
        # worker side
        self._worker: MooncakeStoreWorker | None = None
        self._kv_cache: KVCache | None = None
        """vLLM's KV cache, once registered: the bytes the worker stores and loads."""
        if role == KVConnectorRole.WORKER:
            self._worker = self._make_worker(time.monotonic)

    def _make_worker(self, clock: Callable[[], float]) -> MooncakeStoreWorker:
        buffer = BlockBuffer(self.num_gpu_blocks, self.layout.block_bytes)
        buffer.pool.allocate(VLLM, self.num_gpu_blocks)  # vLLM owns every block; jobs pin on top
        if self._kv_cache is not None:
            buffer.attach(self._kv_cache)
        return MooncakeStoreWorker(
            self.store,
            buffer,
            prefix=self.settings.prefix,
            load_threads=self.settings.load_threads,
            params=self.settings.params,
            clock=clock,
        )

    @property
    def worker(self) -> MooncakeStoreWorker:
        """The worker's Trackers, threads and block buffer (WORKER role only)."""
        if self._worker is None:
            raise RuntimeError("this MooncakeStoreConnector was built for the SCHEDULER role; it has no worker")
        return self._worker

    def rebuild_worker(self, *, clock: Callable[[], float] | None = None, store: KVStore | None = None) -> None:
        """Before any request: a worker on ``clock`` (a test's step counter) and/or ``store`` (say, a FaultyStore)."""
        if self.worker.live():
            raise RuntimeError("rebuild_worker after requests arrived: what the worker holds now would be lost")
        self.worker.close()
        if store is not None:
            self.store = store
        self._worker = self._make_worker(clock or time.monotonic)

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the store holds beyond ``num_computed_tokens`` (never the last token), loaded asynchronously."""
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size
        hashes = list(request.block_hashes[first:last])
        hits = 0
        if hashes:
            self.scheduler_stats.lookups += 1
            answer = self.store.batch_is_exist([block_key(self.settings.prefix, h) for h in hashes])
            for code in answer:
                if code != 1:
                    break
                hits += 1
        if not hits:
            self._hits.pop(request.request_id, None)
            return 0, False
        self._hits[request.request_id] = (first, hashes[:hits])
        tokens = (first + hits) * self.block_size - num_computed_tokens
        self.scheduler_stats.hits += 1
        self.scheduler_stats.hit_tokens += tokens
        return tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Order the load of the hit into the request's new blocks (none if vLLM wants no external tokens)."""
        hit = self._hits.pop(request.request_id, None)
        if num_external_tokens == 0 or hit is None:
            return
        first, hashes = hit
        n = -(-num_external_tokens // self.block_size)
        block_ids = list(blocks.get_block_ids()[0][first : first + n])
        self._meta.loads.append(LoadOrder(request.request_id, block_ids, hashes[:n]))
        self.scheduler_stats.loads_sent += 1
        self.scheduler_stats.load_blocks_sent += len(block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> MooncakeStoreMetadata:
        meta, self._meta = self._meta, MooncakeStoreMetadata()
        meta.finished = set(scheduler_output.finished_req_ids)
        for rid in meta.finished:
            self._hits.pop(rid, None)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Store the request's computed full blocks; vLLM keeps them (delay_free) until finished_sending."""
        self._hits.pop(request.request_id, None)
        if request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        full = min(request.num_computed_tokens // self.block_size, len(block_ids), len(request.block_hashes))
        if full == 0:
            return False, None
        self._meta.saves.append(
            SaveOrder(request.request_id, list(block_ids[:full]), list(request.block_hashes[:full]))
        )
        self.scheduler_stats.stores_sent += 1
        self.scheduler_stats.store_blocks_sent += full
        return True, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def stats(self) -> dict[str, int]:
        """This instance's counters: the scheduler's (:class:`StoreConnectorStats`) in the SCHEDULER role, the
        worker's (:meth:`MooncakeStoreWorker.stats`: loads and stores by outcome, blocks moved, ``live``) in the
        WORKER role. vLLM builds one of each; read both for the whole picture."""
        if self._worker is not None:
            return self._worker.stats()
        return asdict(self.scheduler_stats)

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Store and load vLLM's own per-layer caches (what vLLM 0.32 and 0.33 register), read where vLLM's
        KV-cache config places each layer's blocks, whatever shape its attention backend gives the tensors."""
        self._attach(adopt_layers(kv_caches, self._kv_cache_config, self.layout))

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any = None) -> None:
        """Store and load vLLM's own cache when it is one block-major tensor (``(blocks, layers, block_size, heads,
        head)``)."""
        self._attach(adopt_cross_layers(kv_cache, self.layout))

    def _attach(self, cache: KVCache) -> None:
        if cache.num_blocks != self.num_gpu_blocks:
            raise ValueError(f"vLLM registered {cache.num_blocks} KV blocks, the KV-cache config {self.num_gpu_blocks}")
        self.worker.buffer.attach(cache)
        self._kv_cache = cache

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Give the worker this step's aborts, loads and stores; its threads do the store calls."""
        meta = self._step_metadata(MooncakeStoreMetadata)
        w = self.worker
        if (meta.loads or meta.saves) and w.buffer.engine is None:
            raise RuntimeError(
                "MooncakeStoreConnector's worker has no KV cache to store or load: the engine must register its "
                "cache first (vLLM calls register_kv_caches before the first step)"
            )
        for rid in meta.finished:
            if w.load.route("request_id", rid) is not None:
                w.abort(rid)  # vLLM aborted it mid-load: the load reports it, the store calls stop
        for order in meta.loads:  # the spec reports each once, a hit evicted since phase A with every block invalid
            w.load_order(order.request_id, order.block_hashes, order.block_ids)
        for save in meta.saves:
            w.save(save.request_id, save.block_ids, save.block_hashes)
            w.request_finished(save.request_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Drain the report: finished_sending and finished_recving; the blocks to recompute come next."""
        return self._hand_over(self.worker.get_finished())
