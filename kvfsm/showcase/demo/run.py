"""``run()``: the demo's parts in order, each timed, one part's failure never hiding the others' figures."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from ...spec.bundled import SPECS
from . import parts
from .report import DemoReport, FailedPart, PartResult


@dataclass(frozen=True)
class Part:
    """One part: its name (for ``--only``), what it is doing (for a progress display), the seed report it answers."""

    name: str
    title: str
    seed: str | None
    run: Callable[[Options], PartResult]


@dataclass(frozen=True)
class Options:
    """Where the specs are and the diagrams go, the random seed, and the sizes."""

    specs: Path = SPECS
    """The specs to check and draw; the simulator, soak and explorer always run the bundled ones."""
    out: Path = Path("out")
    seed: int = 0
    quick: bool = False
    only: Collection[str] = field(default_factory=tuple)
    """Names of the parts to run; empty: all of them."""

    @property
    def sizes(self) -> parts.Sizes:
        return parts.QUICK if self.quick else parts.FULL


PARTS = (
    Part("check", "checking every spec", None, lambda o: parts.check_specs(o.specs)),
    Part("diagrams", "drawing every machine spec", None, lambda o: parts.draw_specs(o.specs, o.out / "diagrams")),
    Part(
        "offload",
        "vLLM scheduler sim, CPU offload",
        "003",
        lambda o: parts.offload_soak(o.seed, o.sizes.sim_requests),
    ),
    Part(
        "mooncake",
        "Mooncake store soak with faults",
        "000",
        lambda o: parts.mooncake_soak(o.seed, o.sizes.soak_requests, o.sizes.unfixed_seconds),
    ),
    Part(
        "explore",
        "exploring the PD abort race",
        "002",
        lambda o: parts.explore_pd_abort(o.sizes.explore_requests),
    ),
)
NAMES = tuple(p.name for p in PARTS)

Progress = Callable[[Part, int, int], None]
"""Called as ``progress(part, done, total)`` before each part runs."""


def run(options: Options = Options(), progress: Progress | None = None, *, catch: bool = True) -> DemoReport:
    """Run the chosen parts and return their figures; prints nothing, writes only the diagrams.

    A part that raises becomes a :class:`FailedPart` and the next one runs;
    ``catch=False`` lets the exception out instead (to debug it).
    """
    unknown = set(options.only) - set(NAMES)
    if unknown:
        raise ValueError(f"unknown demo part(s) {sorted(unknown)}; the parts are {', '.join(NAMES)}")
    chosen = [p for p in PARTS if not options.only or p.name in options.only]
    results: list[PartResult] = []
    start = time.perf_counter()
    for done, part in enumerate(chosen):
        if progress is not None:
            progress(part, done, len(chosen))
        began = time.perf_counter()
        try:
            results.append(part.run(options))
        except Exception as exc:  # a demo shows every part it can; the broken one says what broke
            if not catch:
                raise
            results.append(FailedPart(part.name, f"{type(exc).__name__}: {exc}", time.perf_counter() - began))
    return DemoReport(tuple(results), options.quick, options.seed, time.perf_counter() - start)
