# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's KV-connector model-runner mixin around kvfsm's CpuOffloadConnector (WORKER role).

Adapted from vLLM 0.33.0, ``tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py``,
with ``create_vllm_config`` copied unchanged from that folder's ``utils.py``.
What changed: the connector is ``CpuOffloadConnector`` loaded by module path
(vLLM's was ``TestExampleConnector``), with its settings, its metadata type and
a KV-cache config of one group (it refuses none). The three ``call_record``
assertions read a recording wrapper of vLLM's test connector and are dropped;
the one on the base class's ``_connector_metadata`` stays.
"""

from __future__ import annotations

from typing import Any, Literal
from unittest.mock import MagicMock, patch

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

import torch
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

from kvfsm.adapters.vllm import CpuOffloadMetadata
from kvfsm.adapters.vllm_connector import CpuOffloadConnector


def create_vllm_config(
    model: str = "facebook/opt-125m",
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    block_size: int = 16,
    max_model_len: int = 10000,
    enable_chunked_prefill: bool = True,
    enable_permute_local_kv: bool = False,
    kv_connector_extra_config: dict[str, Any] | None = None,
    dtype: str = "float16",
    cache_dtype: str = "auto",
    hf_overrides: dict[str, Any] | None = None,
    attention_backend: str | None = None,
    kv_load_failure_policy: Literal["recompute", "fail"] = "fail",
    kv_connector: str = "NixlConnector",
    kv_connector_module_path: str | None = None,
    kv_role: str = "kv_consumer",
    disable_hybrid_kv_cache_manager: bool | None = None,
    num_speculative_tokens: int | None = None,
) -> VllmConfig:
    """Initialize VllmConfig For Testing."""
    model_config = ModelConfig(
        model=model,
        trust_remote_code=True,
        dtype=dtype,
        seed=42,
        hf_overrides=hf_overrides or {},
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        is_encoder_decoder=model_config.is_encoder_decoder,
        disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
    )
    # Cache config, optionally force APC
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype=cache_dtype,
        enable_prefix_caching=True,
    )
    # Connectors are constructed after layout resolution; mirror that here.
    cache_config.kv_cache_layout = "LBNHC"
    kv_transfer_config = KVTransferConfig(
        kv_connector=kv_connector,
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        enable_permute_local_kv=enable_permute_local_kv,
        kv_connector_extra_config=kv_connector_extra_config or {},
        kv_load_failure_policy=kv_load_failure_policy,
    )
    attention_config = AttentionConfig(backend=attention_backend)
    speculative_config = (
        SpeculativeConfig(model="ngram", num_speculative_tokens=num_speculative_tokens)
        if num_speculative_tokens is not None
        else None
    )
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        attention_config=attention_config,
        speculative_config=speculative_config,
    )


def _make_empty_scheduler_output():
    return SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens={},
        total_num_scheduled_tokens=0,
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        kv_connector_metadata=CpuOffloadMetadata(),  # kvfsm: its metadata
    )


def test_kv_connector_mixin_clears_metadata():
    vllm_config = create_vllm_config(
        kv_connector="CpuOffloadConnector",  # kvfsm: the connector under test
        kv_connector_module_path="kvfsm.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"num_cpu_blocks": 4},
    )

    kv_cache_config = KVCacheConfig(  # kvfsm: the connector needs its one KV-cache group
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float16)
            )
        ],
    )
    # Initialize the global connector instance.
    # kv_transfer init now syncs engine_id across TP, so unit tests need
    # a minimal mocked TP group.
    mock_tp_group = MagicMock()
    mock_tp_group.broadcast_object.side_effect = lambda value, src=0: value

    with patch(
        "vllm.distributed.parallel_state.get_tp_group",
        return_value=mock_tp_group,
    ):
        ensure_kv_transfer_initialized(vllm_config, kv_cache_config)

    try:
        # Minimal scheduler output with empty metadata; mixin should still
        # bind/clear metadata even if no loads happen
        scheduler_output = _make_empty_scheduler_output()

        # Invoke the no-forward path which uses the mixin context manager
        KVConnectorModelRunnerMixin.kv_connector_no_forward(scheduler_output, vllm_config)

        # Verify clear_connector_metadata was called on the connector
        connector = get_kv_transfer_group()
        assert isinstance(connector, CpuOffloadConnector)
        assert connector._connector_metadata is None
    finally:
        # Ensure we clean up the global connector between tests
        ensure_kv_transfer_shutdown()
