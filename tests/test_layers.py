"""The layer contracts (``.importlinter``, run by ``./dev.sh test``) fail on an upward import.

A scratch copy of the package gets one import that breaks the README's
layering (the engine importing the showcase, the core importing a driver, a
driver importing the harness); ``lint-imports`` must exit non-zero and name
the import. The real tree must pass, so a contract that matches nothing (a
renamed layer) fails here too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e .[dev])")


def lint(where: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run(
        [str(LINT), str(where / ".importlinter"), "--no-cache"],
        cwd=where, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("layers")
    shutil.copytree(ROOT / "kvfsm", where / "kvfsm", ignore=shutil.ignore_patterns("__pycache__", "*.yaml", "assets"))
    shutil.copy(ROOT / ".importlinter", where / ".importlinter")
    return where


def test_the_tree_as_it_is_keeps_its_layers(scratch: Path) -> None:
    done = lint(scratch)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "upward"),
    [
        ("kvfsm/engine/tracker.py", "from ..showcase import moriio_seed"),  # the core importing the showcase
        ("kvfsm/spec/model.py", "from ..drivers import block_pool"),  # the spec layer importing a driver
        ("kvfsm/drivers/block_pool.py", "from ..adapters import vllm"),  # a driver importing an engine adapter
        ("kvfsm/drivers/block_pool.py", "from ..harness import peer"),  # a driver importing the harness
    ],
)
def test_an_upward_import_breaks_the_contract_and_is_named(scratch: Path, module: str, upward: str) -> None:
    path = scratch / module
    original = path.read_text()
    try:
        path.write_text(f"{upward}  # noqa\n{original}")
        done = lint(scratch)
    finally:
        path.write_text(original)
    assert done.returncode != 0, done.stdout
    importer = module.removesuffix(".py").replace("/", ".")
    assert "1 broken" in done.stdout and importer in done.stdout, done.stdout
