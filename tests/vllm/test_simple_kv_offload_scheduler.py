# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Unit tests for SimpleCPUOffloadScheduler, applied to kvfsm's CpuOffloadConnector.

Adapted from vLLM 0.33.0, ``tests/v1/simple_kv_offload/test_scheduler.py``.
Test bodies and their assertions are vLLM's; what changed, and only that:

- The connector under test is ``kvfsm.adapters.vllm.CpuOffloadConnector``
  (SCHEDULER role) bound to a real vLLM ``BlockPool``; ``make_scheduler``
  builds it. vLLM's CPU pool spends one block on a null block, kvfsm's does
  not, so ``make_scheduler(num_cpu_blocks=n)`` gives it ``n - 1`` blocks: the
  same usable room.
- kvfsm stores a request's computed blocks when it finishes, vLLM's
  connector as they are computed: each store in these tests is preceded by
  ``sched.request_finished(req, block_ids)`` (marked ``# kvfsm: ...``).
- The metadata is kvfsm's: ``meta.stores`` reads ``meta.stores``,
  ``meta.store_gpu_blocks`` / ``store_cpu_blocks`` read ``meta.stores[0]``'s
  ``src_blocks`` / ``dst_blocks``, and the same for loads.
  ``simulate_store_completion`` and ``simulate_load_completion`` report the
  jobs of a metadata as done (kvfsm's worker names jobs, not events or
  request ids), so the latter takes the metadata instead of request ids.
- Private fields of vLLM's connector: ``cpu_block_pool(sched)`` is a view of
  kvfsm's CPU pool that answers the calls these tests make
  (``cached_block_hash_to_block.get_one_block``, ``touch``, ``free_blocks``);
  ``req_id in sched._reqs_to_load`` reads "a load for it is still live" from
  kvfsm's Tracker; ``_reqs_to_load[...].finished is True`` has no
  counterpart and is dropped.
- ``test_connector_*``: only the ``cpu`` backend (kvfsm has no disk tier);
  ``connector.scheduler_manager.num_cpu_blocks`` reads kvfsm's CPU pool.
- ``pytestmark = pytest.mark.skip_global_cleanup`` (a marker of vLLM's
  conftest) is dropped.

Not adapted, with the reason: eager/lazy store policies, per-step store
cursors and in-flight store dedup (kvfsm stores at finish only); hybrid,
multi-group, sliding-window, Mamba, ring/scratch and context-parallel layouts
(the connector serves one full-attention group); reset() (kvfsm's spec has no
reset event yet); prompt logprobs and streaming sessions (no counterpart);
disk backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.core.single_type_kv_cache_manager import (
    register_all_kvcache_specs,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvfsm.adapters.vllm_connector import CpuOffloadConnector, CpuOffloadWorkerReport
from kvfsm.adapters.vllm_cpu_offload import CpuOffloadMetadata
from kvfsm.drivers.block_pool import BlockPool as KvfsmBlockPool

# ---------------------------------------------------------------------------
# Constants
# ---------------------------------------------------------------------------
BLOCK_SIZE = 16
HEAD_SIZE = 16
NUM_KV_HEADS = 1
DTYPE = torch.float16
# bytes per block per tensor:
# block_size * num_kv_heads * head_size * 2 (K+V) * element_size
_BYTES_PER_BLOCK = BLOCK_SIZE * NUM_KV_HEADS * HEAD_SIZE * 2 * DTYPE.itemsize

# Ensure none_hash is initialized once
init_none_hash(sha256)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _make_kv_cache_config(
    num_blocks: int,
    num_groups: int = 1,
) -> KVCacheConfig:
    """Build a KVCacheConfig with non-empty kv_cache_tensors."""
    groups = []
    tensors = []
    register_all_kvcache_specs(vllm_config=None)  # Ensure specs are registered for tests
    total_size = _BYTES_PER_BLOCK * num_blocks * num_groups
    byte_offset = 0
    for g in range(num_groups):
        layer_names = [f"layer_{g}"]
        spec = (
            FullAttentionSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=DTYPE,
            )
            if g == 0
            else SlidingWindowSpec(
                block_size=BLOCK_SIZE,
                num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE,
                dtype=DTYPE,
                sliding_window=BLOCK_SIZE * 4,
            )
        )
        groups.append(
            KVCacheGroupSpec(
                layer_names,
                spec,
            )
        )
        tensors.append(
            KVCacheTensor(
                size=total_size,
                layers=layer_names,
                layer_stride=_BYTES_PER_BLOCK * num_blocks,
                block_stride=_BYTES_PER_BLOCK,
                offset=byte_offset,
            )
        )
        byte_offset += _BYTES_PER_BLOCK * num_blocks
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
    )


