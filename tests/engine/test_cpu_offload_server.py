"""kvfsm's CpuOffloadConnector in vLLM's OpenAI server: concurrent completions served from the CPU tier return the
tokens of the engine without a connector; vLLM's own ``bench serve`` client sees no failed request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfsm.showcase.engine.offline import connector_config, prefix_prompts


@pytest.fixture(scope="module")
def offload_server(tiny_model: Path) -> Iterator[Any]:
    from kvfsm.showcase.engine.serve import Server

    with Server(tiny_model, connector_config("cpu_offload")) as server:
        yield server.wait_ready()


def test_completions_after_cpu_hits_match_the_engine_without_a_connector(
    offload_server: Any, run_offline: Callable[..., dict[str, Any]]
) -> None:
    want = run_offline("none")["passes"][0]
    prompts = prefix_prompts()
    first = offload_server.complete_all(prompts, concurrency=4)
    offload_server.reset_prefix_cache()  # retried while a store still holds blocks
    before = offload_server.metrics()
    second = offload_server.complete_all(prompts, concurrency=4)
    after = offload_server.metrics()
    assert [i for i, (a, b) in enumerate(zip(want, first, strict=True)) if a != b] == []
    assert [i for i, (a, b) in enumerate(zip(want, second, strict=True)) if a != b] == []
    # The second pass found each prefix (3 blocks) in kvfsm's CPU tier at least once: vLLM's own prefix cache
    # was empty, and the prompts after the first of a prefix may find it in vLLM's cache again.
    hits = after["vllm:external_prefix_cache_hits_total"] - before.get("vllm:external_prefix_cache_hits_total", 0)
    assert hits >= 4 * 96, f"only {hits} prompt tokens came from the connector"
    # Emptying the connector's tier too (reset_external): the next pass recomputes everything, same tokens.
    offload_server.reset_prefix_cache(connector=True)
    third = offload_server.complete_all(prompts[:4], concurrency=4)
    assert third == want[:4]
    assert (
        offload_server.metrics()["vllm:external_prefix_cache_hits_total"]
        == after["vllm:external_prefix_cache_hits_total"]
    )


def test_bench_serve_prefix_repetition_at_concurrency_16_fails_nothing(offload_server: Any, tiny_model: Path) -> None:
    from kvfsm.showcase.engine.serve import bench_serve

    result = bench_serve(offload_server.url, tiny_model, num_prompts=48, concurrency=16)
    assert result["completed"] == 48 and result.get("failed", 0) == 0
