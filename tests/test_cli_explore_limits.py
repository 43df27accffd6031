"""`kvfsm explore` is bounded by default, checks sizes before it builds anything, shows progress, and stops on Ctrl-C.

- ``-n``, a system's ``requests:`` and a role's ``ranks:`` are checked
  against their bounds before any state is built (a start state of a billion
  requests is a billion-entry tuple);
- the search stops at a default state bound and a default time bound (the
  verdict is then *incomplete*, exit 3), which ``--max-states`` and
  ``--time-limit`` change;
- progress goes to stderr as plain lines when stderr is not a terminal, and
  with ``--progress`` (a rich bar only on a terminal);
- Ctrl-C (SIGINT) prints what was found so far, counterexamples included, with
  the verdict *incomplete*, and exits 130.

The runs that could grow run in a child under an address-space limit.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvfsm.cli
import kvfsm.cli.explore

ROOT = Path(__file__).resolve().parent.parent
PD = ROOT / "specs" / "pd_abort"
MERGED, CORRECTED = PD / "merged_fix.yaml", PD / "corrected.yaml"
CRASH = ROOT / "specs" / "explore" / "pd_prefill_crash.yaml"
MEMORY = 1 << 30


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def explore(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "explore", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        preexec_fn=_limit_memory,
    )


def cli(*args: str) -> tuple[int, str, str]:
    """``kvfsm`` in process: (exit status, stdout, stderr); stderr is no terminal here."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = kvfsm.cli.main(list(args))
    return status, stdout.getvalue(), stderr.getvalue()


def _edited(tmp_path: Path, old: str, new: str) -> Path:
    """A copy of the corrected PD system with one edit, its role specs named by absolute path."""
    text = CORRECTED.read_text().replace("spec: ", f"spec: {PD}/")
    assert old in text
    path = tmp_path / "system.yaml"
    path.write_text(text.replace(old, new))
    return path


# -- sizes are checked before anything is built ------------------------------------------------


def test_a_billion_requests_is_refused_before_the_start_state_is_built() -> None:
    result = explore(str(CORRECTED), "-n", "1000000000")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--requests must be at most" in result.stderr
    assert "internal error" not in result.stderr and "MemoryError" not in result.stderr


def test_a_system_asking_for_a_billion_requests_is_refused(tmp_path: Path) -> None:
    result = explore(str(_edited(tmp_path, "requests: 6", "requests: 1000000000")))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "1,000,000,000 requests" in result.stderr and "-n" in result.stderr
    assert "internal error" not in result.stderr


def test_a_role_with_a_hundred_million_ranks_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    system = _edited(tmp_path, "prefill_corrected.yaml,", "prefill_corrected.yaml, ranks: 100000000,")
    result = explore(str(system))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "100,000,000 ranks" in result.stderr
    assert "internal error" not in result.stderr


def test_a_trace_replayed_on_a_system_too_big_to_explore_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    assert explore(str(MERGED), "-n", "1", "--trace", str(trace)).returncode == 1
    system = _edited(tmp_path, "prefill_corrected.yaml,", "prefill_corrected.yaml, ranks: 100000000,")
    result = subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "test", str(system), "--trace", str(trace)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        preexec_fn=_limit_memory,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "100,000,000 ranks" in result.stderr and "internal error" not in result.stderr


def test_the_promela_export_takes_the_same_bound(tmp_path: Path) -> None:
    result = explore(str(CORRECTED), "-n", "1000000000", "--promela", str(tmp_path / "m.pml"))
    assert result.returncode == 2 and "--requests must be at most" in result.stderr
    assert not (tmp_path / "m.pml").exists()


# -- default bounds --------------------------------------------------------------------------


def test_the_search_stops_at_the_default_state_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvfsm.cli.explore, "DEFAULT_MAX_STATES", 1000)
    status, out, _err = cli("explore", str(CORRECTED), "-n", "3")
    text = " ".join(out.split())
    assert status == 3, out
    assert "incomplete" in text and "the state bound (1,000 states, the default; --max-states changes it)" in text


