"""The explorer: verdicts on the PD abort systems, each built-in property, reductions, traces, the CLI."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_explore_system import SERVER, write_pingpong

from kvfsm.explore import ExploreResult, Progress, Trace, TraceError, check_trace, explore, format_trace
from kvfsm.explore.automaton import build
from kvfsm.explore.local import LocalSystem
from kvfsm.explore.search import search
from kvfsm.spec.system import System, load_system
from kvfsm.testing import replay_trace

ROOT = Path(__file__).resolve().parent.parent
PD = ROOT / "specs" / "pd_abort"
MERGED, CORRECTED = PD / "merged_fix.yaml", PD / "corrected.yaml"

# Edits of the ping/pong composition that each break exactly one built-in property.
NO_NEVER = {"properties:\n  never:\n    - {name: served_but_failed, when: {client: failed, server: served}}\n": ""}
LATE = {"  - {event: pong, in: [idle, done, failed]}\n": "  - {event: pong, in: [idle]}\n"}
UNEXPECTED = {"  - {event: ping, in: [replying, served, gone]}\n": "  - {event: ping, in: [served, gone]}\n"}
RELIABLE_TINY = {
    "loss: true, duplicate: true, reorder: true, capacity: 2": "loss: false, duplicate: false, reorder: true, capacity: 1"
}
STUCK = {"  - {event: answer, from: replying, to: served, send: {to: client, message: pong}}\n": ""}
HOLDING = {
    **STUCK,
    "params: {idle_timeout: 30.0}\n": "params: {idle_timeout: 30.0}\nresources:\n  worker: {release: free_worker}\n",
    "replying:  {waits: local}": "replying:  {waits: local, holds: [worker]}",
}


def statuses(result: ExploreResult) -> dict[str, str]:
    return {p.name: p.status for p in result.properties}


def violated(result: ExploreResult) -> set[str]:
    return {p.name for p in result.violated}


def trace_of(result: ExploreResult, prop: str) -> Trace:
    found = next(p for p in result.properties if p.name == prop)
    assert found.trace is not None, f"{prop} has no trace"
    return found.trace


def replay(trace: Trace, system: System) -> None:
    """Run the trace on one real Tracker per role (ledger drivers): every step and the violation must show.

    The run judges the real objects with the explorer's own evaluator, so it says the very sentence the trace ends in.
    """
    result = replay_trace(system, trace)
    assert result.reproduced, result.summary
    assert trace.violation in result.summary


# -- the PD abort systems ----------------------------------------------------------------


def test_merged_fix_yields_the_residual_write_after_free_in_four_steps() -> None:
    result = explore(MERGED)
    assert result.verdict == "violated" and result.complete
    assert violated(result) == {"write_after_free"}
    trace = trace_of(result, "write_after_free")
    assert len(trace.moves) == 4
    last = {s.role: s for s in trace.steps if s.request == trace.request}
    assert last["prefill"].target in ("transferring", "draining")
    assert "kv_pages" not in last["decode"].holds
    # The pages are freed by decode's own abort or timeout, with ABORT sent: the merged fix's path.
    freeing = next(s for s in trace.moves if s.role == "decode" and s.note == "frees kv_pages")
    assert [x.message for x in freeing.sent] == ["abort_req"]


def test_corrected_is_verified() -> None:
    result = explore(CORRECTED, requests=4)
    assert result.verdict == "verified" and result.complete
    assert set(statuses(result).values()) == {"holds"}
    assert result.unreached == ()


@pytest.mark.slow
def test_corrected_is_verified_for_six_requests() -> None:
    result = explore(CORRECTED, requests=6)
    assert result.verdict == "verified" and result.states > 700_000


def test_merged_fix_trace_replays_on_real_trackers() -> None:
    system = load_system(MERGED)
    replay(trace_of(explore(system), "write_after_free"), system)


# -- each built-in property -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("edits", "prop", "last_action"),
    [
        pytest.param(LATE, "late_message", "reject", id="late-message"),
        pytest.param(UNEXPECTED, "unexpected_message", "reject", id="unexpected-message"),
        pytest.param(RELIABLE_TINY, "overflow", "fire", id="overflow"),
        pytest.param(STUCK, "deadlock", None, id="deadlock"),
        pytest.param(HOLDING, "leak", None, id="leak"),
        pytest.param({}, "served_but_failed", None, id="never"),
    ],
)
def test_builtin_and_never_properties_are_found_with_a_replayable_trace(
    tmp_path: Path, edits: dict[str, str], prop: str, last_action: str | None
) -> None:
    system = load_system(write_pingpong(tmp_path, edits={**edits, **(NO_NEVER if edits else {})}))
    result = explore(system)
    assert violated(result) == {prop}
    trace = trace_of(result, prop)
    if last_action is not None:
        assert trace.moves[-1].action == last_action
    replay(trace, system)


RECEIVED_TWICE = {
    "request": "r0",
    "role": "server",
    "action": "fire",
    "cause": "message",
    "event": "ping",
    "from": "listening",
    "to": "replying",
    "duplicate": True,
    "holds": [],
}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param(lambda d: d["steps"][4]["sent"][0].update(lost=True), "steps[4].sent[0].lost", id="loss"),
        pytest.param(
            lambda d: d.update(steps=[*d["steps"][:2], d["steps"][4], RECEIVED_TWICE], request="r0"),
            "steps[3].duplicate",
            id="duplicate",
        ),
    ],
)
def test_a_trace_the_channel_cannot_produce_is_refused(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], says: str
) -> None:
    system = load_system(write_pingpong(tmp_path, edits={**RELIABLE_TINY, **NO_NEVER}))
    doc = trace_of(explore(system), "overflow").as_dict()
    check_trace(Trace.from_dict(doc), system)
    change(doc)
    with pytest.raises(TraceError, match=r"the channel does not (lose|duplicate) messages") as caught:
        check_trace(Trace.from_dict(doc), system)
    assert caught.value.field == says


def test_pingpong_as_written_breaks_only_its_never_property(tmp_path: Path) -> None:
    result = explore(write_pingpong(tmp_path))
    assert statuses(result) == {
        "deadlock": "holds",
        "leak": "holds",
        "late_message": "holds",
        "unexpected_message": "holds",
        "overflow": "holds",
        "served_but_failed": "violated",
    }


def test_builtins_can_be_narrowed(tmp_path: Path) -> None:
    path = write_pingpong(tmp_path, edits={**LATE, "requests: 2": "requests: 2\nproperties:\n  builtins: [deadlock]"})
    path.write_text(path.read_text().replace("properties:\n  never:", "  never:"))
    result = explore(path)
    assert [p.name for p in result.properties] == ["deadlock", "served_but_failed"]


def test_deadlock_text_names_the_stuck_instance(tmp_path: Path) -> None:
    trace = trace_of(explore(write_pingpong(tmp_path, edits=STUCK)), "deadlock")
    assert "server in replying" in trace.violation


# -- reductions keep every verdict ----------------------------------------------------------


@pytest.mark.parametrize(
    "case",
    ["merged_fix", "corrected", "late", "unexpected", "stuck"],
)
def test_symmetry_and_merging_keep_every_verdict_and_shortest_length(tmp_path: Path, case: str) -> None:
    edits = {"late": LATE, "unexpected": UNEXPECTED, "stuck": STUCK}
    system = load_system(
        PD / f"{case}.yaml" if case in ("merged_fix", "corrected") else write_pingpong(tmp_path, edits=edits[case])
    )
    seen = set()
    for symmetry, merge in itertools.product((True, False), repeat=2):
        result = explore(system, requests=2, symmetry=symmetry, merge=merge)
        lengths = {p.name: (p.status, len(p.trace.moves) if p.trace else None) for p in result.properties}
        seen.add(tuple(sorted(lengths.items())))
    assert len(seen) == 1, seen


def test_symmetry_stores_one_state_per_permutation_of_requests() -> None:
    system = load_system(CORRECTED)
    auto = build(LocalSystem(system), merge=False)
    common = {"requests": 3, "capacity": system.channel.capacity, "properties": system.names}
    ordered = search(auto, symmetry=False, **common)
    symmetric = search(auto, symmetry=True, **common)
    codec = ordered.codec
    width, low = codec.width, codec.low
    classes = {
        tuple(sorted((s >> (low + width * k)) & ((1 << width) - 1) for k in range(3)))
        for level in ordered.levels
        for s in level
    }
    assert symmetric.states == len(classes) < ordered.states


def test_merging_shrinks_the_graph_and_grows_slowly_with_requests() -> None:
    counts = [explore(CORRECTED, requests=n).states for n in (1, 2, 3, 4)]
    plain = [explore(CORRECTED, requests=n, symmetry=False, merge=False).states for n in (1, 2)]
    assert counts[0] < plain[0] and counts[1] < plain[1]
    ratios = [b / a for a, b in itertools.pairwise(counts)]
    assert ratios == sorted(ratios, reverse=True)  # each added request multiplies the count by less


# -- search controls --------------------------------------------------------------------------


def test_first_stops_at_the_first_violation() -> None:
    full = explore(MERGED, requests=3)
    first = explore(MERGED, requests=3, first=True)
    assert violated(first) == {"write_after_free"} and not first.complete
    assert first.states < full.states
    assert len(trace_of(first, "write_after_free").moves) == len(trace_of(full, "write_after_free").moves)
    assert {p.status for p in first.properties if p.name != "write_after_free"} == {"unknown"}


def test_max_states_makes_the_verdict_incomplete() -> None:
    result = explore(CORRECTED, requests=3, max_states=500)
    assert result.verdict == "incomplete" and not result.complete
    assert set(statuses(result).values()) == {"unknown"}


def test_progress_reports_growing_counts() -> None:
    seen: list[Progress] = []
    explore(CORRECTED, requests=3, progress=seen.append)
    assert len(seen) >= 3
    assert [p.states for p in seen] == sorted(p.states for p in seen)
    assert seen[-1].depth > seen[0].depth


def test_requests_override_the_system_bound() -> None:
    assert explore(MERGED, requests=1).requests == 1
    with pytest.raises(ValueError, match="at least 1"):
        explore(MERGED, requests=0)


def test_unreachable_role_states_are_reported(tmp_path: Path) -> None:
    server = SERVER.replace(
        "  gone:      {final: failure}\n", "  gone:      {final: failure}\n  limbo:     {final: failure}\n"
    )
    result = explore(write_pingpong(tmp_path, server=server))
    assert result.unreached == (("server", "limbo"),)


# -- traces ------------------------------------------------------------------------------------


def test_trace_json_round_trips() -> None:
    trace = trace_of(explore(MERGED), "write_after_free")
    doc = json.loads(json.dumps(trace.as_dict()))
    assert doc["format"] == "kvfsm-trace/1"
    assert Trace.from_dict(doc) == trace


def test_trace_from_another_format_is_refused() -> None:
    with pytest.raises(ValueError, match="kvfsm-trace/1"):
        Trace.from_dict({"format": "other"})


def test_chart_shows_lanes_messages_and_the_violation() -> None:
    text = format_trace(trace_of(explore(MERGED), "write_after_free"))
    lines = text.splitlines()
    assert "prefill" in lines[3] and "decode" in lines[3]
    assert any("metadata" in line and "◀" in line for line in lines)
    assert lines[-1].startswith("  ✗ write_after_free (r0):")


def test_lost_message_is_drawn_crossed_out(tmp_path: Path) -> None:
    trace = trace_of(explore(write_pingpong(tmp_path)), "served_but_failed")
    assert any(s.lost for step in trace.moves for s in step.sent)
    assert "╳ lost" in format_trace(trace) or "lost ╳" in format_trace(trace)


# -- the benchmark ---------------------------------------------------------------------------


def test_bench_runs_every_setting_and_tabulates_it() -> None:
    from kvfsm.showcase.bench.explore import format_markdown, run

    runs = run(systems=("merged_fix",), requests=(1, 2), spin=False, time_limit=30)
    assert {(r.setting, r.requests) for r in runs} == {
        (s, n) for s in ("kvfsm", "kvfsm symmetry", "kvfsm plain") for n in (1, 2)
    }
    assert {r.verdict for r in runs} == {"violated"}
    plain = next(r for r in runs if r.setting == "kvfsm plain" and r.requests == 2)
    assert plain.states == explore(MERGED, requests=2, symmetry=False, merge=False).states
    table = format_markdown(runs)
    assert "**merged_fix** (violated)" in table and "| 2 | 462 · " in table


# -- the command line ---------------------------------------------------------------------------


def kvfsm_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "explore", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


def test_cli_merged_fix_exits_one_with_the_chart() -> None:
    result = kvfsm_cli(str(MERGED))
    assert result.returncode == 1, result.stderr
    assert "write_after_free: prefill is in transferring while decode lacks kv_pages" in result.stdout
    assert "violated" in result.stdout and "Traceback" not in result.stderr


def test_cli_corrected_exits_zero() -> None:
    result = kvfsm_cli(str(CORRECTED), "-n", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified" in result.stdout


def test_cli_json_and_trace_file(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    result = kvfsm_cli(str(MERGED), "-n", "2", "--format", "json", "--trace", str(out))
    assert result.returncode == 1
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "violated" and doc["requests"] == 2
    assert [p["name"] for p in doc["properties"] if p["status"] == "violated"] == ["write_after_free"]
    assert Trace.from_dict(json.loads(out.read_text())).prop == "write_after_free"


def test_cli_cut_short_exits_three() -> None:
    assert kvfsm_cli(str(CORRECTED), "--max-states", "100").returncode == 3


@pytest.mark.parametrize(
    ("args", "says"),
    [(["no/such.yaml"], "no such system file"), ([str(MERGED), "-n", "0"], "--requests must be at least 1")],
)
def test_cli_bad_input_is_a_usage_error_without_traceback(args: list[str], says: str) -> None:
    result = kvfsm_cli(*args)
    assert result.returncode == 2
    assert says in result.stdout + result.stderr and "Traceback" not in result.stdout + result.stderr


def test_cli_findings_in_a_broken_system_exit_two(tmp_path: Path) -> None:
    """A composition that fails its checks cannot be explored: unusable (2), never "violated" (1)."""
    result = kvfsm_cli(str(write_pingpong(tmp_path, edits={"message: ping}}": "message: pings}}"})))
    assert result.returncode == 2
    assert "KVF201" in result.stderr and "Traceback" not in result.stderr


def test_cli_writes_promela(tmp_path: Path) -> None:
    out = tmp_path / "model.pml"
    result = kvfsm_cli(str(MERGED), "-n", "2", "--promela", str(out))
    assert result.returncode == 0
    assert "#define N 2" in out.read_text()
