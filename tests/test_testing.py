"""Model-based tests generated from a spec (kvfsm.testing) bite: seed-shaped driver bugs fail, correct drivers pass.

The drivers in buggy_drivers.py really hold blocks of a ref-counted pool and
slots of a queue, and ``observe(key)`` reads those; each buggy one differs from
its correct twin by one method, the way the seed bugs did. Every run below uses
the default example budget; seeds are fixed so a failure here can be repeated.
"""

from __future__ import annotations

import pytest
from buggy_drivers import (
    CPU_HIT_SPEC,
    KV_REQUEST,
    CpuHitLoader,
    LacksTaskDone,
    NoObserve,
    SkipsDecOnPutError,
    StoreSender,
    TaskDoneFreesBlocks,
    UnpinsOnlyLoadedHits,
)
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

import kvfsm
from kvfsm import BindingError
from kvfsm.gen.diagram import to_dot
from kvfsm.testing import RunReport, SpecMachine, SpecViolation, run, spec_machine
from kvfsm.testing.runner import replay

CPU_HIT = kvfsm.parse(CPU_HIT_SPEC, "cpu_hit_load.yaml")
SEEDS = (0, 1, 2)
FIND = settings(max_examples=200, database=None, deadline=None, phases=(Phase.generate,))
"""For runs straight through Hypothesis that only need a failure, not a shrunk one."""


@pytest.fixture(scope="module")
def store_sender_run() -> RunReport:
    """One default-budget run of the correct kv_request driver, shared by the tests that read it."""
    return run(KV_REQUEST, StoreSender, seed=0)


def story(report: RunReport) -> str:
    return "\n".join(report.story) or report.error


def test_cpu_hit_spec_is_clean() -> None:
    """The seed-003 spec must pass the checks, or a failure below would be the spec's fault."""
    assert [f for f in kvfsm.spec.run_checks(CPU_HIT) if f.severity == "error"] == []


# -- correct drivers pass ------------------------------------------------------------------


def test_correct_store_sender_passes(store_sender_run: RunReport) -> None:
    assert store_sender_run.passed, story(store_sender_run)
    assert store_sender_run.examples == 100 and store_sender_run.coverage.examples >= 100


@pytest.mark.parametrize("seed", SEEDS[1:])
def test_correct_store_sender_passes_other_seeds(seed: int) -> None:
    report = run(KV_REQUEST, StoreSender, seed=seed)
    assert report.passed, story(report)


@pytest.mark.parametrize("seed", SEEDS)
def test_correct_cpu_hit_loader_passes(seed: int) -> None:
    report = run(CPU_HIT, CpuHitLoader, seed=seed)
    assert report.passed, story(report)


# -- seed-shaped bugs fail, with a short story ------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_release_skipped_on_the_exception_path_fails_seed_000(seed: int) -> None:
    """dec_stored_request after batch_put, not in a finally: a failed put leaves the blocks pinned."""
    report = run(KV_REQUEST, SkipsDecOnPutError, seed=seed)
    assert not report.passed
    assert report.story == (
        "t=0.0 begin req-1 → pinned",
        "t=0.0 enqueue req-1: pinned → queued",
        "t=0.0 start req-1: start_transfer() raised (injected fault), so fail req-1: queued → failed; "
        "observe says gpu_blocks still held by req-1 (req-1 is failed, which holds nothing)",
    ), story(report)


@pytest.mark.parametrize("seed", SEEDS)
def test_double_release_fails(seed: int) -> None:
    """task_done also frees the job's blocks, so the spec-derived free_gpu_blocks frees them twice."""
    report = run(KV_REQUEST, TaskDoneFreesBlocks, seed=seed)
    assert not report.passed
    last = report.story[-1]
    assert "task_done() raised PoolCorrupted" in last and "which it does not hold" in last, story(report)
    assert "no fault was injected" in last or "what no injected fault explains" in last
    assert report.story[:2] == ("t=0.0 begin req-1 → pinned", "t=0.0 enqueue req-1: pinned → queued")
    assert len(report.story) <= 4


@pytest.mark.parametrize("seed", SEEDS)
def test_pin_kept_when_cancelled_between_phases_fails_seed_003(seed: int) -> None:
    """The pin from phase A is released only from the phase-B table: cancelled in between, it stays."""
    report = run(CPU_HIT, UnpinsOnlyLoadedHits, seed=seed)
    assert not report.passed
    assert report.story[:2] == ("t=0.0 begin req-1 → matching", "t=0.0 hit req-1: matching → pinned"), story(report)
    assert "pinned → " in report.story[-1]
    assert "observe says cpu_pin still held by req-1" in report.story[-1]
    assert len(report.story) == 3


def test_a_failing_run_is_repeated_by_its_seed() -> None:
    first = run(KV_REQUEST, SkipsDecOnPutError)
    again = run(KV_REQUEST, SkipsDecOnPutError, seed=first.seed)
    assert not first.passed and again.story == first.story and again.coverage.examples == first.coverage.examples


def test_a_failing_story_replays_to_the_same_divergence() -> None:
    machine = spec_machine(KV_REQUEST, TaskDoneFreesBlocks)
    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(machine, settings=FIND)
    again = replay(machine, caught.value.trace)
    assert again is not None and again.problems == caught.value.problems


# -- the oracle is the spec, not the Tracker ---------------------------------------------