def _make_vllm_config(block_size: int = BLOCK_SIZE) -> VllmConfig:
    """Minimal VllmConfig for scheduler tests (no GPU)."""
    model_config = ModelConfig(
        model="facebook/opt-125m",
        trust_remote_code=True,
        dtype="float16",
        seed=42,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=64,
        max_model_len=10000,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        enable_prefix_caching=True,
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector="CpuOffloadConnector",  # kvfsm: the connector under test
        kv_connector_module_path="kvfsm.adapters.vllm",
        kv_role="kv_both",
    )
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
    )


@dataclass
class SchedulerFixture:
    """Bundle returned by make_scheduler for convenient access."""

    scheduler: CpuOffloadConnector
    gpu_block_pool: BlockPool
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    num_groups: int = 1


@pytest.mark.parametrize(
    ("backend", "source"),
    [("cpu", CacheHitSource.HOST)],  # kvfsm: no disk tier,
)
def test_connector_reports_configured_cache_source(tmp_path, backend: str, source: CacheHitSource):
    kv_cache_config = _make_kv_cache_config(num_blocks=4)
    vllm_config = _make_vllm_config()
    extra_config = {
        "cpu_bytes_to_use_per_rank": _BYTES_PER_BLOCK * 4,
        "kv_offload_backend": backend,
    }
    if backend == "disk":
        extra_config.update(
            disk_path=str(tmp_path / "kv-offload.bin"),
            disk_capacity_bytes=_BYTES_PER_BLOCK * 4,
        )
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_connector_extra_config = extra_config

    connector = CpuOffloadConnector(
        vllm_config,
        KVConnectorRole.SCHEDULER,
        kv_cache_config,
    )

    assert connector.get_external_cache_hit_sources(None, 32) == {source: 32}  # type: ignore[arg-type]
    assert connector.get_external_cache_hit_sources(None, 0) == {}  # type: ignore[arg-type]


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("backend", ["cpu"])  # kvfsm: no disk tier
def test_connector_explicit_cpu_blocks_align_uneven_stages(tmp_path, num_layers: int, backend: str):
    """The same configured pool size must fit lighter and heavier PP stages."""
    config = _make_kv_cache_config(num_blocks=16)
    names = [f"layer_{i}" for i in range(num_layers)]
    config.kv_cache_groups[0].layer_names = names
    config.kv_cache_tensors[0].layers = names
    config.kv_cache_tensors[0].size *= num_layers
    vllm_config = _make_vllm_config()
    extra = {
        "cpu_bytes_to_use_per_rank": _BYTES_PER_BLOCK * 8,
        "num_cpu_blocks": 4,
        "kv_offload_backend": backend,
    }
    if backend == "disk":
        extra.update(
            disk_path=str(tmp_path / "offload.bin"),
            disk_capacity_bytes=_BYTES_PER_BLOCK * 8,
        )
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_connector_extra_config = extra
    connector = CpuOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, config)
    assert connector.scheduler_half is not None  # kvfsm: its scheduler half and CPU pool
    assert connector.scheduler_half.offload.cpu_pool.num_blocks == 4
    assert connector.scheduler_half.offload.cpu_cache.num_blocks == 4


