"""The benchmark suite: its report structure, and that every variant it times does the same work.

No timing is asserted here; the figures come from the full run (benchmarks/README.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable
from typing import Any

import pytest

import kvfsm
from kvfsm.engine import compile_program
from kvfsm.engine.program import CEdge
from kvfsm.showcase.bench import BenchReport, Row, Target, format_table, run
from kvfsm.showcase.bench.__main__ import main
from kvfsm.showcase.bench.handwritten import (
    IGNORE,
    KV_REQUEST_STATES,
    HandTracker,
    kv_request_tracker,
    pingpong_tracker,
)
from kvfsm.showcase.bench.harness import NullDriver, RecordingDriver, VirtualClock
from kvfsm.showcase.bench.workloads import kv_request_spec, make_lifecycle_trackers, pingpong_spec


@pytest.fixture(scope="module")
def quick_report() -> tuple[BenchReport, list[tuple[str, int, int]]]:
    calls: list[tuple[str, int, int]] = []
    report = run(quick=True, progress=lambda label, done, total: calls.append((label, done, total)))
    return report, calls


def test_quick_run_reports_a_row_for_every_variant(quick_report: tuple[BenchReport, Any]) -> None:
    report, _ = quick_report
    names = {r.name for r in report.rows}
    assert {"hand-written", "Tracker", "transitions", "python-statemachine"} <= names
    assert {"Tracker, N=100", "Tracker, N=10,000", "Tracker, N=10,000, shuffled keys"} <= names
    assert any(n.startswith("Tracker, transferring") for n in names)
    assert "Tracker, 0 due" in names
    for r in report.rows:
        assert isinstance(r, Row)
        assert r.value > 0 and math.isfinite(r.value), r
        assert r.unit
        if r.ratio is not None:
            assert r.baseline is not None
            assert r.ratio == pytest.approx(r.value / report.row(r.baseline).value)


def test_quick_run_judges_every_target_of_the_issue(quick_report: tuple[BenchReport, Any]) -> None:
    report, _ = quick_report
    descriptions = [t.description for t in report.targets]
    for needle in ("hand-written ≤ 1.5", "transitions", "live ≤ 1.3", "deadline armed ≤ 250", "10% due / 1% due"):
        assert any(needle in d for d in descriptions), needle
    for t in report.targets:
        assert isinstance(t, Target)
        _description, measured, threshold, passed = t
        assert isinstance(passed, bool) and threshold > 0 and math.isfinite(measured)
    assert report.passed == all(t.passed for t in report.targets)


def test_progress_is_told_each_step_then_done(quick_report: tuple[BenchReport, Any]) -> None:
    _, calls = quick_report
    total = calls[0][2]
    assert [done for _label, done, _total in calls] == list(range(total + 1))
    assert calls[-1] == ("done", total, total)
    assert all(t == total for _label, _done, t in calls)


def test_report_renders_as_a_table_and_as_json(quick_report: tuple[BenchReport, Any]) -> None:
    report, _ = quick_report
    text = format_table(report)
    for r in report.rows:
        assert r.name in text
    assert text.count("PASS") + text.count("FAIL") == len(report.targets)
    data = json.loads(json.dumps(report.as_dict()))
    assert len(data["rows"]) == len(report.rows) and data["quick"] is True


def test_module_entry_prints_json_and_exits_zero_on_a_quick_run(
    quick_report: tuple[BenchReport, Any], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry's own work (flags, progress on stderr, JSON, exit status) on the module's quick run, not a second
    one: the run itself is what the tests above hold to account."""
    import kvfsm.showcase.bench.__main__ as entry

    asked: list[bool] = []

    def the_quick_run(*, quick: bool, progress: Any, spec_path: str | None) -> BenchReport:
        asked.append(quick)
        progress("lifecycle", 0, 1)
        return quick_report[0]

    monkeypatch.setattr(entry, "run", the_quick_run)
    assert main(["--quick", "--json"]) == 0
    shown = capsys.readouterr()
    assert asked == [True] and "[1/1] lifecycle" in shown.err
    assert json.loads(shown.out)["targets"]


def _lifecycle_calls(variant: str) -> tuple[list[tuple[str, Hashable]], list[tuple[Hashable, str]]]:
    driver = RecordingDriver()
    tracker = make_lifecycle_trackers(kv_request_spec(), driver)[variant]()
    keys = [f"req-{i}" for i in range(5)]
    for k in keys:
        tracker.begin(k)
    for event in ("enqueue", "start", "complete"):
        for k in keys:
            tracker.fire(k, event)
    return driver.calls, tracker.finished()


@pytest.mark.parametrize("variant", ["hand-written", "transitions", "python-statemachine"])
def test_every_lifecycle_variant_makes_the_trackers_driver_calls(variant: str) -> None:
    if variant == "python-statemachine":
        pytest.importorskip("statemachine")
    assert _lifecycle_calls(variant) == _lifecycle_calls("Tracker")


def _names(actions: Any) -> list[str]:
    return [a.__name__ for a in actions]


def _assert_table_is_the_spec(hand: HandTracker, spec: kvfsm.Spec, names: tuple[str, ...]) -> None:
    """The hand-written table accepts, ignores and rejects exactly what the compiled spec does, with its actions."""
    program = compile_program(spec, NullDriver())
    assert tuple(s.name for s in program.states) == names
    for state, row in zip(program.states, hand.table, strict=True):
        assert set(row) == set(state.row), state.name
        for event, edge in state.row.items():
            mine = row[event]
            if edge is None:  # ignored
                assert mine is IGNORE, (state.name, event)
                continue
            assert isinstance(edge, CEdge)
            target, before, releases, timeout, final = mine
            assert names[target] == edge.target.name
            assert _names(before) == ([edge.do_name] if edge.do_name else []) + [a[0] for a in edge.acquires]
            assert _names(releases) == [r[0] for r in edge.releases]
            assert timeout == edge.target.after and final == edge.target.final


def test_hand_written_kv_request_table_is_the_canonical_spec() -> None:
    hand = kv_request_tracker(NullDriver(), VirtualClock())
    _assert_table_is_the_spec(hand, kv_request_spec(), KV_REQUEST_STATES)


def test_hand_written_pingpong_table_is_the_scaling_spec() -> None:
    hand = pingpong_tracker(NullDriver(), VirtualClock())
    _assert_table_is_the_spec(hand, pingpong_spec(), ("idle", "busy", "aborted"))


def test_hand_written_poll_fires_only_due_live_deadlines() -> None:
    clock = VirtualClock()
    hand = kv_request_tracker(RecordingDriver(), clock, transfer_timeout=10.0)
    for i, key in enumerate(("a", "b", "c")):
        hand.begin(key)
        hand.fire(key, "enqueue")
        clock.now = float(i)
        hand.fire(key, "start")
    hand.fire("a", "complete")  # disarms a's deadline (lazily)
    assert hand.poll(11.5) == 1  # only b: a left transferring, c is due at 12
    assert sorted(hand.finished()) == [("a", "done"), ("b", "expired")]
