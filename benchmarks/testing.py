#!/usr/bin/env python3
"""How many examples model-based tests take to find each seeded bug of the test suite, with and without the path cover.

Usage: python benchmarks/testing.py [--seeds N] [--first-seed S] [--baseline-seeds N] [--quick] [--only NAME]
                                    [--generator random|"path cover"] [--jobs N] [--json]
The logic lives in kvfsm.showcase.bench.testing; the drivers are the test
suite's (tests/buggy_drivers.py); docs/testing.md §4 explains the figures.

The cases: the suite's seeded bugs and their correct drivers; every bundled
spec with a correct driver (a block pool per resource, or the PD loopback's
decode side); and, for every bundled spec, one mutant of its correct driver
per edge that has an action of its own, broken in that action alone (a
release that is skipped, or an action that takes a block it never gives
back): a bug that sits on that one edge.
"""

import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import buggy_drivers as b  # noqa: E402

import kvfsm  # noqa: E402
from kvfsm.drivers import pd_loopback  # noqa: E402
from kvfsm.showcase.bench.testing import Case, edge_actions, main  # noqa: E402
from kvfsm.spec.model import Edge  # noqa: E402
from kvfsm.testing.cover import caller_taken  # noqa: E402

CPU_HIT = kvfsm.parse(b.CPU_HIT_SPEC, "cpu_hit_load.yaml")
PRODUCER = kvfsm.parse(b.PRODUCER_SPEC, "kv_producer.yaml")
BUNDLED = [kvfsm.load(p) for p in sorted((ROOT / "kvfsm" / "specs").glob("*.yaml"))]
DECODE = [kvfsm.load(ROOT / "specs" / "pd_abort" / f"decode_{v}.yaml") for v in ("corrected", "merged_fix")]


def _take_on_fire(self: b.PoolPerResource, key: Hashable, event: str, resources: frozenset[str]) -> None:
    """What the caller takes before ``fire`` for a transition that enters a resource with no acquire action."""
    for r in sorted(resources):
        self._take(r, key)


def pool_driver(spec: kvfsm.Spec) -> type[b.PoolPerResource]:
    """The suite's block-pool driver for ``spec``, taking on ``before_fire`` what the spec's caller takes."""
    cls = b.pool_driver(spec)
    if any(caller_taken(spec, e.source, e.target) for e in spec.edges()):
        cls = type(cls.__name__, (cls,), {"before_fire": _take_on_fire})
    return cls


def broken_on(spec: kvfsm.Spec, driver: type[b.PoolPerResource], edge: Edge, action: str) -> Case | None:
    """The pool driver with ``action`` (run on ``edge`` alone) broken; ``None`` if it cannot leave a trace."""
    releases = {r.release for r in spec.resources.values()} | {a for t in spec.transitions for _r, a in t.release}
    original = getattr(driver, action)
    if action in releases:
        bug = f"{action}() skips its release"

        def broken(self: b.PoolPerResource, key: Hashable, **_: Any) -> None:
            pass

    elif spec.resources:
        leaked = next(iter(spec.resources))
        bug = f"{action}() also takes a {leaked} block it never gives back"

        def broken(self: b.PoolPerResource, key: Hashable, **payload: Any) -> None:
            original(self, key, **payload)
            self.pools[leaked].allocate(key, 1)

    else:
        return None
    mutant = type(f"{driver.__name__}Broken_{action}", (driver,), {action: broken})
    name = f"{spec.name}: {edge.source} --{edge.event}--> {edge.target}: {bug}"
    return Case(name, spec, mutant, buggy=True)


SUITE = [
    Case("kv_request: seed 000, dec skipped on a put error", b.KV_REQUEST, b.SkipsDecOnPutError, buggy=True),
    Case("kv_request: task_done frees the blocks twice", b.KV_REQUEST, b.TaskDoneFreesBlocks, buggy=True),
    Case("cpu_hit_load: seed 003, pin kept between phases", CPU_HIT, b.UnpinsOnlyLoadedHits, buggy=True),
    Case("kv_producer: write closed twice on success", PRODUCER, b.ClosesWriteTwice, buggy=True),
    *(Case(f"{s.name}: seed 002, pages freed only on ABORT_ACK", s, b.frees_only_on_ack, buggy=True) for s in DECODE),
    *(Case(f"{s.name}: pages never taken", s, b.never_takes_pages, buggy=True) for s in DECODE),
    Case("kv_request: correct StoreSender", b.KV_REQUEST, b.StoreSender, buggy=False),
    Case("cpu_hit_load: correct CpuHitLoader", CPU_HIT, b.CpuHitLoader, buggy=False),
    Case("kv_producer: correct Producer", PRODUCER, b.Producer, buggy=False),
    *(Case(f"{s.name}: correct PD loopback decode", s, pd_loopback.factories()["decode"], buggy=False) for s in DECODE),
]
POOLS = {s.name: pool_driver(s) for s in BUNDLED}
CORRECT_POOLS = [Case(f"{s.name}: correct block pools", s, POOLS[s.name], buggy=False) for s in BUNDLED]
ONE_EDGE = [
    case
    for s in BUNDLED
    for edge, action in edge_actions(s).items()
    if (case := broken_on(s, POOLS[s.name], edge, action)) is not None
]
CASES = [*SUITE, *CORRECT_POOLS, *ONE_EDGE]

if __name__ == "__main__":
    sys.exit(main(CASES))
