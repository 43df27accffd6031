"""The path cover and the coverage verdict: every edge, deadline and ignore rule is reached, every run, or the run fails.

The drivers really hold blocks (buggy_drivers.py). ``ClosesWriteTwice`` has
its bug on the success edge alone, the edge a random walk reaches least.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from buggy_drivers import (
    KV_REQUEST,
    PEER_SPEC,
    PRODUCER_SPEC,
    ClosesWriteTwice,
    GivesPeer,
    NeedsPeer,
    Producer,
    SkipsDecOnPutError,
    StoreSender,
    TaskDoneFreesBlocks,
)

import kvfsm
from kvfsm.testing import Bar, run, spec_machine
from kvfsm.testing.bar import ExemptionError
from kvfsm.testing.cover import blocked_edges, path_cover
from kvfsm.testing.machine import fault_targets
from kvfsm.testing.runner import play

TESTS = Path(__file__).resolve().parent
PRODUCER = kvfsm.parse(PRODUCER_SPEC, "kv_producer.yaml")
WITH_PEER = kvfsm.parse(PEER_SPEC, "kv_producer_peer.yaml")


# -- the plan ---------------------------------------------------------------------------


def test_the_plans_alone_exercise_every_edge_deadline_ignore_rule_and_fault_point() -> None:
    spec = kvfsm.load(KV_REQUEST)
    machine = spec_machine(spec, StoreSender)
    plans = path_cover(spec, keys=machine.keys, faults=fault_targets(spec))
    for plan in plans:
        assert play(machine, plan.steps) is None, plan.goal
    cov = machine.coverage
    assert cov.ratio() == 1.0, cov.gaps()
    assert set(cov.faults) == set(fault_targets(spec))  # enqueue_job and start_transfer each made to raise
    assert any(p.goal.startswith("interleaved") for p in plans)


def test_a_plan_takes_a_shortest_path_to_its_edge() -> None:
    plans = {p.goal: p.steps for p in path_cover(PRODUCER)}
    assert plans["edge writing --write_done--> sent"] == (
        ("begin", ("req-1", None)),
        ("fire", ("req-1", "save", None)),
        ("fire", ("req-1", "remote_ready", None)),
        ("fire", ("req-1", "write_done", None)),
    )
    assert plans["deadline of saved (expire)"][-1] == ("advance", (5.0, None))


# -- bugs are caught every run, correct drivers pass at 100% ------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_a_bug_on_the_success_edge_alone_is_caught_on_every_seed(seed: int) -> None:
    report = run(PRODUCER, ClosesWriteTwice, seed=seed, examples=20)
    assert report.diverged
    assert report.found_by == "edge writing --write_done--> sent"
    assert "close_write() raised PoolCorrupted" in report.story[-1]


@pytest.mark.parametrize(("spec", "factory"), [(KV_REQUEST, SkipsDecOnPutError), (KV_REQUEST, TaskDoneFreesBlocks)])
def test_seeded_bugs_are_found_by_a_planned_example(spec: Path, factory: type) -> None:
    report = run(spec, factory, seed=0, examples=1)  # one random example: the plans alone must find it
    assert report.diverged and report.found_by, report.error


@pytest.mark.parametrize("seed", range(3))
def test_a_correct_driver_passes_with_every_edge_deadline_and_ignore_rule_exercised(seed: int) -> None:
    report = run(PRODUCER, Producer, seed=seed, examples=20)
    assert report.passed, "\n".join(report.story) or report.error
    assert report.verdict is not None and report.verdict.cleared and not report.verdict.gaps
    assert report.coverage.ratio() == 1.0


def test_without_the_cover_the_run_is_the_plain_random_walk() -> None:
    report = run(PRODUCER, Producer, seed=0, examples=3, steps=3, cover=False)
    assert report.planned == 0 and report.coverage.examples < 10
    assert not report.passed and report.verdict is not None and report.verdict.gaps  # 3 short walks miss edges


# The 200-seed study of every seeded bug and correct driver is tests/test_testing_study.py (--run-slow).


# -- the verdict ---------------------------------------------------------------------------


def test_an_edge_behind_a_payload_the_test_cannot_produce_fails_the_run_naming_it() -> None:
    report = run(WITH_PEER, NeedsPeer, seed=0, examples=10)
    assert not report.diverged and not report.passed
    assert report.verdict is not None
    gaps = {g.name: g.why for g in report.verdict.gaps}
    assert (
        "behind a payload the test cannot produce (start_write() requires peer)"
        in gaps["saved --remote_ready--> writing"]
    )
    assert "writing is reachable only through edges the driver cannot take" in gaps["writing --write_done--> sent"]
    assert "saved --abort--> aborted" not in gaps  # everything around the blocked edge is still reached


def test_a_driver_whose_before_fire_gives_the_payload_reaches_every_edge() -> None:
    assert blocked_edges(WITH_PEER, GivesPeer()) == {}
    report = run(WITH_PEER, GivesPeer, seed=0, examples=10)
    assert report.passed and report.coverage.ratio() == 1.0, report.verdict


def test_an_exemption_with_a_reason_lowers_the_bar_for_what_it_names() -> None:
    blocked = [
        "saved --remote_ready--> writing",
        "writing --write_done--> sent",
        "writing --fail--> failed",
        "writing --abort--> aborted",
        "writing --expire--> failed",
        "deadline of writing",
        "ignored abort in sent",
        "ignored expire in sent",
        "ignored fail in sent",
        "ignored write_done in sent",
    ]
    exempt = dict.fromkeys(blocked, "the peer comes from the router; tested in the integration suite")
    report = run(WITH_PEER, NeedsPeer, seed=0, examples=10, bar=Bar(exempt=exempt))
    assert report.passed, report.verdict
    assert report.verdict is not None and len(report.verdict.exempted) == len(blocked)
    partial = dict(list(exempt.items())[:3])
    assert not run(WITH_PEER, NeedsPeer, seed=0, examples=10, bar=Bar(exempt=partial)).passed


def test_min_coverage_lowers_the_bar_and_still_lists_what_was_missed() -> None:
    report = run(WITH_PEER, NeedsPeer, seed=0, examples=10, bar=Bar(min_coverage=0.5))
    assert report.passed and report.verdict is not None and report.verdict.gaps


def test_an_exemption_that_names_nothing_or_gives_no_reason_is_refused() -> None:
    with pytest.raises(ExemptionError, match=r"'saved --ready--> writing' names nothing.*'saved --remote_ready--> "):
        run(WITH_PEER, NeedsPeer, bar=Bar(exempt={"saved --ready--> writing": "typo"}))
    with pytest.raises(ExemptionError, match="gives no reason"):
        run(WITH_PEER, NeedsPeer, bar=Bar(exempt={"deadline of writing": " "}))


# -- from the command line ----------------------------------------------------------------


def kvfsm_test(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "test", *args], capture_output=True, text=True, cwd=TESTS, timeout=300
    )


def test_the_cli_exits_one_naming_what_was_not_reached(tmp_path: Path) -> None:
    spec = tmp_path / "kv_producer_peer.yaml"
    spec.write_text(PEER_SPEC)
    args = (str(spec), "--driver", "buggy_drivers:NeedsPeer", "--examples", "5", "--seed", "0")
    result = kvfsm_test(*args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "but the run left part of it unexercised" in result.stdout
    assert "not reached saved --remote_ready--> writing: behind a payload" in result.stdout
    exempt = tmp_path / "exempt.yaml"
    exempt.write_text(
        'kv_producer_peer:\n  "deadline of writing": the write deadline is tested against the real peer\n'
    )
    lowered = kvfsm_test(*args, "--min-coverage", "50", "--exempt", str(exempt), "--format", "json")
    assert lowered.returncode == 0, lowered.stdout + lowered.stderr
    verdict = json.loads(lowered.stdout)["coverage_verdict"]
    assert verdict["cleared"] and verdict["not_reached"][0]["name"] == "saved --remote_ready--> writing"
    assert [e["name"] for e in verdict["exempt"]] == ["deadline of writing"]


def test_the_cli_reports_which_planned_example_found_the_bug(tmp_path: Path) -> None:
    spec = tmp_path / "kv_producer.yaml"
    spec.write_text(PRODUCER_SPEC)
    result = kvfsm_test(str(spec), "--driver", "buggy_drivers:ClosesWriteTwice", "--seed", "0", "--format", "json")
    assert result.returncode == 1
    failure = json.loads(result.stdout)["failure"]
    assert failure["found_by"] == "edge writing --write_done--> sent" and failure["found_in_example"] == 1