@pytest.mark.parametrize(
    "count, capacity_bytes",
    [(count, _BYTES_PER_BLOCK * 8) for count in [0, -1, True, 1.5, "4", 9]] + [(1, _BYTES_PER_BLOCK // 2)],
)
def test_connector_rejects_invalid_explicit_cpu_blocks(count, capacity_bytes):
    config = _make_kv_cache_config(num_blocks=16)
    vllm_config = _make_vllm_config()
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_connector_extra_config = {
        "cpu_bytes_to_use_per_rank": capacity_bytes,
        "num_cpu_blocks": count,
    }
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        CpuOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, config)


def make_scheduler(
    num_cpu_blocks: int = 8,
    num_gpu_blocks: int = 16,
    num_groups: int = 1,
    lazy: bool = False,
) -> SchedulerFixture:
    """kvfsm: the connector's SCHEDULER role, bound to a real vLLM GPU block pool.

    ``num_cpu_blocks - 1`` CPU blocks: vLLM's pool spends one on its null block.
    ``lazy`` has no counterpart (kvfsm stores at finish).
    """
    kv_cache_config = _make_kv_cache_config(num_gpu_blocks, num_groups)
    vllm_config = _make_vllm_config()
    assert vllm_config.kv_transfer_config is not None
    vllm_config.kv_transfer_config.kv_connector_extra_config = {"num_cpu_blocks": num_cpu_blocks - 1}
    sched = CpuOffloadConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    # Build a real GPU block pool and bind it
    gpu_block_pool = BlockPool(
        num_gpu_blocks=num_gpu_blocks,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
    )
    sched.bind_gpu_block_pool(gpu_block_pool)

    return SchedulerFixture(
        scheduler=sched,
        gpu_block_pool=gpu_block_pool,
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        num_groups=num_groups,
    )


_req_counter = 0


def make_request(
    num_blocks: int = 2,
    request_id: str | None = None,
    extra_tokens: int = 1,
) -> Request:
    """Create a Request with deterministic block hashes."""
    global _req_counter
    _req_counter += 1
    if request_id is None:
        request_id = f"req-{_req_counter}"

    num_tokens = num_blocks * BLOCK_SIZE + extra_tokens
    start = _req_counter * 10000
    prompt_token_ids = list(range(start, start + num_tokens))
    sampling_params = SamplingParams(max_tokens=1)

    req = Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
    return req


def make_scheduler_output(
    req_id_to_num_tokens: dict[str, int],
    *,
    new_reqs: dict[str, tuple[list[int], ...]] | None = None,
    cached_req_new_blocks: dict[str, tuple[list[int], ...] | None] | None = None,
) -> SchedulerOutput:
    """Build a minimal SchedulerOutput with num_scheduled_tokens.

    Args:
        new_reqs: For first-time requests, maps req_id -> block_ids tuple.
            These are placed into ``scheduled_new_reqs`` as ``NewRequestData``.
        cached_req_new_blocks: For returning (cached) requests, maps
            req_id -> new_block_ids (incremental) or None.
            These are placed into ``scheduled_cached_reqs``.

    """
    scheduled_new_reqs: list[NewRequestData] = []
    if new_reqs:
        for req_id, block_ids in new_reqs.items():
            scheduled_new_reqs.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=None,
                    mm_features=[],
                    sampling_params=None,
                    pooling_params=None,
                    block_ids=block_ids,
                    num_computed_tokens=0,
                    lora_request=None,
                )
            )

    if cached_req_new_blocks:
        cached_req_ids = list(cached_req_new_blocks.keys())
        cached_new_block_ids = [cached_req_new_blocks[rid] for rid in cached_req_ids]
        cached_reqs = CachedRequestData(
            req_ids=cached_req_ids,
            resumed_req_ids=set(),
            new_token_ids=[[] for _ in cached_req_ids],
            all_token_ids={},
            new_block_ids=cached_new_block_ids,
            num_computed_tokens=[0] * len(cached_req_ids),
            num_output_tokens=[0] * len(cached_req_ids),
        )
    else:
        cached_reqs = CachedRequestData.make_empty()

    return SchedulerOutput(
        scheduled_new_reqs=scheduled_new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=req_id_to_num_tokens,
        total_num_scheduled_tokens=sum(req_id_to_num_tokens.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        preempted_req_ids=set(),
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def simulate_store_completion(
    scheduler: CpuOffloadConnector,
    meta: CpuOffloadMetadata,
) -> None:
    """Simulate worker reporting a store event completion (kvfsm: the metadata's store jobs)."""
    output = KVConnectorOutput(
        finished_recving=set(),
        kv_connector_worker_meta=CpuOffloadWorkerReport(stores_done=[job.job_id for job in meta.stores]),
    )
    scheduler.update_connector_output(output)


def simulate_load_completion(
    scheduler: CpuOffloadConnector,
    meta: CpuOffloadMetadata,
) -> None:
    """Simulate worker reporting load completions for requests (kvfsm: the metadata's load jobs)."""
    output = KVConnectorOutput(
        finished_sending=set(),
        kv_connector_worker_meta=CpuOffloadWorkerReport(loads_done=[job.job_id for job in meta.loads]),
    )
    scheduler.update_connector_output(output)


class _CpuPoolView:
    """kvfsm: the calls these tests make on vLLM's CPU block pool, answered by kvfsm's CPU pool."""

    def __init__(self, pool: KvfsmBlockPool) -> None:
        self.pool = pool
        self.cached_block_hash_to_block = self

    def get_one_block(self, key: bytes) -> int | None:
        return self.pool.cached_block(get_block_hash(key))

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            self.pool.pin(("touch", b), [b])

    def free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.pool.release(("touch", b))


def cpu_block_pool(scheduler: CpuOffloadConnector) -> _CpuPoolView:
    return _CpuPoolView(scheduler.scheduler_half.offload.cpu_pool)


def load_in_flight(scheduler: CpuOffloadConnector, req_id: str) -> bool:
    """kvfsm: ``req_id in sched._reqs_to_load``, read from the load Tracker."""
    loads = scheduler.scheduler_half.loads
    return loads.state(req_id) in loads.spec.live


def _allocate_gpu_blocks(
    gpu_block_pool: BlockPool,
    request: Request,
    num_blocks: int,
    group_id: int = 0,
) -> list:
    """Allocate GPU blocks, cache them with hashes, return block list.

    Mimics what KVCacheManager does: allocate blocks from pool, then
    register them in the prefix cache via cache_full_blocks so that
    re-allocation properly evicts stale hashes.
    """
    blocks = gpu_block_pool.get_new_blocks(num_blocks)
    num_full = min(num_blocks, len(request.block_hashes))
    if num_full > 0:
        gpu_block_pool.cache_full_blocks(
            request=request,
            blocks=blocks,
            num_cached_blocks=0,
            num_full_blocks=num_full,
            block_size=BLOCK_SIZE,
            kv_cache_group_id=group_id,
        )
    return blocks


def _alloc_and_register(
    fix: SchedulerFixture,
    request: Request,
    num_blocks: int,
    *,
    confirmed: bool = True,
    group_id: int = 0,
) -> KVCacheBlocks:
    """Allocate GPU blocks and return KVCacheBlocks.

    Block IDs are no longer registered in a mock KVCacheManager; instead
    tests pass them through ``make_scheduler_output`` so that
    ``yield_req_data`` can pick them up.

    If ``confirmed`` is True, advance ``request.num_computed_tokens`` to simulate
    the scheduler's ``_update_after_schedule`` from a prior step.
    """
    gpu_blocks = _allocate_gpu_blocks(fix.gpu_block_pool, request, num_blocks, group_id=group_id)
    kv_blocks = KVCacheBlocks(blocks=(gpu_blocks,))
    if confirmed:
        request.num_computed_tokens = num_blocks * BLOCK_SIZE
    return kv_blocks


def test_eager_store_and_load_roundtrip() -> None:
    """Eager mode: store blocks on compute, complete store, verify cache hit."""
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=16, lazy=False)
    sched = fix.scheduler

    num_blocks = 2
    req = make_request(num_blocks=num_blocks)

    kv_blocks = _alloc_and_register(fix, req, num_blocks)
    sched.update_state_after_alloc(req, kv_blocks, num_external_tokens=0)
    sched.request_finished(req, kv_blocks.get_block_ids()[0])  # kvfsm: stores at finish
    block_ids = kv_blocks.get_block_ids()
    sched_out = make_scheduler_output(
        {req.request_id: num_blocks * BLOCK_SIZE},
        new_reqs={req.request_id: block_ids},
    )

    meta = sched.build_connector_meta(sched_out)
    assert meta.stores, "Expected a store event to be scheduled"
    assert len(meta.stores[0].src_blocks) > 0
    assert len(meta.stores[0].dst_blocks) == len(meta.stores[0].src_blocks)
    simulate_store_completion(sched, meta)

    # New request with same tokens should get CPU cache hit
    req2 = Request(
        request_id="req-eager-load",
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=req.sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=req._block_hasher,
    )
    hit_tokens, is_async = sched.get_num_new_matched_tokens(req2, num_computed_tokens=0)
    # make_request pads num_tokens by +1 beyond the last full block, so the
    # manager's max_hit_len = num_tokens - 1 cap leaves all full blocks intact.
    assert hit_tokens == num_blocks * BLOCK_SIZE
    assert is_async is True

    gpu_blocks2 = fix.gpu_block_pool.get_new_blocks(num_blocks)
    kv_blocks2 = KVCacheBlocks(blocks=(gpu_blocks2,))
    sched.update_state_after_alloc(req2, kv_blocks2, num_external_tokens=hit_tokens)

    block_ids2 = kv_blocks2.get_block_ids()
    sched_out2 = make_scheduler_output(
        {req2.request_id: 1},
        new_reqs={req2.request_id: block_ids2},
    )
    meta2 = sched.build_connector_meta(sched_out2)
    assert meta2.loads, "Expected a load event to be assigned"
    assert len(meta2.loads[0].dst_blocks) > 0
    assert len(meta2.loads[0].src_blocks) == len(meta2.loads[0].dst_blocks)


def test_max_hit_len_cap_drops_last_full_block() -> None:
    """When num_tokens is an exact multiple of BLOCK_SIZE, the manager's
    ``max_hit_len = num_tokens - 1`` cap forces ``find_longest_cache_hit`` to
    drop the final block (since ``max_length // block_size`` rounds down).
    """
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=16, lazy=False)
    sched = fix.scheduler

    num_blocks = 2
    req = make_request(num_blocks=num_blocks, extra_tokens=0)
    assert req.num_tokens == num_blocks * BLOCK_SIZE

    kv_blocks = _alloc_and_register(fix, req, num_blocks)
    sched.update_state_after_alloc(req, kv_blocks, num_external_tokens=0)
    sched.request_finished(req, kv_blocks.get_block_ids()[0])  # kvfsm: stores at finish
    sched_out = make_scheduler_output(
        {req.request_id: num_blocks * BLOCK_SIZE},
        new_reqs={req.request_id: kv_blocks.get_block_ids()},
    )
    meta = sched.build_connector_meta(sched_out)
    simulate_store_completion(sched, meta)

    req2 = Request(
        request_id="req-cap-boundary",
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=req.sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=req._block_hasher,
    )
    hit_tokens, _ = sched.get_num_new_matched_tokens(req2, num_computed_tokens=0)
    assert hit_tokens == (num_blocks - 1) * BLOCK_SIZE


