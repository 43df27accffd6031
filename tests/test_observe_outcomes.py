"""drain_outcomes: a tracker's finished instances and anomalies become counts, in one place for every driver."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections import Counter
from pathlib import Path

import pytest

import kvfsm
from kvfsm.observe import drain_outcomes

SPEC = kvfsm.parse(
    """
kvfsm: 1
machine: job
key: job_id
resources:
  slot: {release: free_slot}
states:
  running: {initial: true, holds: [slot], waits: local}
  done:    {final: success}
  failed:  {final: failure}
transitions:
  - {event: complete, from: running, to: done}
  - {event: fail,     from: running, to: failed}
  - {event: abort,    from: running, to: failed}
ignore:
  - {event: [complete, fail, abort], in: [done, failed]}
"""
)


class Driver:
    def free_slot(self, key: object, /) -> None:
        pass


def _tracker() -> kvfsm.Tracker:
    tracker = kvfsm.Tracker(SPEC, Driver())
    for key, event in (("a", "complete"), ("b", "complete"), ("c", "fail")):
        tracker.begin(key)
        tracker.fire(key, event)
    tracker.begin("d")  # still running: not an outcome yet
    return tracker


def test_finished_instances_are_counted_by_final_state_once() -> None:
    tracker = _tracker()
    outcomes: Counter[str] = Counter()
    drain_outcomes(tracker, outcomes)
    drain_outcomes(tracker, outcomes)  # drained: the second call finds nothing new
    assert outcomes == {"done": 2, "failed": 1}


def test_a_prefix_keeps_two_trackers_apart_in_one_plain_dict() -> None:
    outcomes: dict[str, int] = {}
    drain_outcomes(_tracker(), outcomes, prefix="send:")
    drain_outcomes(_tracker(), outcomes, prefix="load.")
    assert outcomes == {"send:done": 2, "send:failed": 1, "load.done": 2, "load.failed": 1}


def test_anomalies_are_counted_by_kind_and_space_and_returned_with_their_ids() -> None:
    tracker = _tracker()
    tracker.finished()
    tracker.fire("a", "complete")  # drained: late
    tracker.fire("zz", "complete")  # never begun: unknown
    anomalies: Counter[str] = Counter()
    drained = drain_outcomes(tracker, Counter(), anomalies)
    assert anomalies == {"late:job_id": 1, "unknown:job_id": 1}
    assert sorted(str(a.id) for a in drained) == ["a", "zz"]


def test_without_a_mapping_for_them_the_anomalies_stay_with_the_tracker() -> None:
    tracker = _tracker()
    tracker.fire("zz", "complete")
    assert drain_outcomes(tracker, Counter()) == []
    assert [a.kind for a in tracker.anomalies()] == ["unknown"]


DRAINERS = [
    "kvfsm.drivers.nixl.prefill",
    "kvfsm.drivers.nixl.decode",
    "kvfsm.drivers.moriio.side",
    "kvfsm.drivers.mooncake.worker",
    "kvfsm.adapters.vllm_cpu_offload",
]


@pytest.mark.parametrize("name", DRAINERS)
def test_no_driver_writes_its_own_loop_over_finished_or_anomalies(name: str) -> None:
    """Each counted its tracker's outcomes in a loop of its own; they all drain through kvfsm.observe now."""
    if name == "kvfsm.adapters.vllm_cpu_offload":
        pytest.importorskip("vllm", reason="the vLLM adapter needs vllm")
    source = ast.parse(Path(inspect.getfile(importlib.import_module(name))).read_text())
    loops = [
        node.lineno
        for node in ast.walk(source)
        if isinstance(node, ast.For)
        and isinstance(node.iter, ast.Call)
        and isinstance(node.iter.func, ast.Attribute)
        and node.iter.func.attr in ("finished", "anomalies")
    ]
    assert loops == []
