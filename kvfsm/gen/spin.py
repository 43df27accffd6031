"""Run SPIN on a model :mod:`kvfsm.gen.promela` exported: ``spin -a``, ``gcc``, ``./pan``, and read its verdicts.

Apart from the export so that the export stays a pure function of the spec
model (what ``kvfsm explore --promela`` writes) and this module alone spawns
processes, with their time and memory bounds.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .promela import NOBODY

SPIN_TOOLS = ("spin", "gcc")
"""What :func:`check_with_spin` needs on PATH (Debian packages ``spin`` and ``gcc``)."""


@dataclass(frozen=True)
class SpinResult:
    """What one ``spin -a`` + ``gcc`` + ``./pan`` run found."""

    states: int
    """States stored: the reachable states when ``complete``; else as far as pan's last progress line got."""
    violated: tuple[str, ...]
    """With ``report``: every property some reachable step breaks. Without: the one assertion that stopped pan."""
    errors: int
    complete: bool
    """pan explored everything: no time, memory or depth limit was hit and no error stopped it."""
    seconds: float
    """pan's own run time (compiling excluded)."""
    found_at: dict[str, float]
    """With ``report``: seconds into pan's run when each violated property was first reported."""
    output: str
    memory_mb: float = 0.0
    """pan's own figure for the memory it used in all (its "total actual memory usage")."""


def check_with_spin(
    text: str,
    workdir: str | Path,
    *,
    report: bool = True,
    only: int | None = None,
    timeout: float = 60.0,
    memory_mb: int = 4096,
    depth: int = 5_000_000,
    hash_bits: int = 26,
    optimise: str = "-O2",
    best: bool = False,
) -> SpinResult:
    """Run SPIN on an exported model in ``workdir``: ``spin -a``, ``gcc -DSAFETY -DNOREDUCE``, ``./pan``.

    ``report``: explore everything and list each violated property (``-DREPORT``);
    otherwise stop at the first failed assertion, as SPIN normally does, checking
    only property ``only`` if given. ``timeout`` bounds pan's run; a run cut short
    is ``complete=False``. ``hash_bits``: pan's hash table has 2**hash_bits slots
    (26: 512 MB, for millions of states). ``optimise``: gcc's -O level (``-O0``
    compiles pan ten times faster, for tests; pan then runs about half as fast).
    ``best``: SPIN's strongest exhaustive settings instead, partial-order
    reduction on and states compressed (``-DCOLLAPSE -DHC4``); the states it
    stores are then no longer the explorer's plain count.
    Raises ``OSError`` if spin or gcc is missing or fails.
    """
    defines = (["-DREPORT"] if report else []) + ([f"-DONLY={only}"] if only is not None else [])
    storage = ["-DSAFETY", "-DCOLLAPSE", "-DHC4"] if best else ["-DSAFETY", "-DNOREDUCE"]
    work = _compile(text, workdir, [*defines, "-a"], storage, memory_mb, optimise)
    ran = _run_pan(["./pan", f"-m{depth}", f"-w{hash_bits}"], work, timeout)
    return _result(*ran, finished=lambda errors: report or errors == 0)


def check_liveness_with_spin(
    text: str,
    workdir: str | Path,
    claims: Sequence[str],
    *,
    timeout: float = 60.0,
    memory_mb: int = 4096,
    depth: int = 1_000_000,
    hash_bits: int = 24,
    optimise: str = "-O2",
) -> dict[str, SpinResult]:
    """Check each ``eventually`` property in ``claims`` with SPIN: one pan (``-DLIVE``), one ``pan -a -N`` per claim.

    A fair acceptance cycle violates the claim: its result lists the claim in
    ``violated``. The assertions are off. Other arguments as :func:`check_with_spin`.
    """
    work = _compile(text, workdir, ["-DLIVE", f"-DONLY={NOBODY}", "-a"], ["-DNOREDUCE"], memory_mb, optimise)
    out = {}
    for claim in claims:
        output, found_at, seconds, timed_out = _run_pan(
            ["./pan", "-a", "-N", claim, f"-m{depth}", f"-w{hash_bits}"], work, timeout
        )
        if "acceptance cycle" in output:
            output += f"\nkvfsm: violated {claim}\n"
        out[claim] = _result(output, found_at, seconds, timed_out, finished=lambda _errors: True)
    return out


def _compile(
    text: str, workdir: str | Path, spin: list[str], defines: list[str], memory_mb: int, optimise: str
) -> Path:
    """Write the model, ``spin`` it, and compile pan with ``defines``; the folder pan is in."""
    missing = [tool for tool in SPIN_TOOLS if shutil.which(tool) is None]
    if missing:
        raise OSError(f"{' and '.join(missing)} not found; install the Debian packages spin and gcc")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "model.pml").write_text(text, encoding="utf-8")
    _tool(["spin", *spin, "model.pml"], work)
    _tool(["gcc", optimise, *defines, f"-DMEMLIM={memory_mb}", "-w", "-o", "pan", "pan.c"], work)
    return work


def _result(
    output: str, found_at: dict[str, float], seconds: float, timed_out: bool, *, finished: Callable[[int], bool]
) -> SpinResult:
    """What pan's output says; ``finished(errors)``: whether that many errors still mean it explored everything."""
    stored = re.search(r"(\d+) states, stored", output)
    errors = re.search(r"errors: (\d+)", output)
    violated = re.findall(r"kvfsm: violated (\w+)", output)
    violated += re.findall(r"assertion violated \(holds_(\w+)\|\|", output)
    cut = timed_out or "out of memory" in output or "max search depth too small" in output
    n_errors = int(errors.group(1)) if errors else 0
    progress = re.findall(r"States=\s*([0-9.e+]+)", output)  # pan's own progress lines, one per million
    memory = re.search(r"([0-9.]+)\s+total actual memory usage", output)
    return SpinResult(
        states=int(stored.group(1)) if stored else int(float(progress[-1])) if progress else 0,
        violated=tuple(dict.fromkeys(violated)),
        errors=n_errors,
        complete=not cut and stored is not None and finished(n_errors),
        seconds=seconds,
        found_at=found_at,
        output=output,
        memory_mb=float(memory.group(1)) if memory else 0.0,
    )


def _run_pan(argv: list[str], cwd: Path, timeout: float) -> tuple[str, dict[str, float], float, bool]:
    """Run pan, noting when each ``kvfsm: violated`` line arrives; killed (by its pid) after ``timeout`` s."""
    started = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    chunks: list[bytes] = []
    found_at: dict[str, float] = {}
    pending = b""
    timed_out = False
    while True:
        left = started + timeout - time.perf_counter()
        if left <= 0:
            proc.kill()
            timed_out = True
            break
        ready, _w, _x = select.select([fd], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            hit = re.match(rb"kvfsm: violated (\w+)", line)
            if hit:
                found_at.setdefault(hit.group(1).decode(), time.perf_counter() - started)
    proc.wait()
    seconds = time.perf_counter() - started
    proc.stdout.close()
    return b"".join(chunks).decode(errors="replace"), found_at, seconds, timed_out


def _tool(argv: list[str], cwd: Path) -> None:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stdout + done.stderr).strip()[-2000:]}")
