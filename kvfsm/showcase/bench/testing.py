"""How soon model-based tests find seeded driver bugs, with the path cover and without it, over many seeds.

For each case (a spec, a driver factory, and whether the driver has a seeded
bug) and each generator, one :func:`kvfsm.testing.run` per seed:

- ``random``: the random walk alone (``cover=False``), the generator before
  the path cover;
- ``path cover``: the planned examples first, then the random walk.

A buggy case reports how many examples it took to find the bug (the
failing example's number: planned ones count), median and worst, and how
many seeds missed it; a correct case reports how many seeds passed with
every edge, deadline and ignore rule exercised, and the median time of a run.
The cases come from the caller (``benchmarks/testing.py`` uses the test
suite's drivers), so the library holds no buggy drivers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ...spec import Spec
from ...testing import run
from ...testing.contract import DriverFactory

GENERATORS = {"random": False, "path cover": True}
"""Name → whether the path cover runs."""


@dataclass(frozen=True)
class Case:
    """A driver to test against a spec; ``buggy``: it has a seeded bug that a run must find."""

    name: str
    spec: Spec | str | Path
    factory: DriverFactory
    buggy: bool


@dataclass(frozen=True)
class Row:
    """One case under one generator, over every seed."""

    case: str
    generator: str
    buggy: bool
    seeds: int
    found: int
    """Buggy: seeds that found the bug. Correct: seeds that passed with full coverage."""
    median_examples: float | None
    worst_examples: int | None
    median_seconds: float


def measure(case: Case, generator: str, seeds: Sequence[int], examples: int | None = None) -> Row:
    """Run ``case`` once per seed with ``generator``; the figures of :class:`Row`."""
    found_in: list[int] = []
    seconds: list[float] = []
    good = 0
    for seed in seeds:
        start = time.perf_counter()
        report = run(case.spec, case.factory, seed=seed, examples=examples, cover=GENERATORS[generator])
        seconds.append(time.perf_counter() - start)
        if case.buggy and report.diverged:
            found_in.append(report.coverage.examples)
        if not case.buggy and report.passed and report.coverage.ratio() == 1.0:
            good += 1
    return Row(
        case.name,
        generator,
        case.buggy,
        len(seeds),
        len(found_in) if case.buggy else good,
        statistics.median(found_in) if found_in else None,
        max(found_in) if found_in else None,
        statistics.median(seconds),
    )


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: one line per case and generator."""
    lines = [
        "| case | generator | caught / passed at 100% | examples to find: median | worst | median run |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        what = f"{r.found}/{r.seeds} caught" if r.buggy else f"{r.found}/{r.seeds} passed at 100%"
        median = f"{r.median_examples:g}" if r.median_examples is not None else "—"
        worst = str(r.worst_examples) if r.worst_examples is not None else "—"
        lines.append(f"| {r.case} | {r.generator} | {what} | {median} | {worst} | {r.median_seconds:.2f} s |")
    return "\n".join(lines)


def main(cases: Sequence[Case], argv: Sequence[str] | None = None, out: Callable[[str], object] = print) -> int:
    """The command line of ``benchmarks/testing.py``: ``--seeds N`` (default 200), ``--quick``, ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per case and generator (default 200)")
    parser.add_argument("--quick", action="store_true", help="5 seeds: a smoke run, the figures mean little")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    parser.add_argument("--generator", choices=tuple(GENERATORS), default=None, help="run one generator only")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    seeds = range(5 if args.quick else args.seeds)
    chosen = [c for c in cases if args.only is None or args.only in c.name]
    generators = [args.generator] if args.generator else list(GENERATORS)
    rows = [measure(case, g, seeds) for case in chosen for g in generators]
    out(json.dumps([asdict(r) for r in rows], indent=2) if args.json else format_table(rows))
    return 0


__all__ = ["GENERATORS", "Case", "Row", "format_table", "main", "measure"]
