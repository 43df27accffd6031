"""kvfsm's MooncakeStoreConnector in a real vLLM engine against a real ``mooncake_master``: prefixes stored in
pass 1 are loaded from the store into vLLM's own KV cache in pass 2, and give the engine's own tokens."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvfsm.drivers.mooncake import StoreUnavailable
from kvfsm.drivers.mooncake.store import import_store_module
from kvfsm.harness.mooncake import MasterProcess

pytestmark = pytest.mark.mooncake


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    """A ``mooncake_master`` on free loopback ports, killed by pid at the end."""
    try:
        import_store_module()
    except StoreUnavailable as exc:
        pytest.skip(f"Mooncake store unavailable: {exc}")
    process = MasterProcess()
    try:
        yield process.start()
    finally:
        process.stop()


def test_store_hits_generate_the_tokens_of_the_engine_without_a_connector(
    run_offline: Callable[..., dict[str, Any]], master: MasterProcess
) -> None:
    plain = run_offline("none")
    store = run_offline(
        "mooncake_store", extra={"master_address": master.address, "prefix": f"tiny-{uuid.uuid4().hex[:8]}"}
    )
    stats = store["stats"]
    prompts = len(plain["passes"][0])
    assert prompts >= 24
    # Pass 1 stored every full block; pass 2 found the prefixes in the store only (vLLM's prefix cache was
    # reset), and the worker loaded them into vLLM's blocks: 3 blocks of 32 tokens per prompt.
    assert stats["stores_sent"] >= prompts and stats["stores_done"] == stats["stores_sent"]
    assert stats["hits"] >= prompts and stats["loads_done"] == stats["loads_sent"] >= prompts
    assert stats["blocks_loaded"] == stats["load_blocks_sent"] >= 3 * prompts
    for p, (want, got) in enumerate(zip(plain["passes"], store["passes"], strict=True)):
        diff = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
        assert not diff, f"pass {p + 1}: prompts {diff} generated other tokens than the engine without a connector"
    assert stats["blocks_stored"] > 0 and stats["bytes_gathered"] > 0  # vLLM's blocks were copied, not a buffer's
    assert stats["loads_failed"] == stats["stores_failed"] == stats["action_errors"] == stats["bugs"] == 0
    assert stats["live"] == stats["owed"] == 0
    # vLLM's own pool is whole: every block but the null block is free once the stores are over.
    assert store["gpu_blocks_free_after"] == store["gpu_blocks"] - 1


def test_completions_over_the_openai_server_after_store_hits_match_the_engine_without_a_connector(
    run_offline: Callable[..., dict[str, Any]], master: MasterProcess, tiny_model: Any
) -> None:
    from kvfsm.showcase.engine.offline import connector_config, prefix_prompts
    from kvfsm.showcase.engine.serve import Server

    want = run_offline("none")["passes"][0]
    prompts = prefix_prompts()
    config = connector_config("mooncake_store", master_address=master.address, prefix=f"srv-{uuid.uuid4().hex[:8]}")
    with Server(tiny_model, config) as server:
        server.wait_ready()
        first = server.complete_all(prompts, concurrency=4)
        server.reset_prefix_cache()  # retried while a store still holds vLLM's blocks (delay_free)
        before = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
        second = server.complete_all(prompts, concurrency=4)
        hits = server.metrics()["vllm:external_prefix_cache_hits_total"] - before
    assert [i for i, (a, b) in enumerate(zip(want, first, strict=True)) if a != b] == []
    assert [i for i, (a, b) in enumerate(zip(want, second, strict=True)) if a != b] == []
    # Each prefix (3 blocks) came from the store at least once: vLLM's own prefix cache was empty.
    assert hits >= 4 * 96, f"only {hits} prompt tokens came from the store"
