"""A composition's trace set: every reachable role edge and message, chosen from the explorer's own moves of one
request, replayed on the PD loopback's real drivers (and on the ledger for every bundled system)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from buggy_drivers import FreesOnlyOnAck, frees_only_on_ack, never_takes_pages

from kvfsm.cli import main
from kvfsm.drivers import pd_loopback
from kvfsm.drivers.pd_loopback import PDLoopback
from kvfsm.explore import check_trace, explore
from kvfsm.explore.local import LocalSystem, Move
from kvfsm.showcase import moriio_modeltest as moriio_model
from kvfsm.showcase import nixl_seed
from kvfsm.showcase.mooncake_modeltest import embedded_job, embedded_requests
from kvfsm.spec.system import System, check_system, is_system_file, load_system
from kvfsm.testing import Bar
from kvfsm.testing.bar import ExemptionError
from kvfsm.testing.contract import DriverFactory
from kvfsm.testing.trace_replay import TraceRun
from kvfsm.testing.trace_set import Item, TraceSet, cover_system, items, trace_set

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PD = ROOT / "specs" / "pd_abort"
CORRECTED, MERGED = PD / "corrected.yaml", PD / "merged_fix.yaml"


def paired(decode: type[FreesOnlyOnAck]) -> dict[str, DriverFactory]:
    """The loopback's prefill with a buggy decode on the same loopback (a trace run makes prefill first)."""
    loops: list[PDLoopback] = []

    def prefill() -> object:
        loops.append(PDLoopback())
        return loops[-1].prefill

    return {"prefill": prefill, "decode": lambda: decode(loops[-1])}


# -- the set -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CORRECTED, MERGED], ids=["corrected", "merged_fix"])
def test_the_set_exercises_every_item_the_walk_reaches_with_few_shortest_traces(path: Path) -> None:
    system = load_system(path)
    chosen = trace_set(system)
    assert set(chosen.reachable) | set(chosen.unreachable) == set(items(system))
    assert {i for i in chosen.reachable if i.kind == "message"} == {
        Item("message", m.receiver, "", m.name, "") for m in system.messages.values()
    }  # every message of the PD protocol is delivered on some run
    assert len(chosen.traces) < len(chosen.reachable)
    for trace in chosen.traces:
        check_trace(trace, system)  # each is a run the system can make
        assert len(trace.moves) <= 7
    # Every role state the explorer reaches for one request is some exercised edge's source or target.
    reached = {(i.role, s) for i in chosen.reachable if i.kind == "edge" for s in (i.source, i.target)}
    result = explore(system, requests=1)
    every = {(r, s) for r, role in system.roles.items() for s in role.spec.states}
    assert reached == every - set(result.unreached)


SYSTEMS = sorted(
    p
    for p in (ROOT / "kvfsm" / "specs").rglob("*.yaml")
    if is_system_file(p) and not any(f.severity == "error" for f in check_system(p))  # pre-fix shapes are refused
)
CRASHES = ROOT / "specs" / "explore" / "pd_prefill_crash.yaml"
RANKS = ROOT / "specs" / "explore" / "nixl_fanin.yaml"  # ranks, a counted message and a timeout relation
FAMILY = ROOT / "specs" / "explore" / "mooncake_store_jobs.yaml"  # owns: and ranks


