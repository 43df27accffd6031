"""The `kvfsm` command as a user runs it: exit codes, output formats, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CANONICAL = ROOT / "specs" / "kv_request.yaml"


def kvfsm(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the real console entry point in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_check_clean_spec_exits_zero() -> None:
    result = kvfsm("check", str(CANONICAL))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean" in result.stdout


def test_check_findings_exit_one_and_name_file_line_and_code(tmp_path: Path) -> None:
    spec = tmp_path / "leaky.yaml"
    spec.write_text(
        "kvfsm: 1\nmachine: leaky\nkey: request_id\nresources:\n  gpu_blocks: {release: free}\nstates:\n"
        "  pinned: {initial: true, holds: [gpu_blocks]}\n  done: {final: success}\n"
        "transitions:\n  - {event: abort, from: pinned, to: done}\n"
    )
    result = kvfsm("check", str(spec))
    assert result.returncode == 1
    assert f"{spec}:7" in result.stdout and "KVF107" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_check_json_lists_findings_per_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(
        "kvfsm: 1\nmachine: m\nkey: k\nstates: {a: {initial: true, waits: local}}\ntransitions: []\nbogus: 1\n"
    )
    result = kvfsm("check", "--format", "json", str(CANONICAL), str(broken))
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert [f["clean"] for f in doc["files"]] == [True, False]
    codes = {(f["code"], f["line"]) for f in doc["files"][1]["findings"]}
    assert ("KVF001", 6) in codes
    assert doc["errors"] >= 1


def test_check_takes_system_files_and_reports_composition_findings(tmp_path: Path) -> None:
    pd = ROOT / "specs" / "pd_abort"
    clean = kvfsm("check", str(pd / "corrected.yaml"), str(pd / "merged_fix.yaml"))
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for role in pd.glob("*_corrected.yaml"):
        (tmp_path / role.name).write_text(role.read_text())
    system = (pd / "corrected.yaml").read_text()
    assert "  success:   {from: prefill" in system
    broken = tmp_path / "no_success.yaml"
    broken.write_text(system.replace("  success:   {from: prefill", "  succeeded: {from: prefill"))
    result = kvfsm("check", "--format", "json", str(broken))
    assert result.returncode == 1, result.stdout
    findings = json.loads(result.stdout)["files"][0]["findings"]
    errors = {(f["code"], Path(f["path"]).name) for f in findings if f["severity"] == "error"}
    assert errors == {("KVF201", "prefill_corrected.yaml"), ("KVF203", "no_success.yaml")}, findings
    assert "Traceback" not in result.stdout + result.stderr


def test_check_missing_file_is_a_usage_error() -> None:
    result = kvfsm("check", "no/such/spec.yaml")
    assert result.returncode == 2
    assert "no such spec file" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_malformed_yaml_gives_line_and_no_traceback(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("kvfsm: 1\nmachine: [unclosed\n")
    result = kvfsm("check", str(spec))
    assert result.returncode == 1
    assert "KVF001" in result.stdout and "YAML syntax" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


def test_unknown_subcommand_is_a_usage_error() -> None:
    assert kvfsm("frobnicate").returncode == 2


@pytest.mark.parametrize("fmt, marker", [("dot", "digraph"), ("mermaid", "stateDiagram-v2"), ("svg", "<svg")])
def test_diagram_writes_each_format(tmp_path: Path, fmt: str, marker: str) -> None:
    out = tmp_path / f"kv.{fmt}"
    result = kvfsm("diagram", str(CANONICAL), "-f", fmt, "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert marker in out.read_text()


def test_diagram_of_broken_spec_reports_instead_of_crashing(tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("kvfsm: 2\n")
    result = kvfsm("diagram", str(spec), "-f", "dot")
    assert result.returncode == 2  # a spec failing its checks is unusable input here; its findings are check's
    assert "KVF001" in result.stderr and "Traceback" not in result.stderr


def test_machine_commands_given_a_system_file_say_so_in_one_line(tmp_path: Path) -> None:
    system = str(ROOT / "specs" / "pd_abort" / "merged_fix.yaml")
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    result = kvfsm("replay", system, str(log))  # a journal is one machine's: replay takes a role's spec
    assert result.returncode == 2
    text = result.stdout + result.stderr
    assert "this is a system file" in text and text.count("KVF001") == 1
    assert "Traceback" not in text


def test_replay_refuses_a_param_that_is_no_deadline(tmp_path: Path) -> None:
    log = tmp_path / "empty.jsonl"
    log.write_text("")
    result = kvfsm("replay", str(CANONICAL), str(log), "--param", "transfer_timeout=-5")
    assert result.returncode == 2
    assert "finite, non-negative" in result.stdout + result.stderr


def test_an_output_path_that_is_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    result = kvfsm("diagram", str(CANONICAL), "-f", "svg", "-o", str(tmp_path))
    assert result.returncode == 2
    assert "is a directory; name a file in it" in result.stderr
    assert "Errno" not in result.stderr and "Traceback" not in result.stderr
