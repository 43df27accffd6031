"""The explorer follows ``owns:`` as the engine runs it: a request and the store jobs it owns.

The engine fires a parent's ``ended`` and ``failed`` and passes its
``forward`` events on, under the family's one lock; the explorer makes the
same changes in the same move (``Move.owner``) and never fires those events
otherwise. Checked three ways: the bundled store family is verified, a
request that frees at its first failed job is caught with the engine's move
in the trace, and random walks of the explorer's moves replayed on real
Trackers land in the same states, move by move.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_owns import JOB, REQUEST, Log

from kvfsm import Tracker
from kvfsm.explore import explore
from kvfsm.explore.limits import ExploreError
from kvfsm.explore.local import RETIRED, LocalSystem
from kvfsm.explore.trace import Trace, TraceError, check_trace
from kvfsm.gen.promela import to_promela
from kvfsm.spec import read_text
from kvfsm.spec.system import load_system

ROOT = Path(__file__).resolve().parent.parent

SYSTEM = """\
kvfsm: 1
system: request_jobs
roles:
  request: {spec: request.yaml}
  job:     {spec: job.yaml, ranks: 2}
messages: {}
channel: {capacity: 1}
requests: 1
properties:
  never:
    - {name: freed_while_pinned, when: {request: [sent, failed], job: pinned}}
  eventually: [final, released]
"""


@pytest.fixture
def family_system(tmp_path: Path) -> Path:
    (tmp_path / "request.yaml").write_text(REQUEST)
    (tmp_path / "job.yaml").write_text(JOB)
    (tmp_path / "system.yaml").write_text(SYSTEM)
    return tmp_path / "system.yaml"


def test_the_store_request_and_its_jobs_are_verified() -> None:
    result = explore(load_system(ROOT / "specs" / "explore" / "mooncake_store_jobs.yaml"))
    assert result.verdict == "verified", [(p.name, p.status) for p in result.properties]


def test_a_request_that_frees_at_its_first_failed_job_is_caught_with_the_engines_move() -> None:
    system = load_system(ROOT / "tests" / "specs" / "owns" / "frees_on_failure.yaml")
    result = explore(system)
    [trace] = [p.trace for p in result.properties if p.name == "freed_while_pinned" and p.trace is not None]
    last = trace.steps[-1]
    assert (last.role, last.cause, last.event, last.target) == ("request", "owner", "job_failed", "sent")
    check_trace(trace, system)
    forged = json.loads(json.dumps(trace.as_dict()))
    forged["steps"][-1]["cause"] = "local"  # as if the request fired it on its own
    with pytest.raises(TraceError, match="fired by the engine"):
        check_trace(Trace.from_dict(forged), system)


def test_the_family_is_verified_and_its_engine_events_never_fire_on_their_own(family_system: Path) -> None:
    system = load_system(family_system)
    assert explore(system).verdict == "verified"
    local = LocalSystem(system.expanded())
    request = [r.name for r in local.roles].index("request")
    for moves in local.moves:
        for _j, move in moves:
            if move.role == request:
                assert move.event not in ("jobs_ended", "job_failed"), move
    with pytest.raises(ExploreError, match="owns"):
        to_promela(system)


@pytest.mark.parametrize("seed", range(40))
def test_the_explorer_and_the_engine_agree_on_every_family_move(family_system: Path, seed: int) -> None:
    """A random walk of the explorer's moves, each replayed on a request Tracker and its jobs' Tracker: after
    every move, every instance is where the explorer says (the engine's own moves included)."""
    local = LocalSystem(load_system(family_system).expanded())
    names = [r.name for r in local.roles]
    log = Log()
    requests = Tracker(read_text(REQUEST), log)
    jobs = Tracker(read_text(JOB), log, parent=requests)
    keys = {"request": "r"} | {f"job#{k}": f"j{k}" for k in range(2)}
    requests.begin("r")
    for k in range(2):
        jobs.begin(f"j{k}", request_id="r")
    rng = random.Random(seed)
    i = local.initial
    for _ in range(12):
        if local.states[i] == RETIRED or not local.moves[i]:
            break
        j, move = rng.choice(local.moves[i])
        expected = local.placed(local.states[i][0], move)
        name = names[move.role]
        (requests if name == "request" else jobs).fire(keys[name], move.event)
        for r, role in enumerate(local.roles):
            tracker = requests if role.name == "request" else jobs
            assert tracker.state(keys[role.name]) == role.states[expected[r]], (seed, move, role.name)
        i = j


def test_a_nixl_request_frees_its_blocks_only_once_no_read_can_write_them() -> None:
    """docs/nixl.md §6: a released READ still lands. The bundled decode request keeps its blocks until its READs
    have stopped, on every interleaving; the driver's old spec, which freed them on giving up, is caught."""
    result = explore(load_system(ROOT / "specs" / "explore" / "nixl_reads.yaml"))
    assert result.verdict == "verified", [(p.name, p.status) for p in result.properties]
    system = load_system(ROOT / "tests" / "specs" / "owns" / "nixl_reads_frees_at_give_up.yaml")
    caught = explore(system)
    [trace] = [p.trace for p in caught.properties if p.name == "read_after_free" and p.trace is not None]
    gave_up = [s for s in trace.steps if s.role == "decode" and s.event is not None]
    assert gave_up and gave_up[-1].target in ("failed", "aborted", "expired"), trace.steps
    check_trace(trace, system)
