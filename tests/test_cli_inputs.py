"""Every file a `kvfsm` subcommand reads is read with a bound: bad input is a clear exit 2, never a hang or an OOM.

Each surface (a subcommand and the argument that names a file) is fed a file
larger than any spec, ``/dev/zero``, a FIFO nobody writes to, a directory, a
binary file and a file that is not UTF-8. The commands run in a child process
under an address-space limit (``RLIMIT_AS``) and a wall-clock timeout, so a
regression that reads a device whole fails with MemoryError in a second
instead of eating the machine, and one that blocks on the FIFO fails at the
timeout instead of hanging the suite. Each input runs in-process in that
child through ``kvfsm.cli.main``, the real entry point, so one child start
covers a whole surface.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SPEC = ROOT / "specs" / "kv_request.yaml"
SYSTEM = ROOT / "specs" / "pd_abort" / "corrected.yaml"
MEMORY = 768 << 20
"""The child's address space: ten times what any of these commands needs, far below reading a device whole."""
CPU_SECONDS = 10.0
"""CPU time one refusal may take (CPU, not wall time: the suite shares two cores with other work)."""

CHILD = r"""
import contextlib, io, json, sys, time, traceback
import kvfsm.cli

for argv in json.loads(sys.argv[1]):
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="replace")
    stderr = io.StringIO()
    started = time.process_time()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = kvfsm.cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    except BaseException:
        rc, stderr = "raised", io.StringIO(traceback.format_exc())
    stdout.flush()
    text = stdout.buffer.getvalue().decode("utf-8", "replace") + stderr.getvalue()
    print(json.dumps({"argv": argv, "rc": rc, "text": text[-4000:], "cpu": time.process_time() - started}), flush=True)
"""


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def run_batch(argvs: list[list[str]], *, timeout: float = 60) -> list[dict[str, object]]:
    """Run each argv through ``kvfsm.cli.main`` in one memory-limited child; one result per argv, in order."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(argvs)],
            capture_output=True,
            text=True,
            cwd=TESTS,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])},  # this checkout's kvfsm
            timeout=timeout,
            preexec_fn=_limit_memory,
        )
    except subprocess.TimeoutExpired as exc:
        done = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        hung = argvs[len(done.splitlines())]
        pytest.fail(f"kvfsm {' '.join(hung)} did not finish within {timeout} s (a blocking read?)")
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == len(argvs), f"the child died after {len(results)} of {len(argvs)}: {proc.stderr[-2000:]}"
    return results


# -- the bad inputs ------------------------------------------------------------------------


def _huge(folder: Path) -> Path:
    """A 4 GiB file (sparse: it costs no disk), larger than any input may be."""
    path = folder / "huge.yaml"
    with path.open("wb") as f:
        f.write(b"kvfsm: 1\nmachine: huge\n")
        f.truncate(4 << 30)
    return path


def _fifo(folder: Path) -> Path:
    path = folder / "fifo.yaml"
    os.mkfifo(path)
    return path


def _directory(folder: Path) -> Path:
    path = folder / "a_directory.yaml"
    path.mkdir()
    return path


def _binary(folder: Path) -> Path:
    path = folder / "binary.yaml"
    path.write_bytes(Path(sys.executable).read_bytes()[:65536])  # an ELF header and code: NULs and all
    return path


def _not_utf8(folder: Path) -> Path:
    path = folder / "latin1.yaml"
    path.write_bytes("kvfsm: 1\nmachine: café\nkey: request_id\n".encode("latin-1"))
    return path


@dataclass(frozen=True)
class Bad:
    name: str
    make: Callable[[Path], Path]
    says: str
    """What the message must say about the file."""


BAD = [
    Bad("huge", _huge, "more than the"),
    Bad("dev_zero", lambda _folder: Path("/dev/zero"), "character device"),
    Bad("fifo", _fifo, "FIFO"),
    Bad("directory", _directory, "directory"),
    Bad("binary", _binary, "binary"),
    Bad("not_utf8", _not_utf8, "not UTF-8"),
]


def _with_role(folder: Path, role_spec: Path) -> Path:
    """A copy of the corrected PD system whose decode role names ``role_spec``."""
    text = SYSTEM.read_text().replace("decode_corrected.yaml", str(role_spec))
    text = text.replace("prefill_corrected.yaml", str(SYSTEM.parent / "prefill_corrected.yaml"))
    path = folder / "system.yaml"
    path.write_text(text)
    return path


SURFACES: dict[str, Callable[[Path, Path], list[str]]] = {
    "check SPEC": lambda bad, _tmp: ["check", str(bad)],
    "check SYSTEM's role spec": lambda bad, tmp: ["check", str(_with_role(tmp, bad))],
    "diagram SPEC": lambda bad, _tmp: ["diagram", str(bad), "-f", "dot"],
    "test SPEC": lambda bad, _tmp: ["test", str(bad), "--driver", "buggy_drivers:StoreSender"],
    "test --exempt FILE": lambda bad, _tmp: [
        "test",
        str(SPEC),
        "--driver",
        "buggy_drivers:StoreSender",
        "--exempt",
        str(bad),
    ],
    "test SYSTEM --trace FILE": lambda bad, _tmp: ["test", str(SYSTEM), "--trace", str(bad)],
    "explore SYSTEM": lambda bad, _tmp: ["explore", str(bad)],
    "explore SYSTEM's role spec": lambda bad, tmp: ["explore", str(_with_role(tmp, bad))],
    "replay SPEC": lambda bad, tmp: ["replay", str(bad), str(_empty_log(tmp))],
}


def _empty_log(folder: Path) -> Path:
    path = folder / "empty.jsonl"
    path.touch()
    return path


@pytest.mark.parametrize("surface", list(SURFACES))
def test_every_bad_input_is_a_clear_usage_error(tmp_path: Path, surface: str) -> None:
    argvs = []
    for bad in BAD:
        folder = tmp_path / bad.name
        folder.mkdir()
        argvs.append(SURFACES[surface](bad.make(folder), folder))
    for bad, got in zip(BAD, run_batch(argvs), strict=True):
        text = str(got["text"])
        where = f"{surface} given {bad.name}: rc {got['rc']}\n{text}"
        assert got["rc"] == 2, where
        assert "internal error" not in text and "Traceback" not in text, where
        assert bad.says in text, where
        assert float(str(got["cpu"])) < CPU_SECONDS, where


def test_a_log_that_is_no_regular_file_is_refused_and_one_that_is_damaged_is_a_finding(tmp_path: Path) -> None:
    """replay's LOG: a device, FIFO or folder is a usage error (2); a regular file's bytes are judged by line (1)."""
    logs = []
    for bad in BAD:
        folder = tmp_path / bad.name
        folder.mkdir()
        logs.append(bad.make(folder))
    for bad, log, got in zip(BAD, logs, run_batch([["replay", str(SPEC), str(log)] for log in logs]), strict=True):
        text = " ".join(str(got["text"]).split())
        where = f"replay LOG given {bad.name}: rc {got['rc']}\n{text}"
        assert "internal error" not in text and "Traceback" not in text, where
        assert float(str(got["cpu"])) < CPU_SECONDS, where
        if bad.name in ("dev_zero", "fifo", "directory"):
            assert got["rc"] == 2 and bad.says in text, where
        else:  # documented in docs/replay.md: damage is a KVF30x finding at its line
            assert got["rc"] == 1 and f"{log}:1: error KVF301" in text, where


# -- defect 1, as reported -----------------------------------------------------------------


def _kvfsm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The console entry point in a child under :data:`MEMORY`."""
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", *args],
        capture_output=True,
        text=True,
        errors="replace",
        cwd=ROOT,
        timeout=timeout,
        preexec_fn=_limit_memory,
    )