def test_lru_eviction_order() -> None:
    """With limited CPU space, oldest blocks should be evicted first.

    CPU block pool: num_cpu_blocks=5 -> 4 free usable blocks (1 taken by null_block).
    After storing 4 blocks (2 req_a + 2 req_b), all free slots are occupied by
    cached blocks (ref_cnt=0, in hash map).  When 2 more are stored (req_c),
    2 LRU blocks from req_a get evicted from the cache to make room.
    """
    # 5 total = 4 usable (null_block takes 1), filling exactly with 4 blocks
    fix = make_scheduler(num_cpu_blocks=5, num_gpu_blocks=16, lazy=False)
    sched = fix.scheduler

    # Fill CPU with 4 blocks: 2 requests x 2 blocks (in LRU insertion order)
    req_a = make_request(num_blocks=2)
    req_b = make_request(num_blocks=2)

    kv_a = _alloc_and_register(fix, req_a, 2)
    kv_b = _alloc_and_register(fix, req_b, 2)
    sched.update_state_after_alloc(req_a, kv_a, num_external_tokens=0)
    sched.request_finished(req_a, kv_a.get_block_ids()[0])  # kvfsm: stores at finish
    sched.update_state_after_alloc(req_b, kv_b, num_external_tokens=0)
    sched.request_finished(req_b, kv_b.get_block_ids()[0])  # kvfsm: stores at finish

    ids_a = kv_a.get_block_ids()
    ids_b = kv_b.get_block_ids()
    sched_out = make_scheduler_output(
        {
            req_a.request_id: 2 * BLOCK_SIZE,
            req_b.request_id: 2 * BLOCK_SIZE,
        },
        new_reqs={
            req_a.request_id: ids_a,
            req_b.request_id: ids_b,
        },
    )
    meta = sched.build_connector_meta(sched_out)
    assert meta.stores
    simulate_store_completion(sched, meta)

    # Verify all 4 blocks are cached in CPU hash map
    for i, bhash in enumerate(req_a.block_hashes[:2]):
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        assert cpu_block_pool(sched).cached_block_hash_to_block.get_one_block(bhash_with_group) is not None, (
            f"req_a block {i} should be cached after store"
        )
    for i, bhash in enumerate(req_b.block_hashes[:2]):
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        assert cpu_block_pool(sched).cached_block_hash_to_block.get_one_block(bhash_with_group) is not None, (
            f"req_b block {i} should be cached after store"
        )

    # Store 2 more blocks from a new request - must evict 2 LRU blocks (req_a)
    req_c = make_request(num_blocks=2)
    kv_c = _alloc_and_register(fix, req_c, 2)
    sched.update_state_after_alloc(req_c, kv_c, num_external_tokens=0)
    sched.request_finished(req_c, kv_c.get_block_ids()[0])  # kvfsm: stores at finish

    ids_c = kv_c.get_block_ids()
    sched_out2 = make_scheduler_output(
        {req_c.request_id: 2 * BLOCK_SIZE},
        new_reqs={req_c.request_id: ids_c},
    )
    meta2 = sched.build_connector_meta(sched_out2)
    assert meta2.stores
    simulate_store_completion(sched, meta2)

    # req_a hashes should be evicted from CPU (they were LRU)
    for i, bhash in enumerate(req_a.block_hashes[:2]):
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        cache_map = cpu_block_pool(sched).cached_block_hash_to_block
        cached = cache_map.get_one_block(bhash_with_group)
        assert cached is None, f"req_a block {i} should have been evicted"

    # req_b and req_c hashes should be present
    for i, bhash in enumerate(req_b.block_hashes[:2]):
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        cache_map = cpu_block_pool(sched).cached_block_hash_to_block
        cached = cache_map.get_one_block(bhash_with_group)
        assert cached is not None, f"req_b block {i} should still be cached"

    for i, bhash in enumerate(req_c.block_hashes[:2]):
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        cache_map = cpu_block_pool(sched).cached_block_hash_to_block
        cached = cache_map.get_one_block(bhash_with_group)
        assert cached is not None, f"req_c block {i} should still be cached"


