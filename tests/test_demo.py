"""`kvfsm demo`: the P/D job's ledger and exit code, and the tour run for real at --quick sizes.

One in-process JSON run is shared by the tests that read its figures; the
console script runs once in a subprocess, from a directory that is not the
repository, as a new user would run it.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from kvfsm.cli import main
from kvfsm.cli.demo import PART_NAMES
from kvfsm.showcase.demo import NAMES, SPECS
from kvfsm.spec import is_system_file

ROOT = Path(__file__).resolve().parent.parent
BROKEN = ROOT / "tests" / "specs" / "broken"


def demo(*args: str) -> tuple[int, str]:
    """``kvfsm demo ARGS`` through the CLI's main, in this process: (exit code, stdout)."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["demo", *args])
    return code, buf.getvalue()


def console(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The ``kvfsm`` console script run from ``cwd``, as a new user runs it."""
    script = Path(sys.executable).with_name("kvfsm")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "kvfsm.cli"]
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("demo")
    code, text = demo("--tour", "--quick", "--format", "json", "--out", str(out))
    return code, json.loads(text), out


def test_the_quick_demo_exits_zero_with_every_part_as_expected(quick: tuple[int, dict[str, Any], Path]) -> None:
    code, doc, _out = quick
    assert code == 0, json.dumps(doc, indent=1)[:3000]
    assert doc["ok"] is True and doc["quick"] is True
    assert list(doc["parts"]) == list(NAMES)
    assert all(part["ok"] for part in doc["parts"].values())


def test_every_bundled_spec_is_checked_and_none_has_an_error(quick: tuple[int, dict[str, Any], Path]) -> None:
    specs = quick[1]["parts"]["check"]["specs"]
    bundled = sorted(str(p.relative_to(SPECS.parent)) for p in SPECS.rglob("*.yaml"))
    assert sorted(s["spec"] for s in specs) == bundled
    kinds = {s["spec"]: s["kind"] for s in specs}
    assert kinds["specs/pd_abort/merged_fix.yaml"] == "system" and kinds["specs/kv_request.yaml"] == "machine"
    correct = [s for s in specs if not s["pre_fix"]]
    assert all(s["errors"] == 0 and s["verdict"] != "errors" for s in correct)
    pre_fix = {s["spec"]: s for s in specs if s["pre_fix"]}
    assert "specs/moriio/write_producer_pre_fix.yaml" in pre_fix  # seed 001, kept to be rejected
    assert all(s["verdict"] == "rejected" and "KVF107" in s["codes"] for s in pre_fix.values())


def test_every_machine_spec_is_drawn_to_nonempty_files(quick: tuple[int, dict[str, Any], Path]) -> None:
    _code, doc, out = quick
    part = doc["parts"]["diagrams"]
    machines = {p.stem for p in SPECS.rglob("*.yaml") if not is_system_file(p)}
    assert {Path(d["mermaid"]).stem for d in part["drawings"]} == machines
    for stem in machines:
        assert (out / "diagrams" / f"{stem}.mmd").read_text().count("stateDiagram") == 1
        if shutil.which("dot"):
            assert (out / "diagrams" / f"{stem}.svg").read_bytes().lstrip().startswith(b"<?xml")
    assert part["svg_skipped"] is None or not shutil.which("dot")


def test_the_offload_soak_leaks_nothing_under_preemptions_and_aborts_mid_load(
    quick: tuple[int, dict[str, Any], Path],
) -> None:
    r = quick[1]["parts"]["offload"]
    assert r["requests"] > 0 and r["preempted"] > 0 and r["aborted_mid_load"] > 0
    assert r["leaked_cpu_refs"] == {} and r["leaked_gpu_refs"] == {}
    assert r["live_instances"] == 0 and r["unfinished_requests"] == 0 and r["stale_blocks"] == 0
    assert r["assertion_failures"] == [] and r["clean"] is True


def test_the_mooncake_soak_leaks_nothing_while_the_pre_fix_sender_leaks_under_the_same_faults(
    quick: tuple[int, dict[str, Any], Path],
) -> None:
    part = quick[1]["parts"]["mooncake"]
    fixed, unfixed = part["kvfsm"], part["pre_fix"]
    assert fixed["requests"] == part["requested"] and fixed["faults"] > 0
    assert fixed["leaked_blocks"] == 0 and fixed["hung_requests"] == 0 and fixed["clean"] is True
    assert unfixed["faults"] > 0
    assert unfixed["leaked_blocks"] > 0, "the pre-fix sender's failed jobs keep their pins"
    assert unfixed["hung_requests"] == 0, "the engine, not the driver, knows a request's last job ended"


def test_the_explorer_finds_write_after_free_in_the_merged_fix_and_verifies_the_corrected_protocol(
    quick: tuple[int, dict[str, Any], Path],
) -> None:
    part = quick[1]["parts"]["explore"]
    merged, corrected = part["merged_fix"], part["corrected"]
    assert merged["verdict"] == "violated" and "write_after_free" in merged["violated"]
    assert merged["trace"]["property"] == "write_after_free" and merged["trace"]["steps"]
    assert corrected["verdict"] == "verified" and corrected["complete"] and corrected["states"] > 0


def test_the_text_output_shows_the_trace_and_ends_with_the_verdict(tmp_path: Path) -> None:
    code, text = demo("--tour", "--only", "explore", "--quick", "--out", str(tmp_path))
    assert code == 0
    assert "write_after_free" in text and "abort_req" in text and "shortest trace" in text
    assert text.rstrip().splitlines()[-1].startswith("✓ every part came out as expected")


def test_a_broken_spec_makes_the_demo_exit_one(tmp_path: Path) -> None:
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(SPECS / "kv_request.yaml", specs)
    shutil.copy(BROKEN / "kvf107_no_deadline.yaml", specs)
    code, text = demo("--specs", str(specs), "--out", str(tmp_path / "out"), "--only", "check", "--format", "json")
    assert code == 1
    verdicts = {s["spec"]: (s["verdict"], s["codes"]) for s in json.loads(text)["parts"]["check"]["specs"]}
    assert verdicts == {
        "specs/kv_request.yaml": ("clean", []),
        "specs/kvf107_no_deadline.yaml": ("errors", ["KVF107"]),
    }


def test_without_graphviz_the_mermaid_is_written_and_the_svg_skip_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on it
    code, text = demo("--only", "diagrams", "--out", str(tmp_path / "out"))
    assert code == 0, text
    assert "svg skipped" in text and "graphviz" in text
    assert list((tmp_path / "out" / "diagrams").glob("*.svg")) == []
    assert (tmp_path / "out" / "diagrams" / "kv_request.mmd").stat().st_size > 0


def test_an_unknown_part_is_a_usage_error_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, _text = demo("--only", "everything")
    assert code == 2
    err = capsys.readouterr().err
    assert "everything" in err and "check, diagrams" in err and "Traceback" not in err


def test_the_help_names_every_part() -> None:
    assert ", ".join(NAMES) == PART_NAMES


def test_the_console_script_runs_the_quick_demo_from_any_directory(tmp_path: Path) -> None:
    result = console(tmp_path, "demo", "--tour", "--quick", "--format", "json", "--out", "tmp")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    doc = json.loads(result.stdout)
    assert doc["ok"] is True
    assert (tmp_path / "tmp" / "diagrams" / "kv_request.mmd").stat().st_size > 0


# -- the P/D job (the default) --------------------------------------------------------


def test_the_default_demo_runs_the_pd_job_and_exits_zero_on_a_clean_ledger_with_faults_injected(tmp_path: Path) -> None:
    result = console(tmp_path, "demo", "--requests", "300", "--concurrency", "32", "--format", "json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    doc = json.loads(result.stdout)
    assert doc["driver"] == "pd" and doc["protocol"] == "corrected" and doc["backend"] == "embedded"
    assert doc["requests"] == doc["finished"] == 300
    assert doc["leaked_blocks"] == 0 and doc["hung"] == 0 and doc["corrupted"] == 0 and doc["clean"] is True
    assert sum(doc["faults_injected"].values()) > 0 and doc["faults_injected"]["kill"] == 1
    assert set(doc["latency_ms"]) == {"p50", "p90", "p99", "max"}


def test_the_merged_fix_demo_reports_corrupted_pages_and_exits_one() -> None:
    code, text = demo("--protocol", "merged_fix", "--requests", "600", "--concurrency", "32", "--fault-rate", "0.2",
                      "--seed", "4")  # fmt: skip
    assert code == 1
    assert "pages corrupted" in text and "write-after-free" in text and "merged_fix.yaml" in text


def test_the_text_ledger_names_every_figure_and_ends_with_the_verdict() -> None:
    code, text = demo("--requests", "200", "--concurrency", "16")
    assert code == 0, text
    for figure in ("pages leaked", "requests hung", "pages corrupted", "faults injected", "listener drops", "latency"):
        assert figure in text
    assert text.rstrip().splitlines()[-1].startswith("✓ clean ledger")


def test_a_bad_fault_rate_is_a_usage_error_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    code, _text = demo("--fault-rate", "2")
    assert code == 2
    err = capsys.readouterr().err
    assert "not a probability" in err and "Traceback" not in err


@pytest.mark.mooncake
def test_the_real_backend_demo_runs_over_the_mooncake_transfer_engine() -> None:
    pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine wheel cannot import here")
    code, text = demo("--backend", "real", "--requests", "200", "--concurrency", "16", "--format", "json")
    doc = json.loads(text)
    assert code == 0 and doc["backend"] == "real" and doc["clean"] is True, text[-2000:]


# -- the MoRIIO job (--driver moriio, seed 001) ---------------------------------------


@pytest.mark.parametrize("mode", ["write", "read"])
def test_the_moriio_demo_runs_a_clean_ledger_with_faults_injected(mode: str) -> None:
    code, text = demo("--driver", "moriio", "--mode", mode, "--requests", "300", "--concurrency", "64",
                      "--format", "json")  # fmt: skip
    doc = json.loads(text)
    assert code == 0 and doc["clean"] is True, text[-2000:]
    assert doc["driver"] == "moriio" and doc["mode"] == mode and doc["finished"] == 300
    assert doc["leaked_blocks"] == doc["hung"] == doc["late"] == doc["corrupted"] == 0
    assert sum(doc["faults_injected"].values()) > 0 and doc["verified_blocks"] > 0


def test_the_moriio_pre_fix_demo_hangs_and_exits_one() -> None:
    code, text = demo("--driver", "moriio", "--pre-fix", "--requests", "1024", "--concurrency", "512")
    assert code == 1
    assert "requests hung" in text and "seed 001" in text and "KVF107" in text


def test_moriio_read_mode_has_no_pre_fix_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, _text = demo("--driver", "moriio", "--mode", "read", "--pre-fix")
    assert code == 2 and "WRITE-mode" in capsys.readouterr().err


@pytest.mark.mooncake_te
def test_the_moriio_demo_on_the_real_transfer_engine_across_processes() -> None:
    code, text = demo("--driver", "moriio", "--backend", "real", "--requests", "300", "--concurrency", "64",
                      "--format", "json")  # fmt: skip
    doc = json.loads(text)
    assert code == 0 and doc["backend"] == "real" and doc["clean"] is True, text[-2000:]


def test_metrics_takes_a_port_pair_and_refuses_one_that_cannot_be_served(tmp_path: Path) -> None:
    """--metrics PORT: prefill there, decode on the next, the same across a restart; a bad one is a usage error."""
    result = console(tmp_path, "demo", "--metrics", "80")
    assert result.returncode == 2 and "not a port from 1024 to 65534" in result.stderr
