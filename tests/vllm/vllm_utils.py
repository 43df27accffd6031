# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""``create_vllm_config``, copied unchanged from vLLM 0.33.0's ``tests/v1/kv_connector/unit/utils.py``.

The adapted vLLM tests in this folder build their configs with it, as the originals do.
"""

from __future__ import annotations

from typing import Any, Literal

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
