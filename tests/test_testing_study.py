"""The study of benchmarks/testing.py: every seeded bug and one-edge bug caught on every seed, every correct driver
passing at 100% edge, deadline and ignore-rule coverage on every seed.

The default suite runs a few seeds; ``--run-slow`` runs the study's 200 with the default example budget.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from kvfsm.showcase.bench.testing import Case, edge_actions, format_table, measure
from kvfsm.spec import load
from kvfsm.testing import run

ROOT = Path(__file__).resolve().parent.parent


def _study() -> ModuleType:
    spec = importlib.util.spec_from_file_location("testing_study", ROOT / "benchmarks" / "testing.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STUDY = _study()
CASES: list[Case] = STUDY.CASES
BUGGY = [c for c in CASES if c.buggy]
CORRECT = [c for c in CASES if not c.buggy]


def names(cases: list[Case]) -> list[str]:
    return [c.name for c in cases]


def test_the_study_holds_every_bundled_spec_and_a_one_edge_bug_on_every_edge_that_can_carry_one() -> None:
    bundled = sorted(p.stem for p in (ROOT / "kvfsm" / "specs").glob("*.yaml"))
    assert sorted(load(ROOT / "kvfsm" / "specs" / f"{b}.yaml").name for b in bundled) == sorted(
        c.name.split(":")[0] for c in CORRECT if c.name.endswith("correct block pools")
    )
    kv = load(ROOT / "kvfsm" / "specs" / "kv_request.yaml")
    assert {(e.source, e.event): a for e, a in edge_actions(kv).items()} == {
        ("pinned", "enqueue"): "enqueue_job",
        ("queued", "start"): "start_transfer",
    }  # the releases run on many edges each: only a do action is an edge's own
    mutants = [c.name for c in BUGGY if c.name.startswith("nixl_decode:")]
    assert (
        "nixl_decode: reading --reads_stopped--> loaded: report_loaded() skips its release"
        in (mutants)
    )  # the success edge included


@pytest.mark.parametrize("case", BUGGY, ids=names(BUGGY))
def test_every_bug_is_caught_on_every_seed_by_a_planned_example(case: Case) -> None:
    [row] = measure(case, range(10), ["path cover"])
    assert row.found == row.seeds == 10
    assert row.worst_examples is not None and row.worst_examples <= 40  # the plans find it, before any random walk


@pytest.mark.parametrize("case", CORRECT, ids=names(CORRECT))
def test_every_correct_driver_passes_at_full_coverage(case: Case) -> None:
    for seed in range(3):
        report = run(case.spec, case.factory, seed=seed, examples=3)
        assert report.passed, "\n".join(report.story) or report.error or report.verdict
        assert report.coverage.ratio() == 1.0


def test_the_table_reads_each_row_against_its_baseline() -> None:
    case = next(c for c in BUGGY if c.name.startswith("kv_producer: write closed twice"))
    rows = measure(case, range(2), baseline=1)
    assert [(r.generator, r.seeds) for r in rows] == [("path cover", 2), ("random", 1)]
    table = format_table(rows)
    assert "| kv_producer: write closed twice on success | path cover | 2/2 caught | 1 | 1 |" in table


@pytest.mark.slow
@pytest.mark.parametrize("case", BUGGY, ids=names(BUGGY))
def test_every_bug_is_caught_on_each_of_200_seeds(case: Case) -> None:
    missed = [seed for seed in range(200) if not run(case.spec, case.factory, seed=seed).diverged]
    assert missed == []


@pytest.mark.slow
@pytest.mark.parametrize("case", CORRECT, ids=names(CORRECT))
def test_every_correct_driver_passes_at_full_coverage_on_each_of_200_seeds(case: Case) -> None:
    failed = [seed for seed in range(200) if not run(case.spec, case.factory, seed=seed).passed]
    assert failed == []
