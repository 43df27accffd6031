"""Model-based tests of a family (``owns:``): a request's driver and its jobs' driver, held to one oracle.

The drivers share a real :class:`~kvfsm.drivers.block_pool.BlockPool`: a request holds its blocks, each job
pins them, and ``observe`` reads the pool. The outcome checked is the one a connector's user sees: a request's
blocks stay held while any job of it still pins them, and are let go once, after the last.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import pytest
from buggy_drivers import Faults, InjectedFault
from test_owns import JOB, NOTING, REQUEST

import kvfsm.testing
from kvfsm import ActionError
from kvfsm.cli import main
from kvfsm.drivers.block_pool import BlockPool
from kvfsm.engine.owners import Owner
from kvfsm.spec import read_text
from kvfsm.testing.family_oracle import FamilyModel


class Requests(Faults):
    """A request's side: blocks allocated from the pool while it lives."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(64)
        self.blocks: dict[Hashable, list[int]] = {}

    def hold(self, key: Hashable, /) -> None:
        self.maybe_raise("hold", key)
        self.blocks[key] = self.pool.allocate(("request", key), 2)

    def free(self, key: Hashable, /) -> None:
        self.pool.release(("request", key))

    def note_failure(self, key: Hashable, /) -> None:
        self.maybe_raise("note_failure", key)

    def observe(self, key: Hashable) -> set[str]:
        return {"blocks"} if self.pool.held_by(("request", key)) else set()


class Jobs(Faults):
    """A store job's side: a pin on its request's blocks, in the same pool."""

    def __init__(self, requests: Requests) -> None:
        super().__init__()
        self.requests = requests
        self.request_of: dict[Hashable, Hashable] = {}

    def pin(self, key: Hashable, /, request_id: Hashable) -> None:
        self.maybe_raise("pin", key)
        self.requests.pool.pin(("job", key), self.requests.blocks[request_id])
        self.request_of[key] = request_id

    def unpin(self, key: Hashable, /) -> None:
        self.requests.pool.release(("job", key))

    def put(self, key: Hashable, /) -> None:
        self.maybe_raise("put", key)

    def observe(self, key: Hashable) -> set[str]:
        return {"pin"} if self.requests.pool.held_by(("job", key)) else set()


class FreesOnFirstFailure(Jobs):
    """Written by hand: a job whose put fails gives its request's blocks back at once, under its other jobs."""

    def put(self, key: Hashable, /) -> None:
        try:
            super().put(key)
        except InjectedFault:
            self.requests.pool.release(("request", self.request_of[key]))
            raise


def run(request: str, jobs: type[Jobs], examples: int = 60) -> kvfsm.testing.RunReport:
    return kvfsm.testing.run(read_text(request), Requests, owned=(read_text(JOB), jobs), examples=examples, seed=7)


def test_a_family_whose_drivers_keep_to_it_passes_with_every_request_edge_taken() -> None:
    report = run(REQUEST, Jobs)
    assert report.passed, "\n".join(report.story) or report.error
    assert report.verdict is not None and report.verdict.ratio == 1.0
    assert report.owned is not None and report.owned.faults["put"], "a job failed while the test ran"


def test_a_job_that_frees_its_request_at_the_first_failure_is_caught() -> None:
    """One job failing while the other still pins the blocks: the request's observe shows them gone."""
    report = run(REQUEST, FreesOnFirstFailure)
    assert not report.passed
    assert report.problems[0] == "observe says blocks not held by req-1 (req-1 is draining, which holds blocks)"
    assert "put() raised (injected fault)" in report.story[-1]
    assert "job_failed req-1: running → draining" in report.story[-1], "the family's move is told in the story"
    assert report.found_by.endswith("is in flight")


def test_an_engine_that_loses_ended_after_a_raising_failed_action_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The class behind the engine defect the family tests found: the last child fails, the parent's action
    for ``failed`` raises, and ``ended`` must still fire. The old engine, put back, is caught."""

    def ended_in_one_try(self: Owner, key: Hashable, failed: bool) -> None:
        parent = self.parent_of.pop(key, None)
        live = self.children.get(parent) if parent is not None else None
        if live is None:
            return
        live.discard(key)
        if not live:
            del self.children[parent]
        try:
            if failed and self.rule.failed is not None:
                self.parent._poke(parent, self.rule.failed, None)
            if not live:
                self.parent._poke(parent, self.rule.ended, self)
        except ActionError as exc:
            self.child._failures.extend(exc.failures)

    assert run(NOTING, Jobs).passed
    monkeypatch.setattr(Owner, "ended", ended_in_one_try)
    report = run(NOTING, Jobs)
    assert not report.passed
    assert "Tracker says req-1 is in 'finishing', the spec says 'sent'" in report.problems
    assert "note_failure() raised (injected fault)" in report.story[-1]


def test_the_oracle_refuses_a_child_naming_no_live_parent() -> None:
    model = FamilyModel(read_text(REQUEST), read_text(JOB))
    assert model.begin_child("j", {"request_id": "r"}).refused == "orphan"
    model.begin("r")
    assert model.begin_child("j", {"request_id": "r"}).moves[0].target == "pinned"
    assert model.children == {"r": {"j"}}
    out = model.fire("r", "abort")  # forwarded: the job aborts, the last end fires jobs_ended
    assert [(m.key, m.event, m.target) for m in out.moves] == [
        ("r", "abort", "draining"),
        ("j", "abort", "aborted"),
        ("r", "jobs_ended", "failed"),
    ]
    assert out.state == "failed" and model.child.state("j") == "aborted"
    assert model.begin_child("k", {"request_id": "r"}).refused == "orphan"


def test_kvfsm_test_runs_a_family_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The owned machine's spec is found beside the parent's; ``--driver NAME=…`` gives its driver."""
    (tmp_path / "request.yaml").write_text(REQUEST)
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "family_drivers.py").write_text(
        "from test_family_model import FreesOnFirstFailure, Jobs, Requests\n"
    )
    monkey = pytest.MonkeyPatch()
    monkey.syspath_prepend(str(tmp_path))
    try:
        spec = str(tmp_path / "request.yaml")
        args = ["test", spec, "--driver", "family_drivers:Requests", "--seed", "7", "--examples", "60"]
        assert main([*args, "--driver", "jobs=family_drivers:Jobs"]) == 0
        assert "owned job (reported, not judged" in capsys.readouterr().out
        assert main([*args, "--driver", "jobs=family_drivers:FreesOnFirstFailure"]) == 1
        shown = capsys.readouterr().out
        assert "observe says blocks not held by req-1" in shown
        assert "--driver jobs=family_drivers:FreesOnFirstFailure" in shown, "the repeat line names both drivers"
        (tmp_path / "job.yaml").unlink()
        assert main(args) == 2
        assert f"put it in {tmp_path / 'job.yaml'}" in capsys.readouterr().err.replace("\n", "")
    finally:
        monkey.undo()
