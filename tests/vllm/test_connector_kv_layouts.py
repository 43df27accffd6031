"""The CPU-offload connector's WORKER role on vLLM's own cache in each layout vLLM places: the bytes a store reads
and a load writes are checked in vLLM's tensors, read by each layout's own indexing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
)
from vllm_utils import create_vllm_config

from kvfsm.adapters.vllm_connector import CpuOffloadConnector
from kvfsm.adapters.vllm_cpu_offload import CpuOffloadMetadata, TransferJob
from kvfsm.adapters.vllm_kv_cache import layout_of

N, LAYERS, BS, HEADS, HEAD = 10, 2, 16, 2, 8
NAMES = [f"model.layers.{i}.attn" for i in range(LAYERS)]


def allocation(kind: str) -> tuple[KVCacheConfig, dict[str, torch.Tensor], Callable[[int], list[torch.Tensor]]]:
    """A KV-cache config, the per-layer tensors vLLM would register for it, and how the layout reads block b."""
    if kind == "mla":  # one latent per token: [blocks, block_size, latent]
        spec: FullAttentionSpec = MLAAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=4 * HEAD, dtype=torch.float16
        )
        shape: tuple[int, ...] = (N, BS, 4 * HEAD)
    else:  # vLLM's CPU backend: [blocks, heads, block_size, 2*head]
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
        shape = (N, HEADS, BS, 2 * HEAD)
    page = spec.page_size_bytes
    place = KVCacheTensor(size=LAYERS * N * page, layers=NAMES, layer_stride=N * page, block_stride=page)
    config = KVCacheConfig(num_blocks=N, kv_cache_tensors=[place], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    raw = torch.randn(LAYERS * N * page // 2, generator=torch.Generator().manual_seed(7)).half()
    views = [raw[i * N * page // 2 :][: N * page // 2].view(shape) for i in range(LAYERS)]
    return config, dict(zip(NAMES, views, strict=True)), lambda b: [v[b].clone() for v in views]


@pytest.mark.parametrize("kind", ["attention", "mla"])
def test_a_store_then_a_load_moves_vllms_own_blocks(kind: str) -> None:
    config, tensors, block_of = allocation(kind)
    vllm_config = create_vllm_config(
        kv_connector="CpuOffloadConnector",
        kv_connector_module_path="kvfsm.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"num_cpu_blocks": 4},
    )
    layout, _ = layout_of(config)
    assert layout.block_bytes == LAYERS * config.kv_cache_groups[0].kv_cache_spec.page_size_bytes
    worker = CpuOffloadConnector(vllm_config, KVConnectorRole.WORKER, config)
    worker.register_kv_caches(tensors)
    stored = {b: block_of(b) for b in (3, 7)}

    def step(meta: CpuOffloadMetadata) -> None:
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.get_finished(set())
        worker.clear_connector_metadata()

    step(CpuOffloadMetadata(stores=[TransferJob(1, "a", [3, 7], [0, 2])]))
    for t in tensors.values():
        t[3].zero_()
        t[7].zero_()  # vLLM reuses the blocks
    untouched = {b: block_of(b) for b in range(N) if b not in (1, 5)}
    step(CpuOffloadMetadata(loads=[TransferJob(2, "b", [0, 2], [5, 1])]))
    assert all(torch.equal(a, b) for a, b in zip(block_of(5), stored[3], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(block_of(1), stored[7], strict=True))
    for b, before in untouched.items():
        assert all(torch.equal(a, c) for a, c in zip(block_of(b), before, strict=True)), f"block {b} changed"
    report = worker.build_connector_worker_meta()
    assert report is not None and report.stores_done == [1] and report.loads_done == [2]


def test_a_worker_without_vllms_cache_refuses_to_copy() -> None:
    config, _tensors, _ = allocation("attention")
    vllm_config = create_vllm_config(
        kv_connector="CpuOffloadConnector", kv_connector_module_path="kvfsm.adapters.vllm", kv_role="kv_both",
        kv_connector_extra_config={"num_cpu_blocks": 4},
    )  # fmt: skip
    worker = CpuOffloadConnector(vllm_config, KVConnectorRole.WORKER, config)
    worker.bind_connector_metadata(CpuOffloadMetadata(loads=[TransferJob(1, "a", [0], [1])]))
    with pytest.raises(RuntimeError, match="must register its cache first"):
        worker.start_load_kv(None)
