"""The NIXL P/D pair as OpenAI servers behind a P/D router, as a disaggregated deployment serves: completions give
one engine's tokens, and vLLM's own ``bench serve`` client at concurrency 16 sees no failed request."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfsm.showcase.engine.offline import prefix_prompts


@pytest.fixture(scope="module")
def nixl_servers(tiny_model: Path) -> Iterator[Any]:
    from kvfsm.showcase.engine.serve import PDServers

    with PDServers(tiny_model, "nixl") as servers:
        yield servers


def test_completions_through_the_pd_pair_match_one_engine(
    nixl_servers: Any, run_offline: Callable[..., dict[str, Any]]
) -> None:
    want = run_offline("none")["passes"][0]
    got = nixl_servers.complete_all(prefix_prompts(), concurrency=4)
    assert [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b] == []
    # Every prompt went prefill then decode, and the decode engine loaded from the prefill's KV what its own
    # prefix cache lacked: at least each prompt's 32-token suffix, less the last token, which it computes.
    assert nixl_servers.router.state.routed == len(want) and nixl_servers.router.state.failed == 0
    hits = nixl_servers.servers["decode"].metrics()["vllm:external_prefix_cache_hits_total"]
    assert hits >= len(want) * 31


def test_bench_serve_through_the_pd_pair_at_concurrency_16_fails_nothing(nixl_servers: Any, tiny_model: Path) -> None:
    from kvfsm.showcase.engine.serve import bench_serve

    result = bench_serve(nixl_servers.url, tiny_model, num_prompts=24, concurrency=16)  # 16 at once, then the rest
    assert result["completed"] == 24 and result.get("failed", 0) == 0
