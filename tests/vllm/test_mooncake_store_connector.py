# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's Mooncake store connector tests, applied to kvfsm's MooncakeStoreConnector.

Adapted from vLLM 0.33.0, ``tests/v1/kv_connector/unit/test_mooncake_store_connector.py``.
What changed: the connector is kvfsm's ``MooncakeStoreConnector``, loaded by
module path, against kvfsm's in-process Mooncake master (``master_address``),
where vLLM's patched its own scheduler and worker classes with mocks; the
assertions on those mocks (``connector_scheduler``, ``connector_worker``) read
vLLM's private fields and are replaced by the public behaviour they stand for.

The other tests of that file are not adapted: they check how vLLM's connector
delegates to its own ``MooncakeStoreScheduler`` / ``MooncakeStoreWorker``
classes (through mocks), its ZMQ lookup protocol, KV events, stats, store TP
layouts, Mamba validation and ``reset_cache``, none of which kvfsm's
connector has. ``test_mooncake_store_scheduler.py`` and ``_worker.py`` test
the internals of those two classes (request trackers, partial tails,
multi-group projections) and are not adapted either.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

from vllm.config import set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_utils import create_vllm_config

from kvfsm.adapters.vllm_mooncake import MooncakeStoreConnector
from kvfsm.drivers.mooncake import EmbeddedMaster


@pytest.fixture
def master() -> Iterator[EmbeddedMaster]:
    m = EmbeddedMaster()
    yield m
    m.stop()


def _make_vllm_config(master: EmbeddedMaster):  # kvfsm: the connector under test, and where its store is
    return create_vllm_config(
        kv_connector="MooncakeStoreConnector",
        kv_connector_module_path="kvfsm.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"master_address": master.address},
    )


def _make_kv_cache_config() -> KVCacheConfig:
    """Single-group full-attention KVCacheConfig — enough for the connector
    constructor's validate() pass."""
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, dtype=None)
    return KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[
            KVCacheTensor(
                size=8192,
                layers=["layer0"],
                layer_stride=8192,
                block_stride=2048,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
    )


def test_scheduler_reports_mooncake_cache_source(master: EmbeddedMaster):
    vllm_config = _make_vllm_config(master)
    kv_cache_config = _make_kv_cache_config()

    with set_current_vllm_config(vllm_config):  # kvfsm: no class of vLLM's to patch
        connector = MooncakeStoreConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    # Mooncake Store is an external cache service. Its internal memory and
    # local-storage policy is intentionally hidden behind that stable label.
    assert connector.get_external_cache_hit_sources(
        None,  # type: ignore[arg-type]
        32,
    ) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 32}


def test_shutdown_scheduler_role_is_noop(master: EmbeddedMaster):
    vllm_config = _make_vllm_config(master)
    kv_cache_config = _make_kv_cache_config()

    with set_current_vllm_config(vllm_config):
        connector = MooncakeStoreConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)

    # Scheduler role holds no store handle, so shutdown must be a safe no-op.
    with pytest.raises(RuntimeError):  # kvfsm: `connector.connector_worker is None` — it has no worker
        _ = connector.worker
    connector.shutdown()