def test_touched_blocks_survive_eviction() -> None:
    """Touching CPU blocks updates their LRU position, protecting them from eviction."""
    # 5 total = 4 usable (null_block takes 1)
    fix = make_scheduler(num_cpu_blocks=5, num_gpu_blocks=16, lazy=False)
    sched = fix.scheduler

    # Fill CPU with 4 blocks (req_a: 2, req_b: 2) in LRU order
    req_a = make_request(num_blocks=2)
    req_b = make_request(num_blocks=2)

    kv_a = _alloc_and_register(fix, req_a, 2)
    kv_b = _alloc_and_register(fix, req_b, 2)
    sched.update_state_after_alloc(req_a, kv_a, num_external_tokens=0)
    sched.request_finished(req_a, kv_a.get_block_ids()[0])  # kvfsm: stores at finish
    sched.update_state_after_alloc(req_b, kv_b, num_external_tokens=0)
    sched.request_finished(req_b, kv_b.get_block_ids()[0])  # kvfsm: stores at finish

    ids_a = kv_a.get_block_ids()
    ids_b = kv_b.get_block_ids()
    sched_out = make_scheduler_output(
        {
            req_a.request_id: 2 * BLOCK_SIZE,
            req_b.request_id: 2 * BLOCK_SIZE,
        },
        new_reqs={
            req_a.request_id: ids_a,
            req_b.request_id: ids_b,
        },
    )
    meta = sched.build_connector_meta(sched_out)
    simulate_store_completion(sched, meta)

    # Touch req_a's CPU blocks to make them most-recently-used
    cpu_pool = cpu_block_pool(sched)
    for bhash in req_a.block_hashes[:2]:
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        cached_blk = cpu_pool.cached_block_hash_to_block.get_one_block(bhash_with_group)
        assert cached_blk is not None
        cpu_pool.touch([cached_blk])
        # Undo touch to return ref_cnt to 0
        # (so it's a free candidate but at MRU position)
        cpu_pool.free_blocks([cached_blk])

    # Now store 2 more blocks; req_b (LRU front) should be evicted, not req_a
    req_c = make_request(num_blocks=2)
    kv_c = _alloc_and_register(fix, req_c, 2)
    sched.update_state_after_alloc(req_c, kv_c, num_external_tokens=0)
    sched.request_finished(req_c, kv_c.get_block_ids()[0])  # kvfsm: stores at finish

    ids_c = kv_c.get_block_ids()
    sched_out2 = make_scheduler_output(
        {req_c.request_id: 2 * BLOCK_SIZE},
        new_reqs={req_c.request_id: ids_c},
    )
    meta2 = sched.build_connector_meta(sched_out2)
    simulate_store_completion(sched, meta2)

    # req_b should be evicted (LRU), req_a and req_c should survive
    for i, bhash in enumerate(req_b.block_hashes[:2]):
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        cached = cpu_pool.cached_block_hash_to_block.get_one_block(bhash_with_group)
        assert cached is None, f"req_b block {i} should have been evicted (it was LRU)"

    for i, bhash in enumerate(req_a.block_hashes[:2]):
        bhash_with_group = make_block_hash_with_group_id(bhash, 0)
        cached = cpu_pool.cached_block_hash_to_block.get_one_block(bhash_with_group)
        assert cached is not None, f"req_a block {i} should survive (was touched/MRU)"


