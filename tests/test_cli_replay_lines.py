"""`kvfsm replay` holds at most a bounded line in memory, whatever the log's lines are.

A journal line is a few hundred bytes. A line longer than
:data:`kvfsm.replay.read.MAX_LINE` is a KVF301 finding at its line and is
skipped (the lines after it are checked); a "line" that runs on past
:data:`kvfsm.replay.read.MAX_SKIP` with no newline (``/dev/zero``, a disk
image) stops the reading there with a KVF300 finding. The big cases run in a
child under an address-space limit far below the line's size, so a reader
that holds a whole line fails fast with MemoryError instead of eating the
machine.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "specs" / "kv_request.yaml"
MEMORY = 512 << 20

HEAD = b'{"journal":1,"machine":"kv_request","pid":1,"opened":0.0}\n'
A = (
    b'{"key":"a","generation":1,"event":"begin","from":"","to":"pinned","time":1.0}\n'
    b'{"key":"a","generation":1,"event":"abort","from":"pinned","to":"aborted","time":1.5}\n'
)
B_WRONG = (
    b'{"key":"b","generation":2,"event":"begin","from":"","to":"pinned","time":2.0}\n'
    b'{"key":"b","generation":2,"event":"abort","from":"pinned","to":"done","time":2.5}\n'  # KVF309: abort goes to aborted
)


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def replay(*args: str, stdin: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``kvfsm replay SPEC ...`` in a child under :data:`MEMORY`."""
    with (stdin or Path("/dev/null")).open("rb") as source:
        return subprocess.run(
            [sys.executable, "-m", "kvfsm.cli", "replay", str(SPEC), *args],
            stdin=source,
            capture_output=True,
            text=True,
            errors="replace",
            cwd=ROOT,
            timeout=120,
            preexec_fn=_limit_memory,
        )


def test_a_line_over_the_bound_is_a_finding_at_its_line_and_the_lines_after_it_are_checked(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    log.write_bytes(HEAD + A + b'{"key":"' + b"x" * (5 << 20) + b'"}\n' + B_WRONG)
    result = replay(str(log), "--all")
    text = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{log}:4: error KVF301 not a journal line: it is longer than 1 MiB" in text
    assert f"{log}:6: error KVF309" in text  # reading went on past it
    assert "internal error" not in result.stdout + result.stderr


def test_a_line_that_never_ends_stops_the_reading_with_bounded_memory(tmp_path: Path) -> None:
    """A 600 MiB run of NUL bytes (a sparse hole: no disk) after a bad line: the bad line is reported, then the stop."""
    log = tmp_path / "holed.jsonl"
    with log.open("wb") as f:
        f.write(HEAD + B_WRONG)
        f.seek(600 << 20, 1)
        f.write(b"\n" + A)
    result = replay(str(log), "--all")
    text = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{log}:3: error KVF309" in text
    assert f"{log}:4: error KVF300" in text and "no newline" in text
    assert "internal error" not in result.stdout + result.stderr and "MemoryError" not in result.stderr


def test_dev_zero_on_stdin_stops_at_line_one_with_bounded_memory() -> None:
    result = replay("-", stdin=Path("/dev/zero"))
    text = " ".join(result.stdout.split())
    assert result.returncode == 1, result.stdout + result.stderr
    assert "<stdin>:1: error KVF300" in text and "no newline" in text
    assert "internal error" not in result.stdout + result.stderr


def test_check_log_bounds_lines_it_is_handed_too() -> None:
    """The Python API's iterable of lines gets the same bound: an overlong line is a KVF301, not a decode of it."""
    from kvfsm.replay import check_log, codes
    from kvfsm.replay.read import MAX_LINE

    report = check_log(SPEC, [HEAD, b"[" * (MAX_LINE + 1) + b"\n", *A.splitlines(keepends=True)])
    assert [(f.code, f.line) for f in report.findings] == [(codes.MALFORMED, 2)]
    assert "longer than 1 MiB" in report.findings[0].message