def explorer_items(system: System) -> set[Item]:
    """What the explorer's moves of one request exercise, read off its local system's moves (not off traces):
    every move that breaks no property, from every local state it builds."""
    wide = system.expanded()
    local = LocalSystem(wide)
    found: set[Item] = set()

    def item(move: Move) -> set[Item]:
        role = local.roles[move.role]
        name, spec = wide.base_of(role.name), system.roles[wide.base_of(role.name)].spec
        source, target = role.states[move.source], role.states[move.target]
        event = wide.messages[move.event].event if move.cause == "message" else move.event
        out = {Item("message", name, "", event, "")} if move.cause == "message" else set()
        if move.action == "ignore":
            out.add(Item("ignored", name, source, event, source))
        elif move.action == "fire":
            edge = spec.table.get((source, event))
            out.add(Item("edge", name, source, event, edge.target if edge is not None else target))
        for r, ev, s, t in move.owner:
            kin = local.roles[r]
            out.add(Item("edge", wide.base_of(kin.name), kin.states[s], ev, kin.states[t]))
        return out

    for i in range(len(local.states)):
        for j, move in (*local.moves[i], *((i, m) for m in local.loops[i])):
            if j >= 0 and move.violation is None:
                found |= item(move)
    return found


def covered(chosen: TraceSet) -> set[Item]:
    return {c for t in chosen.traces for s in t.moves for c in chosen.covered_by(s)}


@pytest.mark.parametrize("path", SYSTEMS, ids=[p.stem for p in SYSTEMS])
def test_every_bundled_system_gets_a_trace_set_whose_items_are_what_the_explorer_reaches(path: Path) -> None:
    system = load_system(path)
    chosen = trace_set(system)
    assert set(chosen.reachable) == explorer_items(system)  # one walk: the two can no longer drift apart
    assert set(chosen.reachable) | set(chosen.unreachable) == set(items(system))
    assert covered(chosen) == set(chosen.reachable)
    # Every role state the explorer reaches for one request is some exercised edge's end, or where a role begins.
    ends = {(i.role, s) for i in chosen.reachable if i.kind == "edge" for s in (i.source, i.target)}
    begins = {(r, role.spec.initial.name) for r, role in system.roles.items()}
    unreached = {(system.expanded().base_of(r), s) for r, s in explore(system, requests=1).unreached}
    every = {(r, s) for r, role in system.roles.items() for s in role.spec.states}
    assert (every - unreached) <= ends | begins


@pytest.mark.parametrize("path", [CRASHES, RANKS], ids=["crashes", "ranks"])
def test_a_system_with_crashes_or_ranks_gets_a_trace_set_of_runs_it_can_make(path: Path) -> None:
    system = load_system(path)
    chosen = trace_set(system)
    for trace in chosen.traces:
        check_trace(trace, system)
    assert covered(chosen) == set(chosen.reachable) == explorer_items(system)
    if path == CRASHES:
        assert "prefill: bootstrapping --crash--> crashed" in {i.name for i in chosen.reachable}
    else:  # a rank's instance moves, and the declared role's item is exercised
        assert any(s.role == "decode#1" for t in chosen.traces for s in t.moves)
        assert {i.role for i in chosen.reachable} == set(system.roles)


@pytest.mark.parametrize("path", SYSTEMS, ids=[p.stem for p in SYSTEMS])
def test_every_bundled_system_replays_on_the_ledger(path: Path) -> None:
    system = load_system(path)
    result = cover_system(system)
    assert result.passed, result.summary()
    kinds = {i.kind for i in result.exercised}
    assert kinds >= ({"edge", "message"} if system.messages else {"edge"})  # a family is linked, not messaged


REAL_DRIVERS: dict[str, Callable[..., object]] = {
    "mooncake_store_request": embedded_requests,
    "mooncake_store_send": embedded_job,
    "moriio_write_producer": moriio_model.writer,
    "moriio_write_consumer": moriio_model.receiver,
    "moriio_read_producer": moriio_model.lender,
    "moriio_read_consumer": moriio_model.reader,
    "nixl_prefill": nixl_seed.holder,
    "nixl_decode": nixl_seed.correct_reader,
    "nixl_read": nixl_seed.reads,
}
"""The real driver of each bundled machine a system runs (explorer-only variants, such as a decode that counts from
the hand-over, run on the ledger): the drivers over real tensors and embedded fabrics or stores."""


