"""kvfsm watch in a real vLLM engine: around kvfsm's CPU-offload connector and vLLM's disk-backed ExampleConnector,
the engine generates the tokens it generates without a connector, and the watch ends with every request ended."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


@pytest.mark.parametrize("inner", ["cpu_offload", "example"])
def test_the_watch_changes_no_token_and_ends_with_nothing_held(
    run_offline: Callable[..., dict[str, Any]], inner: str
) -> None:
    plain = run_offline("none")
    watched = run_offline(f"watch_{inner}")
    for p, (want, got) in enumerate(zip(plain["passes"], watched["passes"], strict=True)):
        diff = [i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b]
        assert not diff, f"pass {p + 1}: prompts {diff} generated other tokens under the watch"
    watch = watched["stats"]["watch"]
    assert watch["held"] == 0 and watch["live"] == {"vllm_send": {}, "vllm_load": {}}
    assert not watch["stuck"] and not watch["violations"]
    assert watched["gpu_blocks_free_after"] == watched["gpu_blocks"] - 1
    if inner == "cpu_offload":  # its loads are asynchronous: every one was watched from phase A to finished_recving
        prompts = len(plain["passes"][0])
        assert watch["outcomes"].get("vllm_load:loaded", 0) >= prompts
        assert watched["stats"]["loads_done"] == watch["outcomes"]["vllm_load:loaded"]