def test_preemption_no_cpu_block_leak() -> None:
    """request_finished during in-flight load defers cleanup;
    completes after load done."""
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=16, lazy=False)
    sched = fix.scheduler

    num_blocks = 2

    # First: store blocks to CPU
    req = make_request(num_blocks=num_blocks)
    kv_blocks = _alloc_and_register(fix, req, num_blocks)
    sched.update_state_after_alloc(req, kv_blocks, num_external_tokens=0)
    sched.request_finished(req, kv_blocks.get_block_ids()[0])  # kvfsm: stores at finish
    block_ids = kv_blocks.get_block_ids()
    sched_out = make_scheduler_output(
        {req.request_id: num_blocks * BLOCK_SIZE},
        new_reqs={req.request_id: block_ids},
    )
    meta = sched.build_connector_meta(sched_out)
    simulate_store_completion(sched, meta)

    # Create new request with same tokens, check hit
    req2 = Request(
        request_id="req-preempt-load",
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=req.sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=req._block_hasher,
    )
    hit_tokens, is_async = sched.get_num_new_matched_tokens(req2, num_computed_tokens=0)  # noqa: RUF059 (vLLM's line)
    assert hit_tokens is not None and hit_tokens > 0

    gpu_blocks2 = fix.gpu_block_pool.get_new_blocks(num_blocks)
    kv_blocks2 = KVCacheBlocks(blocks=(gpu_blocks2,))
    sched.update_state_after_alloc(req2, kv_blocks2, num_external_tokens=hit_tokens)

    # Assign load_event via build_connector_meta
    block_ids2 = kv_blocks2.get_block_ids()
    sched_out2 = make_scheduler_output(
        {req2.request_id: 1},
        new_reqs={req2.request_id: block_ids2},
    )
    meta2 = sched.build_connector_meta(sched_out2)
    assert meta2.loads

    # Request finishes BEFORE load completes -> deferred
    sched.request_finished(req2, block_ids=[])
    assert load_in_flight(sched, req2.request_id)

    # Now simulate load completion -> cleanup fires
    simulate_load_completion(sched, meta2)
    assert not load_in_flight(sched, req2.request_id)