@pytest.mark.parametrize("path", SYSTEMS, ids=[p.stem for p in SYSTEMS])
def test_every_bundled_system_replays_its_trace_set_on_the_real_drivers(path: Path) -> None:
    system = load_system(path)
    loopback = pd_loopback.factories()  # the PD roles (every variant of the specs) share one loopback per run
    drivers: dict[str, DriverFactory] = {
        role: loopback[role] if r.spec.name.startswith(("pd_prefill", "pd_decode")) else REAL_DRIVERS[r.spec.name]
        for role, r in system.roles.items()
        if r.spec.name in REAL_DRIVERS or r.spec.name.startswith(("pd_prefill", "pd_decode"))
    }
    result = cover_system(system, drivers)
    assert result.passed, result.summary()
    assert result.exercised == set(result.reachable)
    assert drivers and all(result.drivers[role] != "ledger (built in)" for role in drivers), result.drivers


def test_items_no_run_can_reach_are_listed_apart_not_required() -> None:
    chosen = trace_set(CORRECTED)
    names = {i.name for i in chosen.unreachable}
    # A finished prefill's server answers a late ABORT (reply_if_finished): the ignore rule never applies.
    assert "prefill: ignored abort_req in done" in names
    assert "decode: ignored abort_ack in waiting" in names  # no ABORT was sent from waiting
    assert not any(i.kind == "edge" for i in chosen.unreachable)


# -- replayed on the real drivers ------------------------------------------------------------------


@pytest.mark.parametrize("path", [CORRECTED, MERGED], ids=["corrected", "merged_fix"])
def test_the_loopback_drivers_keep_to_every_trace_of_the_set(path: Path) -> None:
    result = cover_system(path, pd_loopback.factories())
    assert result.passed, result.summary()
    assert result.exercised == set(result.reachable) and result.ratio == 1.0
    assert result.drivers == {"prefill": "PrefillDriver", "decode": "DecodeDriver"}
    assert all(r.matched == len(r.trace.moves) for r in result.runs)


@pytest.mark.parametrize(
    ("path", "drivers"),
    [
        (FAMILY, {"request": embedded_requests, "job": embedded_job}),
        (FAMILY.with_name("nixl_reads.yaml"), {"decode": nixl_seed.correct_reader, "read": nixl_seed.reads}),
    ],
    ids=["mooncake_store_jobs", "nixl_reads"],
)
def test_a_family_replays_on_its_real_drivers_the_engine_firing_the_owner_steps(
    path: Path, drivers: dict[str, Callable[..., object]]
) -> None:
    """The children (one tracker for every rank, keys ``r0#1``) are attached to the parent's tracker, their factory
    gets the parent's driver, and the ``ended``/``failed``/forwarded steps are the engine's own: a trace run only
    checks where they left each instance."""
    result = cover_system(path, drivers)
    assert result.passed, result.summary()
    assert result.exercised == set(result.reachable)
    trace = next(t for t in trace_set(path).traces if any(s.cause == "owner" for s in t.steps))
    done = TraceRun(path, trace, drivers).run().steps
    owner = [s for s in done if s.step.cause == "owner"]
    assert owner and all(s.call.startswith("none (the engine fired it") and s.mismatch is None for s in owner)


@pytest.mark.parametrize(
    "path", [CRASHES, CRASHES.with_name("pd_prefill_crash_no_restart.yaml")], ids=["restart", "none"]
)
def test_the_loopback_drivers_keep_to_every_trace_of_a_set_with_crashes(path: Path) -> None:
    """A crash step drops the prefill's tracker and driver as they are and a new pair stands in for the process
    that comes back: every crash edge, and the messages that reach the crashed instance, run on the real drivers."""
    result = cover_system(path, pd_loopback.factories())
    assert result.passed, result.summary()
    crashes = {i.name for i in result.exercised if "--crash-->" in i.name}
    assert {f"prefill: {s} --crash--> crashed" for s in ("bootstrapping", "waiting_input", "transferring")} <= crashes
    assert result.exercised == set(result.reachable)


