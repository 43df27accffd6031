"""Suite-wide options: soak runs and long campaigns are opt-in; vLLM runs on the CPU, offline.

vLLM and huggingface_hub read their environment when first imported, and a
test module anywhere in tests/ may import them during collection, so the
environment is set here, before any test module is imported: the CPU
platform (no accelerator here), and an offline Hugging Face cache holding
only facebook/opt-125m's config (vLLM's tests name that model; scheduling
needs its config, never its weights).
"""

from __future__ import annotations

import atexit
import os
import shutil

import pytest

try:  # the showcase needs kvfsm[showcase]; without it the vLLM tests skip anyway
    from kvfsm.showcase.sim.opt125m import offline_hf_cache
except ImportError:
    offline_hf_cache = None  # type: ignore[assignment]

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
if offline_hf_cache is not None and "HF_HUB_OFFLINE" not in os.environ:
    hf_home = offline_hf_cache()
    atexit.register(shutil.rmtree, hf_home, True)  # one per session: gone with it, not left in the temp folder
    os.environ["HF_HOME"] = str(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow (soaks, long campaigns)")
    parser.addoption(
        "--run-docs", action="store_true", help="also run tests marked docs (every block of README.md and docs/)"
    )
    parser.addoption(
        "--run-browser", action="store_true", help="also run tests marked browser (kvfsm inspect in headless Chromium)"
    )
    parser.addoption(
        "--run-engines", action="store_true", help="also run tests/engine (real vLLM engines, marked vllm_engine)"
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "docs: runs a block of README.md or docs/ as written; skipped unless --run-docs")
    config.addinivalue_line(
        "markers", "browser: drives kvfsm inspect's page in headless Chromium; skipped unless --run-browser"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_docs = pytest.mark.skip(reason="docs: run with --run-docs")
    if not config.getoption("--run-docs"):
        for item in items:
            if item.get_closest_marker("docs") is not None:
                item.add_marker(skip_docs)
    if not config.getoption("--run-browser"):
        skip_browser = pytest.mark.skip(reason="browser: run with --run-browser (./dev.sh test does, as its own step)")
        for item in items:
            if item.get_closest_marker("browser") is not None:
                item.add_marker(skip_browser)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