def test_inflight_finish_deferred_cleanup() -> None:
    """Store, then start a load, request_finished defers,
    load completion fires cleanup."""
    fix = make_scheduler(num_cpu_blocks=8, num_gpu_blocks=16, lazy=False)
    sched = fix.scheduler

    num_blocks = 2

    # Store
    req = make_request(num_blocks=num_blocks)
    kv_blocks = _alloc_and_register(fix, req, num_blocks)
    sched.update_state_after_alloc(req, kv_blocks, num_external_tokens=0)
    sched.request_finished(req, kv_blocks.get_block_ids()[0])  # kvfsm: stores at finish
    block_ids = kv_blocks.get_block_ids()
    sched_out = make_scheduler_output(
        {req.request_id: num_blocks * BLOCK_SIZE},
        new_reqs={req.request_id: block_ids},
    )
    meta = sched.build_connector_meta(sched_out)
    simulate_store_completion(sched, meta)

    # Load
    req2 = Request(
        request_id="req-inflight-load",
        prompt_token_ids=req.prompt_token_ids,
        sampling_params=req.sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=req._block_hasher,
    )
    hit_tokens, _ = sched.get_num_new_matched_tokens(req2, num_computed_tokens=0)
    assert hit_tokens is not None and hit_tokens > 0

    gpu_blocks2 = fix.gpu_block_pool.get_new_blocks(num_blocks)
    kv_blocks2 = KVCacheBlocks(blocks=(gpu_blocks2,))
    sched.update_state_after_alloc(req2, kv_blocks2, num_external_tokens=hit_tokens)

    block_ids2 = kv_blocks2.get_block_ids()
    sched_out2 = make_scheduler_output(
        {req2.request_id: 1},
        new_reqs={req2.request_id: block_ids2},
    )
    meta2 = sched.build_connector_meta(sched_out2)
    assert meta2.loads

    # Finish before load completes
    sched.request_finished(req2, block_ids=[])
    assert load_in_flight(sched, req2.request_id)

    # Simulate load completion -> request removed
    simulate_load_completion(sched, meta2)
    assert not load_in_flight(sched, req2.request_id)