@pytest.mark.parametrize(
    ("drivers", "first"),
    [
        pytest.param(paired(FreesOnlyOnAck), "observe: expected nothing, got FreesOnlyOnAck.observe says kv_pages"),
        pytest.param({"decode": frees_only_on_ack}, "observe: expected nothing, got FreesOnlyOnAck", id="ledger"),
        pytest.param({"decode": never_takes_pages}, "observe: expected kv_pages, got NeverTakesPages.observe says"),
    ],
)
def test_a_buggy_decode_fails_the_set_and_what_it_cut_off_is_named(
    drivers: dict[str, DriverFactory], first: str
) -> None:
    result = cover_system(CORRECTED, drivers)
    assert not result.passed and result.diverged
    assert first in str(result.diverged[0].mismatch)
    gaps = {i.name: why for i, why in result.gaps}
    assert "diverged at step" in gaps["decode: aborting --abort_ack--> aborted"]
    assert not result.cleared


def test_exemptions_name_items_and_need_a_reason() -> None:
    names = [i.name for i, _why in cover_system(CORRECTED, {"decode": frees_only_on_ack}).gaps]
    exempt = dict.fromkeys(names, "the ABORT_ACK path is tested against the real bootstrap server")
    lowered = cover_system(CORRECTED, {"decode": frees_only_on_ack}, bar=Bar(exempt=exempt))
    assert lowered.cleared and not lowered.gaps and len(lowered.exempted) == len(names)
    assert not lowered.passed  # a divergence fails the run whatever the bar
    with pytest.raises(ExemptionError, match="'message abort_akc' names nothing in machine 'pd_abort_corrected'"):
        cover_system(CORRECTED, bar=Bar(exempt={"message abort_akc": "typo"}))
    with pytest.raises(ExemptionError, match="gives no reason"):
        cover_system(CORRECTED, bar=Bar(exempt={"message abort_ack": ""}))


# -- from the command line ---------------------------------------------------------------------


def kvfsm_test(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """``kvfsm test ARGS`` in this process, from ``tests/`` (where buggy_drivers is importable): (exit, out, err)."""
    monkeypatch.chdir(TESTS)
    code = main(["test", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


LOOPBACK = (
    "--driver",
    "prefill=kvfsm.drivers.pd_loopback:prefill",
    "--driver",
    "decode=kvfsm.drivers.pd_loopback:decode",
)


def test_cli_a_system_file_replays_its_trace_set_on_the_drivers(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, err = kvfsm_test(capsys, monkeypatch, str(CORRECTED), *LOOPBACK)
    assert code == 0, out + err
    assert "✓ pd_abort_corrected: every reachable role edge (27), message (5) and ignored delivery" in out
    args = (str(CORRECTED), "--driver", "decode=buggy_drivers:frees_only_on_ack", "--format", "json")
    code, out, err = kvfsm_test(capsys, monkeypatch, *args)
    assert code == 1, out + err
    doc = json.loads(out)
    assert doc["drivers"]["prefill"] == "ledger (built in)" and not doc["passed"]
    assert "decode: aborting --abort_ack--> aborted" in {g["name"] for g in doc["coverage_verdict"]["not_reached"]}
    assert any(t["mismatch"] and t["mismatch"]["what"] == "observe" for t in doc["traces"])


def test_cli_a_system_file_refuses_what_only_a_random_run_takes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, _out, err = kvfsm_test(capsys, monkeypatch, str(CORRECTED), "--seed", "3", *LOOPBACK)
    assert code == 2 and "--seed does not apply to a system file" in err
    code, _out, err = kvfsm_test(capsys, monkeypatch, str(CORRECTED), "--driver", "kvfsm.drivers.pd_loopback:decode")
    assert code == 2 and "names no role; for a system file write ROLE=MODULE:FACTORY" in err