def test_the_search_stops_at_the_default_time_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvfsm.cli.explore, "DEFAULT_TIME_LIMIT", 1e-9)
    status, out, _err = cli("explore", str(CORRECTED), "-n", "3", "--format", "json")
    doc = json.loads(out)
    assert status == 3 and doc["verdict"] == "incomplete"
    assert doc["stopped"] == "time_limit" and doc["time_limit"] == 1e-9


def test_json_names_the_bounds_a_run_had() -> None:
    status, out, _err = cli("explore", str(CORRECTED), "-n", "2", "--format", "json")
    doc = json.loads(out)
    assert status == 0 and doc["verdict"] == "verified" and doc["stopped"] is None
    assert doc["max_states"] == kvfsm.cli.explore.DEFAULT_MAX_STATES
    assert doc["time_limit"] == kvfsm.cli.explore.DEFAULT_TIME_LIMIT
    status, out, _err = cli(
        "explore", str(CORRECTED), "-n", "2", "--format", "json", "--max-states", "none", "--time-limit", "none"
    )
    doc = json.loads(out)
    assert status == 0 and doc["max_states"] is None and doc["time_limit"] is None


@pytest.mark.parametrize("flag", ["--max-states", "--time-limit"])
def test_bounds_must_be_positive_numbers_or_none(flag: str) -> None:
    status, _out, err = cli("explore", str(CORRECTED), flag, "0")
    assert status == 2 and "must be" in err and "none" in err


# -- progress ----------------------------------------------------------------------------------


def test_progress_goes_to_stderr_as_lines_when_stderr_is_no_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvfsm.cli.explore, "PROGRESS_EVERY", 0.0)
    status, out, err = cli("explore", str(CORRECTED), "-n", "3", "--format", "json")
    assert status == 0 and json.loads(out)["verdict"] == "verified"  # stdout stays the document
    lines = [line for line in err.splitlines() if line.startswith("explore pd_abort_corrected:")]
    assert len(lines) >= 2 and any("states/s" in line for line in lines), err


def test_progress_flag_prints_the_start_and_the_end() -> None:
    result = explore(str(CORRECTED), "-n", "2", "--progress")
    assert result.returncode == 0, result.stderr
    assert "explore pd_abort_corrected: searching 2 request(s)" in result.stderr
    assert "explore pd_abort_corrected: done:" in result.stderr


# -- Ctrl-C ------------------------------------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    """CPU time a process has used (user + system), from /proc: how far it got, whatever the load."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _interrupted(*args: str) -> tuple[int, str, str]:
    """Start a long search, let it use 3 s of CPU (well into the search), send SIGINT; (exit status, stdout, stderr).

    CPU time, not wall time: on a loaded machine the child may wait for a core long before it searches.
    """
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvfsm.cli", "explore", *args, "--time-limit", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=_limit_memory,
    )
    try:
        deadline = time.monotonic() + 90
        while proc.poll() is None and _cpu_seconds(proc.pid) < 3.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the search ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_ctrl_c_prints_what_was_explored_and_exits_130() -> None:
    status, out, err = _interrupted(str(CRASH), "-n", "6", "--no-merge", "--no-symmetry")
    text = " ".join(out.split())
    assert status == 130, out + err
    assert "incomplete" in text and "interrupted (Ctrl-C)" in text
    assert " states, " in text and "Traceback" not in err


def test_ctrl_c_keeps_the_counterexamples_found_so_far() -> None:
    status, out, err = _interrupted(str(MERGED), "-n", "6", "--no-merge", "--no-symmetry", "--format", "json")
    assert status == 130, out + err
    doc = json.loads(out)
    assert doc["interrupted"] is True and doc["stopped"] == "interrupted"
    found = [p for p in doc["properties"] if p["status"] == "violated"]
    assert [p["name"] for p in found] == ["write_after_free"] and found[0]["trace"]["steps"]