def test_toctou_cpu_hit_evicted_between_phases_no_crash() -> None:
    """Regression for vllm-project/vllm#39702.

    When ``get_num_new_matched_tokens`` (Phase A) reports a CPU cache hit
    of ``N`` tokens but ``update_state_after_alloc`` (Phase B) runs after
    other requests have caused LRU eviction of those exact blocks, the
    second ``find_longest_cache_hit`` call returns 0 while
    ``num_external_tokens`` is still ``N``, triggering
    ``AssertionError: Expected N hit tokens, got 0``.

    Setup: ``num_cpu_blocks=5`` (4 usable; null_block takes 1).
        1. Store req_a's 2 blocks to CPU. CPU: [a0, a1, _, _].
        2. Phase A on req_b (same prompt as req_a) reports a 2-block hit.
           Without the fix this does NOT pin a0/a1 — they remain at LRU front.
        3. Store req_c (2) + req_d (2) — 4 more blocks into 4 slots. With
           a0/a1 unpinned and at LRU front, they get evicted. CPU: [c0, c1,
           d0, d1].
        4. Phase B on req_b: re-searches the CPU coordinator, finds 0
           cached hashes, asserts.

    After the fix, Phase A pins the hit blocks so step 3 evicts req_c's
    blocks instead, and Phase B reads the cached ``(cpu_hit_blocks,
    hit_length)`` tuple without re-searching.
    """
    # 5 total = 4 usable (null_block takes 1)
    fix = make_scheduler(num_cpu_blocks=5, num_gpu_blocks=16, lazy=False)
    sched = fix.scheduler

    # --- Step 1: Store req_a's 2 blocks to CPU cache ---
    req_a = make_request(num_blocks=2)
    kv_a = _alloc_and_register(fix, req_a, 2)
    sched.update_state_after_alloc(req_a, kv_a, num_external_tokens=0)
    sched.request_finished(req_a, kv_a.get_block_ids()[0])  # kvfsm: stores at finish
    sched_out_a = make_scheduler_output(
        {req_a.request_id: 2 * BLOCK_SIZE},
        new_reqs={req_a.request_id: kv_a.get_block_ids()},
    )
    meta_a = sched.build_connector_meta(sched_out_a)
    assert meta_a.stores
    simulate_store_completion(sched, meta_a)

    # --- Step 2: Phase A — req_b (same prompt as req_a) reports a CPU hit ---
    req_b = Request(
        request_id="req-b-toctou",
        prompt_token_ids=req_a.prompt_token_ids,
        sampling_params=req_a.sampling_params,
        pooling_params=None,
        mm_features=None,
        block_hasher=req_a._block_hasher,
    )
    hit_tokens, is_async = sched.get_num_new_matched_tokens(req_b, num_computed_tokens=0)
    assert hit_tokens == 2 * BLOCK_SIZE, f"Phase A should report 2 blocks of CPU hit, got {hit_tokens}"
    assert is_async is True

    # --- Step 3: TOCTOU window — fill CPU cache so LRU evicts req_a's blocks
    # (in production this corresponds to other concurrent requests landing
    # between Phase A and Phase B for req_b). 4 usable slots, req_a occupies 2;
    # req_c (2) + req_d (2) require evicting 2 LRU blocks. ---
    req_c = make_request(num_blocks=2)
    req_d = make_request(num_blocks=2)
    kv_c = _alloc_and_register(fix, req_c, 2)
    kv_d = _alloc_and_register(fix, req_d, 2)
    sched.update_state_after_alloc(req_c, kv_c, num_external_tokens=0)
    sched.request_finished(req_c, kv_c.get_block_ids()[0])  # kvfsm: stores at finish
    sched.update_state_after_alloc(req_d, kv_d, num_external_tokens=0)
    sched.request_finished(req_d, kv_d.get_block_ids()[0])  # kvfsm: stores at finish
    sched_out_pressure = make_scheduler_output(
        {
            req_c.request_id: 2 * BLOCK_SIZE,
            req_d.request_id: 2 * BLOCK_SIZE,
        },
        new_reqs={
            req_c.request_id: kv_c.get_block_ids(),
            req_d.request_id: kv_d.get_block_ids(),
        },
    )
    meta_pressure = sched.build_connector_meta(sched_out_pressure)
    assert meta_pressure.stores
    simulate_store_completion(sched, meta_pressure)

    # --- Step 4: Phase B — must not crash ---
    # Before fix: AssertionError: Expected 32 hit tokens, got 0
    # After fix: Phase A pinned the hits → Step 3 evicted req_c instead,
    # Phase B consumes the cached (cpu_hit_blocks, hit_length) tuple.
    gpu_blocks_b = fix.gpu_block_pool.get_new_blocks(2)
    kv_blocks_b = KVCacheBlocks(blocks=(gpu_blocks_b,))
    sched.update_state_after_alloc(req_b, kv_blocks_b, num_external_tokens=hit_tokens)

    # --- Step 5: with the fix, the load is queued correctly ---
    sched_out_b = make_scheduler_output(
        {req_b.request_id: 1},
        new_reqs={req_b.request_id: kv_blocks_b.get_block_ids()},
    )
    meta_b = sched.build_connector_meta(sched_out_b)
    assert meta_b.loads, "Phase B should queue a load event using the pinned CPU hit blocks"
    assert len(meta_b.loads[0].dst_blocks) == 2
    assert len(meta_b.loads[0].src_blocks) == 2
