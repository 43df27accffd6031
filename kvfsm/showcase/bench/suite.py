"""``run()``: every measurement in one process, in a fixed order, with progress reported to the caller."""

from __future__ import annotations

import gc
import os
import platform
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from . import workloads
from .report import BenchReport

Progress = Callable[[str, int, int], None]
"""Called as ``progress(label, done, total)`` before each step and once more as ``("done", total, total)``."""

NOTES = (
    "Timing: each figure is the median of several repeats; every repeat builds its subject untimed, "
    "runs gc.collect(), then times the workload with the garbage collector disabled (as timeit does). "
    "Variants of one comparison run interleaved, repeat by repeat.",
    "Driver: every action is a no-op method, so the figures are the engines' own cost; the variants are "
    "checked to make identical driver calls (tests/test_bench.py).",
    "Lifecycle: all N requests begin, then all enqueue, all start (arming a 30 s deadline on time.monotonic), "
    "all complete, then one finished() drain; the Tracker runs specs/kv_request.yaml.",
    "Scaling: keys are fired in insertion order, as a scheduler walks its running requests; the shuffled rows "
    "show what random access to a large table costs either way.",
    "Memory: tracemalloc counts requested bytes (allocator rounding excluded); keys are allocated before "
    "tracing starts, the tracker object itself is built before too.",
    "Poll: instance i's deadline is at virtual time 30 + i, so poll(30 + k - 0.5) finds exactly k due; each due "
    "deadline fires expire, which releases gpu_blocks and queue_slot.",
)


def _environment(sizes: workloads.Sizes) -> dict[str, str]:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpus": str(os.cpu_count()),
    }
    for dist in ("kvfsm", "transitions", "python-statemachine"):
        try:
            env[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env[dist] = "not installed"
    return env


def run(quick: bool = False, progress: Progress | None = None, *, spec_path: str | Path | None = None) -> BenchReport:
    """Measure the Tracker against its baselines; ``quick`` uses tiny sizes (a smoke test, figures not meaningful).

    Prints nothing; ``progress`` (if given) is told each step as it starts.
    """
    sizes = workloads.QUICK if quick else workloads.FULL
    spec = workloads.kv_request_spec(spec_path)
    report = BenchReport(quick=quick, environment=_environment(sizes), notes=list(NOTES))
    if quick:
        report.notes.insert(0, "QUICK run: sizes are tiny; use the full run for figures.")
    steps: list[tuple[str, Callable[[], None]]] = [
        (
            f"lifecycle, Tracker vs hand-written (N={sizes.lifecycle_n:,})",
            lambda: workloads.lifecycle(report, sizes, spec),
        ),
        (
            f"lifecycle, transitions (N={sizes.transitions_n:,})",
            lambda: workloads.rival_lifecycle(report, sizes, spec, "transitions"),
        ),
        (
            f"lifecycle, python-statemachine (N={sizes.statemachine_n:,})",
            lambda: workloads.rival_lifecycle(report, sizes, spec, "python-statemachine"),
        ),
        (
            f"fire() at {', '.join(f'{n:,}' for n in sizes.live_counts)} live",
            lambda: workloads.scaling(report, sizes),
        ),
        (f"bytes per live instance (N={sizes.memory_n:,})", lambda: workloads.memory(report, sizes, spec)),
        (f"poll() with {sizes.poll_armed:,} armed", lambda: workloads.poll(report, sizes, spec)),
    ]
    start = time.perf_counter()
    gc.collect()
    gc.freeze()  # the host's objects are never the bench's garbage: each timed call's collection stays cheap
    try:  # (in a long pytest session the heap is big, and the collections cost most of a quick run)
        for done, (label, step) in enumerate(steps):
            if progress is not None:
                progress(label, done, len(steps))
            step()
    finally:
        gc.unfreeze()
    if progress is not None:
        progress("done", len(steps), len(steps))
    report.seconds = time.perf_counter() - start
    return report
