"""kvfsm's MooncakeStoreConnector, WORKER role, on the KV cache vLLM registers: through the connector's own
calls (``register_kv_caches``, metadata, ``start_load_kv``, ``get_finished``), what it stores is vLLM's
blocks and what it loads lands in vLLM's blocks."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

import torch
from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm_utils import create_vllm_config

from kvfsm.adapters.vllm_mooncake import LoadOrder, MooncakeStoreConnector, MooncakeStoreMetadata, SaveOrder
from kvfsm.drivers.kv_cache import KVCache
from kvfsm.drivers.mooncake import EmbeddedMaster

BLOCKS, BLOCK_SIZE, HEADS, HEAD = 6, 16, 2, 32
LAYERS = ["layer0", "layer1"]


@pytest.fixture
def master() -> Iterator[EmbeddedMaster]:
    m = EmbeddedMaster()
    yield m
    m.stop()


@pytest.fixture
def worker(master: EmbeddedMaster) -> Iterator[MooncakeStoreConnector]:
    vllm_config = create_vllm_config(
        kv_connector="MooncakeStoreConnector",
        kv_connector_module_path="kvfsm.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"master_address": master.address, "prefix": "t"},
    )
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)
    per_block = 2 * BLOCK_SIZE * HEADS * HEAD * 4
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=BLOCKS * per_block, layers=[name], layer_stride=BLOCKS * per_block, block_stride=per_block
            )
            for name in LAYERS
        ],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )
    with set_current_vllm_config(vllm_config):
        connector = MooncakeStoreConnector(vllm_config, KVConnectorRole.WORKER, config)
    yield connector
    connector.shutdown()


def vllm_caches() -> dict[str, torch.Tensor]:
    """Per-layer caches shaped as vLLM's CPU backend allocates them, filled with distinct random values."""
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn((BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD), generator=gen) for name in LAYERS}


def step(worker: MooncakeStoreConnector, meta: MooncakeStoreMetadata) -> None:
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.clear_connector_metadata()


def wait_for(worker: MooncakeStoreConnector, which: int, request_id: str) -> None:
    """Step ``get_finished`` until ``request_id`` is in its ``which`` set (0: sending, 1: recving)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if request_id in (worker.get_finished(set())[which] or ()):
            return
        time.sleep(0.002)
    raise AssertionError(f"{request_id} was never reported")


def test_without_a_registered_cache_the_worker_refuses_to_store(worker: MooncakeStoreConnector) -> None:
    worker.bind_connector_metadata(MooncakeStoreMetadata(saves=[SaveOrder("r", [1], ["h1"])]))
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        worker.start_load_kv(None)


def test_stores_and_loads_move_the_blocks_of_vllms_registered_cache(worker: MooncakeStoreConnector) -> None:
    caches = vllm_caches()
    worker.register_kv_caches(caches)
    cache = KVCache.of_layers(list(caches.values()), BLOCKS, worker.layout)
    src, dst, hashes = [1, 2], [4, 5], ["h1", "h2"]
    want = [cache.block_bytes(b) for b in src]
    assert want != [cache.block_bytes(b) for b in dst]

    step(worker, MooncakeStoreMetadata(saves=[SaveOrder("writer", src, hashes)]))
    wait_for(worker, 0, "writer")
    step(worker, MooncakeStoreMetadata(loads=[LoadOrder("reader", dst, hashes)]))
    wait_for(worker, 1, "reader")

    assert worker.get_block_ids_with_load_errors() == set()
    assert [cache.block_bytes(b) for b in dst] == want, "the load must land in vLLM's own tensors"
    stats = worker.stats()
    assert stats["blocks_stored"] == stats["blocks_loaded"] == 2 and stats["loads_done"] == 1
    assert stats["live"] == 0
