# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's KV-connector model-runner mixin around kvfsm's CpuOffloadConnector (WORKER role).

Adapted from vLLM 0.33.0, ``tests/v1/kv_connector/unit/test_kv_connector_lifecycle.py``,
with ``create_vllm_config`` from that folder's ``utils.py`` (``vllm_utils.py`` here).
What changed: the connector is ``CpuOffloadConnector`` loaded by module path
(vLLM's was ``TestExampleConnector``), with its settings, its metadata type and
a KV-cache config of one group (it refuses none). The three ``call_record``
assertions read a recording wrapper of vLLM's test connector and are dropped;
the one on the base class's ``_connector_metadata`` stays.
"""

from __future__ import annotations

from unittest.mock import MagicMock, patch

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

import torch
from vllm.distributed.kv_transfer.kv_transfer_state import (
    ensure_kv_transfer_initialized,
    ensure_kv_transfer_shutdown,
    get_kv_transfer_group,
)
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm_utils import create_vllm_config

from kvfsm.adapters.vllm_connector import CpuOffloadConnector
from kvfsm.adapters.vllm_cpu_offload import CpuOffloadMetadata


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
