"""kvfsm's CPU-offload connector as a real ``KVConnectorBase_V1``: what vLLM loads through ``kv_connector_module_path``.

Configure vLLM with::

    KVTransferConfig(kv_connector="CpuOffloadConnector", kv_connector_module_path="kvfsm.adapters.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"num_cpu_blocks": 4096})

vLLM builds this class twice: the SCHEDULER role wraps
:class:`~kvfsm.adapters.vllm_cpu_offload.CpuOffloadScheduler` (two Trackers, on vLLM's own
GPU block pool once vLLM binds it), the WORKER role wraps
:class:`~kvfsm.adapters.vllm_cpu_offload.CpuOffloadWorker`. Every call is forwarded; this
module only converts between vLLM's types and the halves' plain ones. It
imports vLLM: :mod:`kvfsm.adapters.vllm` loads it only when vLLM asks for the
class, so kvfsm itself never needs vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..drivers.block_pool import BlockPool
from ..drivers.cpu_offload import CpuOffload
from .vllm_blocks import VllmGpuBlocks
from .vllm_cpu_offload import CpuOffloadMetadata, CpuOffloadScheduler, CpuOffloadWorker, CpuOffloadWorkerMeta
from .vllm_kv_cache import adopt_cross_layers, adopt_layers, layout_of
from .vllm_settings import check_keys


@dataclass
class CpuOffloadWorkerReport(CpuOffloadWorkerMeta, KVConnectorWorkerMetadata):
    """The worker half's job report as vLLM's worker metadata: reports of several workers add up."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, CpuOffloadWorkerMeta):
            raise TypeError(f"cannot aggregate CpuOffloadWorkerReport with {type(other).__name__}")
        return CpuOffloadWorkerReport(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(CpuOffloadWorkerMeta)}
        )


@dataclass(frozen=True)
class CpuOffloadSettings:
    """``kv_connector_extra_config`` of the connector; unknown keys are refused so a typo cannot go unnoticed."""

    num_cpu_blocks: int
    load_timeout: float | None = None
    store_timeout: float | None = None

    @classmethod
    def parse(cls, extra: Mapping[str, Any], block_bytes: int) -> CpuOffloadSettings:
        """Read and check the settings; vLLM's SimpleCPUOffloadConnector keys for the CPU budget work too.

        The CPU cache holds ``num_cpu_blocks`` blocks, or as many as fit in
        ``cpu_bytes_to_use_per_rank`` (alias ``cpu_bytes_to_use``); given both,
        the blocks must fit in the bytes.
        """
        known = {"num_cpu_blocks", "cpu_bytes_to_use", "cpu_bytes_to_use_per_rank", "kv_offload_backend"}
        check_keys(extra, known | {"load_timeout", "store_timeout"}, "CpuOffloadConnector")
        backend = extra.get("kv_offload_backend", "cpu")
        if backend != "cpu":
            raise ValueError(f"kv_offload_backend {backend!r}: CpuOffloadConnector offloads to CPU memory only ('cpu')")
        budget = extra.get("cpu_bytes_to_use_per_rank", extra.get("cpu_bytes_to_use"))
        count = extra.get("num_cpu_blocks")
        if count is not None:
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"num_cpu_blocks must be a whole number of blocks, at least 1, not {count!r}")
            if budget is not None and count * block_bytes > int(budget):
                raise ValueError(
                    f"num_cpu_blocks={count} blocks of {block_bytes} B do not fit in the {int(budget)} B "
                    "of cpu_bytes_to_use_per_rank; lower one or raise the other"
                )
            blocks = count
        elif budget is not None:
            blocks = int(budget) // block_bytes
            if blocks < 1:
                raise ValueError(f"cpu_bytes_to_use_per_rank={budget} is less than one block ({block_bytes} B)")
        else:
            raise ValueError(
                "CpuOffloadConnector needs the size of its CPU cache: set kv_connector_extra_config "
                f"'num_cpu_blocks' (blocks of {block_bytes} B) or 'cpu_bytes_to_use_per_rank'"
            )
        load, store = extra.get("load_timeout"), extra.get("store_timeout")
        return cls(blocks, None if load is None else float(load), None if store is None else float(store))


class CpuOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """A CPU prefix cache for vLLM whose every pin, load and store is a kvfsm Tracker instance."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.layout, self.num_gpu_blocks = layout_of(kv_cache_config, "CpuOffloadConnector")
        self.settings = CpuOffloadSettings.parse(
            self._kv_transfer_config.kv_connector_extra_config or {}, self.layout.block_bytes
        )
        self._scheduler: CpuOffloadScheduler | None = None
        self._worker: CpuOffloadWorker | None = None
        self._clock: Callable[[], float] = time.monotonic
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._scheduler_half(BlockPool(self.num_gpu_blocks))
        else:
            # No bytes until vLLM registers its KV cache: the worker copies into vLLM's tensors, never its own.
            self._worker = CpuOffloadWorker(
                CpuOffload(self.layout, self.num_gpu_blocks, self.settings.num_cpu_blocks, device="meta")
            )

    def _scheduler_half(self, gpu_pool: BlockPool) -> CpuOffloadScheduler:
        """Bookkeeping only: the bytes live in the worker, so the scheduler's caches are on the meta device."""
        offload = CpuOffload(
            self.layout, self.num_gpu_blocks, self.settings.num_cpu_blocks, gpu_pool=gpu_pool, device="meta"
        )
        return CpuOffloadScheduler(
            offload,
            clock=self._clock,
            load_timeout=self.settings.load_timeout,
            store_timeout=self.settings.store_timeout,
        )

    @property
    def scheduler_half(self) -> CpuOffloadScheduler:
        """The scheduler-side half (SCHEDULER role only): its Trackers, pools and stats."""
        if self._scheduler is None:
            raise RuntimeError("this CpuOffloadConnector was built for the WORKER role; it has no scheduler half")
        return self._scheduler

    @property
    def worker_half(self) -> CpuOffloadWorker:
        """The worker-side half (WORKER role only): its KV caches and copier."""
        if self._worker is None:
            raise RuntimeError("this CpuOffloadConnector was built for the SCHEDULER role; it has no worker half")
        return self._worker

    # -- scheduler side -------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Hold vLLM's own GPU blocks from now on (vLLM binds before the first request arrives)."""
        self._rebuild("bind_gpu_block_pool", VllmGpuBlocks(gpu_block_pool))

    def set_clock(self, clock: Callable[[], float]) -> None:
        """Measure the load and store deadlines on ``clock`` (a test's step counter) instead of ``time.monotonic``."""
        self._clock = clock
        self._rebuild("set_clock", self.scheduler_half.offload.gpu_pool)

    def _rebuild(self, why: str, gpu_pool: BlockPool) -> None:
        if self.scheduler_half.live():
            raise RuntimeError(f"{why} after requests arrived: what is held now would be lost; call it first")
        self._scheduler = self._scheduler_half(gpu_pool)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_half.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> CpuOffloadMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_half.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_half.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """One KV-cache group (the constructor refuses more), so this is :meth:`request_finished`."""
        return self.request_finished(request, block_ids[0])

    def reset_cache(self) -> bool:
        """Empty the CPU tier (``reset_prefix_cache(reset_connector=True)``); False while a hit is pinned or a
        copy is under way, as vLLM's own reset refuses while blocks are held."""
        return self.scheduler_half.offload.cpu_pool.reset_prefix_cache()

    def has_pending_push_work(self) -> bool:
        """Keep the engine stepping while a store still holds vLLM's blocks (vLLM's OffloadingConnector does the
        same): otherwise a store planned by the last request's finish would wait for the next request, and
        ``reset_prefix_cache()`` would find its blocks still referenced."""
        return self.scheduler_half.stores.live() > 0

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Copy into vLLM's own per-layer caches (what vLLM 0.32 and 0.33 register), in its backend's layout.

        The CPU tier is allocated here, one tensor per layer shaped like
        vLLM's, in pinned memory when vLLM's cache is on a GPU.
        """
        self.worker_half.attach(adopt_layers(kv_caches, self._kv_cache_config, self.layout))

    def register_cross_layers_kv_cache(self, kv_cache: torch.Tensor, attn_backend: Any = None) -> None:
        """Copy into vLLM's own cache when it is one block-major tensor (``(blocks, layers, block_size, heads, head)``)."""
        self.worker_half.attach(adopt_cross_layers(kv_cache, self.layout))

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_half.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self.worker_half.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_half.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_half.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker_half.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.worker_half.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_half.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_half.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return as_worker_report(self.worker_half.build_connector_worker_meta())


def as_worker_report(meta: CpuOffloadWorkerMeta | None) -> CpuOffloadWorkerReport | None:
    """The worker half's plain report as vLLM's ``KVConnectorWorkerMetadata`` (None stays None)."""
    if meta is None:
        return None
    return CpuOffloadWorkerReport(**{f.name: getattr(meta, f.name) for f in fields(CpuOffloadWorkerMeta)})
