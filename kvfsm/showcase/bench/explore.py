"""The explorer against SPIN on the PD systems: states per second, peak memory and time to verdict, 1..N requests.

Five settings run on each system and request count, one after another
(each kvfsm run in a forked child, so that its peak memory is its own; SPIN's
pan in a child process):

- ``kvfsm``: the explorer as shipped, symmetry and merged look-alike states;
- ``kvfsm symmetry``: symmetry only;
- ``kvfsm plain``: no reduction, the very state space SPIN stores;
- ``SPIN``: ``pan`` on the Promela export (``gcc -O2 -DSAFETY -DNOREDUCE``;
  compiling is not timed), no symmetry reduction;
- ``SPIN best``: SPIN's strongest exhaustive settings on the same export:
  partial-order reduction on, ``-DCOLLAPSE -DHC4``.

Peak memory is the child's maximum resident set for kvfsm (the interpreter
and its imports included, about 60 MB) and pan's own total for SPIN.

Every run is cut at ``time_limit`` seconds; a setting cut at N requests is
not run for more. *Time to verdict* is the time to the first
counterexample on a violated system (kvfsm: a search with ``first=True``;
SPIN: when pan reports the violation) and the time of the whole search on a
verified one.

``python -m kvfsm.showcase.bench.explore`` or ``python benchmarks/explore.py`` prints
the table (Markdown).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ...explore import explore
from ...gen.promela import to_promela
from ...gen.spin import check_with_spin
from ...spec.bundled import PD_ABORT, SPECS
from ...spec.system import System, load_system

SETTINGS = ("kvfsm", "kvfsm symmetry", "kvfsm plain", "SPIN", "SPIN best")
DEFAULT_SYSTEMS = ("merged_fix", "corrected", "pd_prefill_crash")
"""The PD abort systems (specs/pd_abort) and the corrected one with prefill crashes (specs/explore)."""


@dataclass(frozen=True)
class Run:
    """One setting on one system with one request count."""

    system: str
    requests: int
    setting: str
    verdict: str
    """``verified``, ``violated``, ``timeout`` (cut at the limit, nothing found) or ``skipped`` (cut on fewer requests)."""
    states: int
    """States stored; for a run cut short, as far as it got."""
    seconds: float
    """The whole search (or up to the cut)."""
    to_verdict: float | None
    """Seconds to the verdict; None if there was none in time."""
    complete: bool = True
    """The whole state space was searched (a violation may be found by a search cut at the limit)."""
    memory_mb: float = 0.0
    """Peak memory of the run (see the module docstring); 0 when not measured."""

    @property
    def rate(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0


def system_path(name: str) -> Path:
    """A benchmark system by name: a PD abort system, or a composition bundled in specs/explore."""
    pd = PD_ABORT / f"{name}.yaml"
    return pd if pd.exists() else SPECS / "explore" / f"{name}.yaml"


def _measured(system: System, name: str, n: int, setting: str, limit: float) -> Run:
    """:func:`_kvfsm` in a forked child, with the child's peak resident memory."""
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe(duplex=False)

    def work() -> None:
        one = _kvfsm(system, name, n, setting, limit)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
        child.send(replace(one, memory_mb=round(peak, 1)))

    proc = context.Process(target=work)
    proc.start()
    got: Run = parent.recv()
    proc.join()
    return got


def _kvfsm(system: System, name: str, n: int, setting: str, limit: float) -> Run:
    symmetry = setting != "kvfsm plain"
    merge = setting == "kvfsm"
    full = explore(system, requests=n, symmetry=symmetry, merge=merge, time_limit=limit)
    if full.violated:
        first = explore(system, requests=n, symmetry=symmetry, merge=merge, first=True, time_limit=limit)
        return Run(name, n, setting, "violated", full.states, full.seconds, first.seconds, full.complete)
    if not full.complete:
        return Run(name, n, setting, "timeout", full.states, full.seconds, None, False)
    return Run(name, n, setting, "verified", full.states, full.seconds, full.seconds)


def _spin(system: System, name: str, n: int, limit: float, work: Path, setting: str = "SPIN") -> Run:
    bits = min(26, 16 + 2 * n)  # a table sized to the state space: pan's start-up is not spent zeroing 512 MB
    best = setting == "SPIN best"
    result = check_with_spin(
        to_promela(system, requests=n), work / f"{name}-{n}-{best}", timeout=limit, hash_bits=bits, best=best
    )
    mb = result.memory_mb
    if result.violated:
        first = min(result.found_at.values(), default=None)
        return Run(name, n, setting, "violated", result.states, result.seconds, first, result.complete, mb)
    if not result.complete:
        return Run(name, n, setting, "timeout", result.states, result.seconds, None, False, mb)
    return Run(name, n, setting, "verified", result.states, result.seconds, result.seconds, True, mb)