def test_a_tracker_that_disagrees_with_the_spec_is_caught() -> None:
    """The machine's Tracker runs a spec without the ignore rule: a late abort now raises where the spec says no-op."""
    strict = kvfsm.parse(KV_REQUEST.read_text().split("ignore:")[0] + "on_error: fail\n", "kv_request_strict.yaml")

    class StrictTracker(spec_machine(KV_REQUEST, StoreSender)):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.tracker = kvfsm.Tracker(strict, self.driver, clock=self.clock)

    with pytest.raises(SpecViolation) as caught:
        run_state_machine_as_test(StrictTracker, settings=FIND)
    assert any("IllegalTransition" in p for p in caught.value.problems), caught.value


def test_illegal_ignored_and_unknown_key_events_are_fired(store_sender_run: RunReport) -> None:
    cov = store_sender_run.coverage
    assert sum(cov.illegal.values()) > 0 and sum(cov.ignored.values()) > 0 and cov.unknown > 0


# -- the driver protocol -------------------------------------------------------------------


def test_a_driver_without_inject_fault_runs_without_faults() -> None:
    class NoFaults(StoreSender):
        inject_fault = None  # type: ignore[assignment]

    report = run(KV_REQUEST, NoFaults, seed=0)
    assert report.passed, story(report)
    assert not report.coverage.faults


def test_a_driver_without_observe_is_refused_up_front() -> None:
    with pytest.raises(BindingError, match=r"NoObserve has no observe\(key\) method"):
        run(KV_REQUEST, NoObserve)


def test_a_driver_lacking_an_action_is_refused_naming_it() -> None:
    with pytest.raises(BindingError, match=r"lacks method.*task_done"):
        run(KV_REQUEST, LacksTaskDone)


def test_a_driver_that_cannot_take_what_begin_holds_is_refused() -> None:
    class NoBeforeBegin(StoreSender):
        before_begin = None  # type: ignore[assignment]

    with pytest.raises(BindingError, match=r"holds gpu_blocks with no acquire action.*before_begin\(key, resources\)"):
        run(KV_REQUEST, NoBeforeBegin)


def test_unknown_params_are_refused_before_any_example() -> None:
    with pytest.raises(BindingError, match="'transfer_timout' are not declared"):
        spec_machine(KV_REQUEST, StoreSender, params={"transfer_timout": 1.0})


# -- coverage ------------------------------------------------------------------------------


def test_coverage_counts_each_edge_by_how_it_was_taken(store_sender_run: RunReport) -> None:
    cov = store_sender_run.coverage
    done, total = cov.summary()["edges"]
    assert total == 10 and done >= 8  # a default run rarely misses any; the table shows which
    rows = {(r.source, r.event): r for r in cov.edge_counts()}
    assert rows["transferring", "expire"].timeout and not rows["pinned", "enqueue"].timeout
    assert rows["pinned", "fail"].by["on_error"] > 0  # enqueue_job made to raise
    assert rows["pinned", "abort"].by["close"] > 0  # every example ends with close()
    assert rows["pinned", "enqueue"].by["fire"] == rows["pinned", "enqueue"].taken
    doc = cov.as_dict()
    assert doc["summary"]["edges"] == {"exercised": done, "total": 10}
    assert {(e["source"], e["event"]) for e in doc["edges"]} == {
        (e.source, e.event) for e in store_sender_run.spec.edges()
    }


def test_coverage_overlay_marks_untaken_edges_and_leaves_plain_diagrams_alone() -> None:
    spec = kvfsm.load(KV_REQUEST)
    machine = spec_machine(spec, StoreSender)
    one = machine()  # one short example, step by step: pinned → queued, then close()
    one.begin("req-1")
    one.fire("req-1", "enqueue")
    one.teardown()
    dot = to_dot(spec, coverage=machine.coverage.taken())
    complete = next(line for line in dot.splitlines() if '-> "done"' in line)
    assert "never taken" in complete and "style=dotted" in complete
    enqueue = next(line for line in dot.splitlines() if '"pinned" -> "queued"' in line)
    assert "taken" in enqueue and "never" not in enqueue
    assert "transition coverage:" in dot
    assert to_dot(spec) == to_dot(spec, coverage=None) and "taken" not in to_dot(spec)


# -- usable as a pytest test class -----------------------------------------------------


TestStoreSenderKeepsToSpec = spec_machine(KV_REQUEST, StoreSender).TestCase
TestStoreSenderKeepsToSpec.settings = settings(
    max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)


def test_the_test_class_fails_for_a_buggy_driver_with_the_story() -> None:
    case = spec_machine(CPU_HIT, UnpinsOnlyLoadedHits).TestCase
    case.settings = FIND
    with pytest.raises(SpecViolation, match="observe says cpu_pin still held"):
        case("runTest").runTest()


def test_a_subclass_can_add_its_own_invariant() -> None:
    """The pool's own invariant, checked after every step on top of the spec's."""
    from hypothesis.stateful import invariant

    class PoolBalanced(spec_machine(KV_REQUEST, StoreSender)):  # type: ignore[misc]
        @invariant()
        def pool_blocks_match_the_blocks_held(self) -> None:
            driver = self.driver
            assert isinstance(driver, StoreSender)
            held = sum(len(driver.gpu.held_by(k)) for k in self.keys)
            assert driver.gpu.in_use() == held

    assert issubclass(PoolBalanced, SpecMachine)
    run_state_machine_as_test(PoolBalanced, settings=settings(max_examples=30, database=None, deadline=None))


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "factory"), [(KV_REQUEST, StoreSender), (CPU_HIT, CpuHitLoader)], ids=["kv", "cpu"])
def test_correct_drivers_hold_up_in_a_long_campaign(spec: object, factory: type) -> None:
    report = run(spec, factory, examples=3000)  # type: ignore[arg-type]
    assert report.passed, f"seed {report.seed}:\n{story(report)}"
    assert report.coverage.summary()["edges"][0] == report.coverage.summary()["edges"][1]
