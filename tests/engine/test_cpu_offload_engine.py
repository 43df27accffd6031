"""kvfsm's CpuOffloadConnector in a real vLLM engine: hits served from the CPU tier give the engine's own tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def test_cpu_hits_generate_the_tokens_of_the_engine_without_a_connector(
    run_offline: Callable[..., dict[str, Any]],
) -> None:
    plain = run_offline("none")
    offload = run_offline("cpu_offload")
    stats = offload["stats"]
    prompts = len(plain["passes"][0])
    assert prompts >= 24
    # Pass 2 found every prefix in the CPU tier only (vLLM's prefix cache was reset) and loaded it into vLLM's cache.
    assert stats["hits"] >= prompts and stats["loads_done"] == stats["loads_sent"] >= prompts
    assert stats["blocks_loaded"] >= 3 * prompts and stats["stores_done"] >= prompts
    for p, (want, got) in enumerate(zip(plain["passes"], offload["passes"], strict=True)):
        diff = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
        assert not diff, f"pass {p + 1}: prompts {diff} generated other tokens than the engine without a connector"
    assert stats["live"] == 0 and stats["loads_failed"] == stats["action_errors"] == 0
    # vLLM's own pool is whole: every block but the null block is free once the stores are over.
    assert offload["gpu_blocks_free_after"] == offload["gpu_blocks"] - 1
