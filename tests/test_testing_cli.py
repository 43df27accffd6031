"""`kvfsm test` as a user runs it: exit codes, the failure story, coverage, JSON, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from buggy_drivers import KV_REQUEST, write_cpu_hit_spec

TESTS = Path(__file__).resolve().parent


def kvfsm_test(*args: str, cwd: Path = TESTS) -> subprocess.CompletedProcess[str]:
    """The real console entry point, from tests/ so that buggy_drivers is importable as MODULE."""
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "test", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_a_seed_000_driver_fails_with_its_story_and_exit_one() -> None:
    result = kvfsm_test(str(KV_REQUEST), "--driver", "buggy_drivers:SkipsDecOnPutError", "--seed", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert "✗ kv_request: the driver diverged from the spec" in lines[0]
    assert lines[1:4] == [
        "  t=0.0 begin req-1 → pinned",
        "  t=0.0 enqueue req-1: pinned → queued",
        "  t=0.0 start req-1: start_transfer() raised (injected fault), so fail req-1: queued → failed; "
        "observe says gpu_blocks still held by req-1 (req-1 is failed, which holds nothing)",
    ]
    assert "repeat with: kvfsm test" in result.stdout and "--seed 0" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_a_seed_003_driver_fails_from_the_cli(tmp_path: Path) -> None:
    spec = write_cpu_hit_spec(tmp_path)
    result = kvfsm_test(str(spec), "--driver", "buggy_drivers:UnpinsOnlyLoadedHits", "--seed", "1")
    assert result.returncode == 1
    assert "hit req-1: matching → pinned" in result.stdout
    assert "observe says cpu_pin still held by req-1" in result.stdout


def test_a_correct_driver_passes_with_a_coverage_table_and_overlay(tmp_path: Path) -> None:
    svg = tmp_path / "cov" / "kv_request.svg"
    result = kvfsm_test(
        str(KV_REQUEST), "--driver", "buggy_drivers:StoreSender", "--seed", "0", "--coverage-svg", str(svg)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "✓ kv_request: the driver kept to the spec" in result.stdout
    assert "transition coverage" in result.stdout
    assert "expire (deadline)" in result.stdout and "deadline of transferring (expire): fired" in result.stdout
    assert "edges 10/10" in result.stdout
    text = svg.read_text()
    assert text.startswith("<?xml") and "transition coverage: 10 of 10 edges taken" in text


def test_json_gives_the_story_seed_and_all_of_the_coverage() -> None:
    result = kvfsm_test(
        str(KV_REQUEST), "--driver", "buggy_drivers:TaskDoneFreesBlocks", "--seed", "2", "--format", "json"
    )
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert doc["passed"] is False and doc["seed"] == 2 and doc["driver"] == "buggy_drivers:TaskDoneFreesBlocks"
    assert doc["machine"] == "kv_request" and doc["examples"] == 100
    assert "task_done() raised PoolCorrupted" in doc["failure"]["story"][-1]
    cov = doc["coverage"]
    assert {"edges", "timeouts", "ignored", "illegal", "faults", "summary", "unknown_key_events"} <= set(cov)
    assert len(cov["edges"]) == 10 and all({"source", "event", "target", "taken", "by"} <= set(e) for e in cov["edges"])
    assert cov["timeouts"] == [{"state": "transferring", "event": "expire", "fired": cov["timeouts"][0]["fired"]}]


def test_examples_and_steps_bound_the_run() -> None:
    result = kvfsm_test(
        str(KV_REQUEST), "--driver", "buggy_drivers:StoreSender", "--examples", "3", "--steps", "5", "--format", "json"
    )
    assert result.returncode == 0
    doc = json.loads(result.stdout)
    assert doc["examples"] == 3 and doc["steps"] == 5
    cov, planned = doc["coverage"], doc["planned"]
    assert planned > 0  # the path cover runs first, on top of the budget
    assert cov["examples"] - planned < 10  # Hypothesis may add a discarded example or two to the 3
    assert cov["summary"]["edges"] == {"exercised": 10, "total": 10}  # the plans reach every edge, whatever the budget


@pytest.mark.parametrize(
    ("driver", "message"),
    [
        ("buggy_drivers", "is not MODULE:FACTORY"),
        ("no_such_module:make", "cannot import driver module 'no_such_module'"),
        ("buggy_drivers:NoSuchFactory", "module 'buggy_drivers' has no 'NoSuchFactory'"),
        ("buggy_drivers:KV_REQUEST", "is a PosixPath, not a callable"),
        ("buggy_drivers:NoObserve", "NoObserve has no observe(key) method"),
        ("buggy_drivers:LacksTaskDone", "lacks method(s) task_done"),
    ],
)
def test_a_bad_driver_is_a_usage_error_without_a_traceback(driver: str, message: str) -> None:
    result = kvfsm_test(str(KV_REQUEST), "--driver", driver)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in " ".join((result.stdout + result.stderr).split())
    assert "Traceback" not in result.stdout + result.stderr


def test_bad_numbers_and_missing_specs_are_usage_errors(tmp_path: Path) -> None:
    bad = kvfsm_test(str(KV_REQUEST), "--driver", "buggy_drivers:StoreSender", "--examples", "0")
    assert bad.returncode == 2 and "not a positive whole number" in bad.stderr
    missing = kvfsm_test(str(tmp_path / "nope.yaml"), "--driver", "buggy_drivers:StoreSender")
    assert missing.returncode == 2 and "no such spec file" in missing.stdout + missing.stderr
