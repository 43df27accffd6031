"""The `vllm` tests: kvfsm's connectors inside vLLM's real scheduler, and vLLM's own tests adapted to them.

vLLM reads its environment when it is imported, so it is set here, before
any test module imports it: the CPU platform (no accelerator here), and an
offline Hugging Face cache holding only facebook/opt-125m's config (vLLM's
tests name that model; scheduling needs its config, never its weights).
Every module skips (``pytest.importorskip``) where vLLM is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:  # the showcase needs kvfsm[showcase]; without it the modules here skip (they need vLLM too)
    from kvfsm.showcase.sim.opt125m import offline_hf_cache
except ImportError:
    offline_hf_cache = None  # type: ignore[assignment]

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
if offline_hf_cache is not None and "HF_HUB_OFFLINE" not in os.environ:
    os.environ["HF_HOME"] = str(offline_hf_cache())
    os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in this folder is a `vllm` test (select with -m vllm, leave out with -m 'not vllm')."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.vllm)
