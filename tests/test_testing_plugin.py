"""pytest integration: a connector project collects model-based tests for its folder of specs in one line.

Each test builds a small project in a temporary folder (specs, a drivers
module, a pytest configuration) and runs pytest on it in a subprocess, as the
connector author's CI would.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from buggy_drivers import CPU_HIT_SPEC, KV_REQUEST, PEER_SPEC

TESTS = Path(__file__).resolve().parent


def project(root: Path, pytest_config: str = "") -> Path:
    """specs/ with kv_request and cpu_hit_load, drivers.py with correct and buggy drivers."""
    (root / "specs").mkdir()
    shutil.copy(KV_REQUEST, root / "specs" / "kv_request.yaml")
    (root / "specs" / "cpu_hit_load.yaml").write_text(CPU_HIT_SPEC)
    shutil.copy(TESTS / "buggy_drivers.py", root / "drivers.py")
    (root / "pyproject.toml").write_text(f"[tool.pytest.ini_options]\n{pytest_config}")
    return root


def pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        capture_output=True,
        text=True,
        cwd=root,
        timeout=300,
    )


def test_one_line_in_a_test_module_collects_a_test_per_spec(tmp_path: Path) -> None:
    root = project(tmp_path)
    (root / "tests").mkdir()
    (root / "tests" / "test_model.py").write_text(
        "from kvfsm.testing.plugin import spec_tests\n"
        'test_specs = spec_tests("../specs", drivers={"kv_request": "drivers:StoreSender", '
        '"cpu_hit_load": "drivers:UnpinsOnlyLoadedHits"}, seed=0)\n'
    )
    result = pytest_in(root, "tests")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "1 failed, 1 passed" in out
    assert "test_specs[cpu_hit_load]" in out
    assert "t=0.0 hit req-1: matching → pinned" in out and "observe says cpu_pin still held by req-1" in out
    assert "repeat with --kvfsm-seed 0" in out
    assert "Traceback" not in out


def test_a_spec_without_a_driver_fails_naming_it(tmp_path: Path) -> None:
    root = project(tmp_path)
    (root / "test_model.py").write_text(
        "from kvfsm.testing.plugin import spec_tests\n"
        'test_specs = spec_tests("specs", drivers={"kv_request": "drivers:StoreSender"})\n'
    )
    result = pytest_in(root, "test_model.py", "-k", "cpu_hit_load")
    assert result.returncode == 1
    assert "no driver for machine 'cpu_hit_load'" in result.stdout and "add it to drivers=" in result.stdout


def test_one_line_of_pytest_configuration_with_the_plugin(tmp_path: Path) -> None:
    root = project(
        tmp_path,
        'testpaths = ["specs"]\nkvfsm_specs = [\n  "specs/kv_request.yaml = drivers:StoreSender",\n'
        '  "specs/cpu_hit_*.yaml = drivers:UnpinsOnlyLoadedHits",\n]\n',
    )
    result = pytest_in(root, "-p", "kvfsm.testing.plugin", "--kvfsm-seed", "1", "-rA")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "1 failed, 1 passed" in out
    assert "PASSED specs/kv_request.yaml::model[kv_request]" in out
    assert "FAILED specs/cpu_hit_load.yaml::model[cpu_hit_load]" in out
    assert "observe says cpu_pin still held by req-1" in out and "Traceback" not in out


def test_the_plugin_does_nothing_unless_configured(tmp_path: Path) -> None:
    root = project(tmp_path, 'testpaths = ["specs"]\n')
    result = pytest_in(root, "-p", "kvfsm.testing.plugin")
    assert result.returncode == 5, result.stdout + result.stderr  # pytest: no tests collected
    assert "no tests ran" in result.stdout


def test_examples_option_runs_a_longer_campaign(tmp_path: Path) -> None:
    root = project(tmp_path, 'kvfsm_specs = ["specs/kv_request.yaml = drivers:TaskDoneFreesBlocks"]\n')
    result = pytest_in(root, "-p", "kvfsm.testing.plugin", "specs/kv_request.yaml", "--kvfsm-examples", "300")
    assert result.returncode == 1
    assert " of 300)" in result.stdout and "task_done() raised PoolCorrupted" in result.stdout


def test_an_unexercised_edge_fails_the_test_unless_the_bar_is_lowered(tmp_path: Path) -> None:
    """The coverage verdict, as kvfsm test gives it: spec_tests and the plugin's exemption file."""
    root = project(
        tmp_path,
        'testpaths = ["tests", "specs"]\nkvfsm_specs = ["specs/kv_producer_peer.yaml = drivers:NeedsPeer"]\n'
        'kvfsm_exempt = "exempt.yaml"\n',
    )
    (root / "specs" / "kv_producer_peer.yaml").write_text(PEER_SPEC)
    (root / "exempt.yaml").write_text('kv_producer_peer: {"deadline of writing": tested against the real peer}\n')
    (root / "tests").mkdir()
    (root / "tests" / "test_model.py").write_text(
        "from kvfsm.testing.plugin import spec_tests\n"
        'test_strict = spec_tests("../specs/kv_producer_peer.yaml", drivers="drivers:NeedsPeer", seed=0, examples=5)\n'
        'test_lowered = spec_tests("../specs/kv_producer_peer.yaml", drivers="drivers:NeedsPeer", seed=0, examples=5,'
        " min_coverage=0.5)\n"
    )
    result = pytest_in(root, "-p", "kvfsm.testing.plugin", "--kvfsm-examples", "5", "-rA")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "2 failed, 1 passed" in out  # test_strict and the plugin's item fail; test_lowered passes
    assert "PASSED tests/test_model.py::test_lowered" in out
    assert "not reached: saved --remote_ready--> writing: behind a payload the test cannot produce" in out
    assert "Traceback" not in out
