"""The `vllm` tests: kvfsm's connectors inside vLLM's real scheduler, and vLLM's own tests adapted to them.

The environment vLLM needs (CPU platform, offline Hugging Face cache) is set
by tests/conftest.py, before any module is imported. Every module skips
(``pytest.importorskip``) where vLLM is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test in this folder is a `vllm` test (select with -m vllm, leave out with -m 'not vllm')."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.vllm)