def run(
    *,
    systems: Sequence[str] = DEFAULT_SYSTEMS,
    requests: Sequence[int] = (1, 2, 3, 4, 5, 6),
    time_limit: float = 60.0,
    spin: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Run]:
    """Every setting on every system and request count; see the module docstring."""
    runs: list[Run] = []
    settings = SETTINGS if spin else SETTINGS[:3]
    with tempfile.TemporaryDirectory(prefix="kvfsm-spin-") as tmp:
        for name in systems:
            system = load_system(system_path(name))
            for setting in settings:
                gave_up = False
                for n in requests:
                    if progress is not None:
                        progress(f"{name}, {n} request(s), {setting}")
                    if gave_up:
                        runs.append(Run(name, n, setting, "skipped", 0, 0.0, None, False))
                        continue
                    if setting.startswith("SPIN"):
                        one = _spin(system, name, n, time_limit, Path(tmp), setting)
                    else:
                        one = _measured(system, name, n, setting, time_limit)
                    runs.append(one)
                    gave_up = not one.complete
    return runs


def environment() -> dict[str, str]:
    spin = subprocess.run(["spin", "-V"], capture_output=True, text=True, check=False).stdout.strip()
    return {
        "python": platform.python_version(),
        "machine": platform.processor() or platform.machine(),
        "cpus": str(len(os.sched_getaffinity(0))),
        "spin": spin or "not installed",
    }


def _cell(r: Run) -> str:
    if r.verdict == "skipped":
        return "—"
    if not r.complete:
        return f"cut at {r.seconds:.0f} s ({r.states:,} states)"
    rate = f"{r.rate / 1000:,.0f}k/s" if r.rate >= 10_000 else f"{r.rate:,.0f}/s"
    memory = f" · {r.memory_mb:,.0f} MB" if r.memory_mb else ""
    return f"{r.states:,} · {r.seconds:.2f} s · {rate}{memory}"


def _verdict_time(r: Run | None) -> str:
    if r is None or r.to_verdict is None:
        return "—"
    return f"{r.to_verdict:.2f} s"


def format_markdown(runs: Sequence[Run]) -> str:
    """One table per system: states · seconds · states per second per setting, then time to verdict."""
    out: list[str] = []
    by = {(r.system, r.requests, r.setting): r for r in runs}
    settings = [s for s in SETTINGS if any(r.setting == s for r in runs)]
    for name in dict.fromkeys(r.system for r in runs):
        verdicts = {r.verdict for r in runs if r.system == name and r.verdict in ("verified", "violated")}
        out.append(f"**{name}** ({' / '.join(sorted(verdicts)) or 'no verdict'})")
        out.append("")
        head = ["requests", *(f"{s}: states · time · rate · peak" for s in settings), "to verdict: kvfsm / SPIN"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join("---" for _ in head) + "|")
        for n in sorted({r.requests for r in runs if r.system == name}):
            cells = [str(n), *(_cell(by[name, n, s]) for s in settings)]
            cells.append(f"{_verdict_time(by.get((name, n, 'kvfsm')))} / {_verdict_time(by.get((name, n, 'SPIN')))}")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvfsm.showcase.bench.explore", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--requests", type=int, default=6, help="up to this many requests (default 6)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per run (default 60)")
    parser.add_argument("--no-spin", action="store_true", help="leave SPIN out")
    parser.add_argument("--quick", action="store_true", help="up to 3 requests, 10 s per run: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the runs as JSON")
    parser.add_argument(
        "--systems", nargs="+", default=list(DEFAULT_SYSTEMS), help=f"which (default: {' '.join(DEFAULT_SYSTEMS)})"
    )
    args = parser.parse_args(argv)
    top = 3 if args.quick else args.requests
    limit = 10.0 if args.quick else args.time_limit
    runs = run(
        systems=args.systems,
        requests=range(1, top + 1),
        time_limit=limit,
        spin=not args.no_spin,
        progress=lambda label: print(f"… {label}", file=sys.stderr, flush=True),
    )
    if args.json:
        print(json.dumps({"environment": environment(), "runs": [asdict(r) for r in runs]}, indent=2))
    else:
        print(format_markdown(runs))
        env = environment()
        print(f"{env['machine']}, {env['cpus']} CPUs, Python {env['python']}, {env['spin']}; {limit:.0f} s per run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
