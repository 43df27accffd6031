"""How soon model-based tests find seeded driver bugs, with the path cover and without it, over many seeds.

For each case (a spec, a driver factory, and whether the driver has a seeded
bug) and each generator, one :func:`kvfsm.testing.run` per seed, with the
default example budget:

- ``path cover``: the planned examples first, then the random walk (what
  ``kvfsm test`` runs);
- ``random``: the random walk alone (``cover=False``), the generator before
  the path cover, kept as the baseline.

A buggy case reports how many examples it took to find the bug (the
failing example's number: planned ones count), median and worst, and how
many seeds missed it; a correct case reports how many seeds passed with
every edge, deadline and ignore rule exercised, and the lowest coverage any
seed reached. Every row has the median and worst seconds of a run, so the
path cover's run time can be read against the baseline's. The generators run
interleaved, seed by seed, so load that comes and goes hits both.

The cases come from the caller (``benchmarks/testing.py`` uses the test
suite's drivers), so the library holds no buggy drivers; :func:`edge_actions`
finds, for a spec, the edges whose bug a driver can carry alone (an action
run on that edge and on no other), which the caller turns into mutants.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ...spec import Spec
from ...spec.model import Edge
from ...testing import run
from ...testing.contract import DriverFactory

GENERATORS = {"path cover": True, "random": False}
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
    worst_seconds: float
    lowest_coverage: float
    """The smallest share of edges, deadlines and ignore rules a seed exercised (correct cases; 1.0 for buggy)."""


def measure(
    case: Case, seeds: Sequence[int], generators: Sequence[str] = tuple(GENERATORS), baseline: int | None = None
) -> list[Row]:
    """Run ``case`` once per seed and generator, interleaved; one :class:`Row` per generator.

    ``baseline``: run the ``random`` generator on only the first that many seeds.
    """
    found: dict[str, list[int]] = {g: [] for g in generators}
    seconds: dict[str, list[float]] = {g: [] for g in generators}
    good: dict[str, int] = dict.fromkeys(generators, 0)
    lowest: dict[str, float] = dict.fromkeys(generators, 1.0)
    for n, seed in enumerate(seeds):
        for g in generators:
            if g == "random" and baseline is not None and n >= baseline:
                continue
            start = time.perf_counter()
            report = run(case.spec, case.factory, seed=seed, cover=GENERATORS[g])
            seconds[g].append(time.perf_counter() - start)
            if case.buggy and report.diverged:
                found[g].append(report.coverage.examples)
            if not case.buggy:
                good[g] += report.passed and report.coverage.ratio() == 1.0
                lowest[g] = min(lowest[g], report.coverage.ratio())
    return [
        Row(
            case.name,
            g,
            case.buggy,
            len(seconds[g]),
            len(found[g]) if case.buggy else good[g],
            statistics.median(found[g]) if found[g] else None,
            max(found[g]) if found[g] else None,
            statistics.median(seconds[g]),
            max(seconds[g]),
            lowest[g],
        )
        for g in generators
        if seconds[g]
    ]


def edge_actions(spec: Spec) -> dict[Edge, str]:
    """Edge → an action that runs on it and on no other edge, nor at ``begin``: where a one-edge bug can sit.

    An edge's actions are its ``do``, the acquire actions of what its target
    holds that its source does not, and the release actions of what its
    source holds that its target does not (a transition's own ``release:``
    included). A driver only sees its actions
    called, so an edge with no action of its own cannot carry a bug of its own.
    """
    runs: dict[Edge, set[str]] = {}
    for e in spec.edges():
        acts = set(spec.raising_actions(e))
        acts.update(action for r, action in spec.release_actions(e) if r in spec.resources)
        runs[e] = acts
    at_begin = {spec.resources[r].acquire for r in spec.initial.holds if r in spec.resources}
    out: dict[Edge, str] = {}
    for e, acts in runs.items():
        mine = sorted(a for a in acts if a and a not in at_begin and all(a not in o for f, o in runs.items() if f != e))
        if mine:
            out[e] = mine[0]
    return out


def format_table(rows: Sequence[Row]) -> str:
    """Markdown: one line per case and generator."""
    lines = [
        "| case | generator | caught / passed at 100% | examples to find: median | worst | run: median | worst |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        what = f"{r.found}/{r.seeds} caught" if r.buggy else f"{r.found}/{r.seeds} passed at 100%"
        if not r.buggy and r.lowest_coverage < 1.0:
            what += f" (lowest {r.lowest_coverage:.0%})"
        median = f"{r.median_examples:g}" if r.median_examples is not None else "—"
        worst = str(r.worst_examples) if r.worst_examples is not None else "—"
        lines.append(
            f"| {r.case} | {r.generator} | {what} | {median} | {worst} | {r.median_seconds:.2f} s "
            f"| {r.worst_seconds:.2f} s |"
        )
    return "\n".join(lines)


_JOB: tuple[Sequence[Case], Sequence[int], Sequence[str], int | None] | None = None
"""What the worker processes measure (inherited by fork: drivers built at run time cannot be pickled)."""


def _measure_nth(n: int) -> list[Row]:
    assert _JOB is not None  # set before the pool forks
    cases, seeds, generators, baseline = _JOB
    return measure(cases[n], seeds, generators, baseline)


def measure_all(
    cases: Sequence[Case],
    seeds: Sequence[int],
    generators: Sequence[str] = tuple(GENERATORS),
    baseline: int | None = None,
    jobs: int = 1,
) -> list[Row]:
    """:func:`measure` for every case, ``jobs`` cases at a time in forked processes; rows in case order."""
    global _JOB
    if jobs <= 1:
        return [r for case in cases for r in measure(case, seeds, generators, baseline)]
    _JOB = (cases, seeds, generators, baseline)
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            return [r for rows in pool.map(_measure_nth, range(len(cases)), chunksize=1) for r in rows]
    finally:
        _JOB = None


def main(cases: Sequence[Case], argv: Sequence[str] | None = None, out: Callable[[str], object] = print) -> int:
    """The command line of ``benchmarks/testing.py``: ``--seeds N`` (default 200), ``--quick``, ``--json``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per case and generator (default 200)")
    parser.add_argument(
        "--first-seed", type=int, default=0, metavar="S", help="start at seed S (to split a long study into parts)"
    )
    parser.add_argument(
        "--baseline-seeds",
        type=int,
        default=None,
        metavar="N",
        help="run the random baseline on the first N seeds only (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="5 seeds: a smoke run, the figures mean little")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    parser.add_argument("--generator", choices=tuple(GENERATORS), default=None, help="run one generator only")
    parser.add_argument("--jobs", type=int, default=1, help="cases measured at once, in separate processes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    seeds = range(args.first_seed, args.first_seed + (5 if args.quick else args.seeds))
    chosen = [c for c in cases if args.only is None or args.only in c.name]
    generators = [args.generator] if args.generator else list(GENERATORS)
    rows = measure_all(chosen, seeds, generators, args.baseline_seeds, args.jobs)
    out(json.dumps([asdict(r) for r in rows], indent=2) if args.json else format_table(rows))
    return 0


__all__ = ["GENERATORS", "Case", "Row", "edge_actions", "format_table", "main", "measure", "measure_all"]