def test_check_dev_zero_is_refused_without_reading_it() -> None:
    result = _kvfsm("check", "/dev/zero")
    text = result.stdout + result.stderr
    assert result.returncode == 2, text
    assert "/dev/zero: error KVF000 is a character device, not a spec file" in " ".join(text.split())
    assert "internal error" not in text and "MemoryError" not in text


def test_a_system_whose_role_spec_is_dev_zero_names_the_role_and_exits_two(tmp_path: Path) -> None:
    result = _kvfsm("check", str(_with_role(tmp_path, Path("/dev/zero"))))
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, text
    assert "KVF200 role 'decode': cannot read its spec /dev/zero: is a character device" in text
    assert "internal error" not in text


def test_a_spec_just_over_the_bound_is_refused_and_one_under_it_is_read(tmp_path: Path) -> None:
    from kvfsm.spec.loader import MAX_SPEC_BYTES

    text = SPEC.read_text()
    under = tmp_path / "under.yaml"
    under.write_text(text + "#" * (MAX_SPEC_BYTES - len(text.encode()) - 1) + "\n")
    over = tmp_path / "over.yaml"
    over.write_text(text + "#" * (MAX_SPEC_BYTES - len(text.encode())) + "\n")
    [ok, refused] = run_batch([["check", str(under)], ["check", str(over)]])
    assert ok["rc"] == 0, ok["text"]
    assert refused["rc"] == 2 and "more than the 1.0 MiB a spec file may be" in str(refused["text"])


def test_top_reads_a_bounded_answer(tmp_path: Path) -> None:
    """`kvfsm top` reads an HTTP answer: an endless one is cut at a bound and refused, not read whole."""
    import http.server
    import threading

    class Endless(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            chunk = b"[" * 65536
            try:
                while True:
                    self.wfile.write(chunk)
            except OSError:
                pass

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = _kvfsm("top", f"http://127.0.0.1:{server.server_port}", "--once")
    finally:
        server.shutdown()
    text = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, text
    assert "more than" in text and "internal error" not in text and "MemoryError" not in text
