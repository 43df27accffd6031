"""Ranks, broadcast and counting: a role instantiated per TP rank, sends to every rank, waits for K of N."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_explore_liveness import spin_verdicts
from test_explore_system import write_pingpong

from kvfsm.explore import Trace, check_trace, explore
from kvfsm.explore.local import LocalSystem
from kvfsm.gen.promela import to_promela
from kvfsm.gen.spin import check_with_spin
from kvfsm.spec import SpecError
from kvfsm.spec.system import check_system, load_system

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "specs" / "explore"

needs_spin = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None, reason="needs Debian spin and gcc"
)


def fanin_counting_one(folder: Path) -> Path:
    """The fan-in composition where the prefill spec does not count its readers (a driver counting raw
    notifications, or none): the first decode rank's notification frees the prefill rank's blocks."""
    prefill = (BUNDLED.parent / "nixl_prefill.yaml").read_text()
    counted = "payload: [readers], count: readers"
    assert counted in prefill
    (folder / "nixl_prefill.yaml").write_text(prefill.replace(counted, "payload: [readers]"))
    text = (BUNDLED / "nixl_fanin.yaml").read_text().replace("spec: ../nixl_prefill.yaml", "spec: nixl_prefill.yaml")
    text = text.replace("spec: nixl_mla", f"spec: {BUNDLED}/nixl_mla")
    path = folder / "nixl_fanin_one.yaml"
    path.write_text(text)
    return path


def test_the_count_comes_from_the_receivers_spec_and_is_declared_once(tmp_path: Path) -> None:
    system = load_system(BUNDLED / "nixl_fanin.yaml")
    assert system.messages["read"].count == -1, "every decode rank, as the prefill spec's count: readers says"
    text = (BUNDLED / "nixl_fanin.yaml").read_text().replace("to: prefill, doc", "to: prefill, count: all, doc")
    text = text.replace("spec: ../", f"spec: {BUNDLED}/../").replace("spec: nixl_mla", f"spec: {BUNDLED}/nixl_mla")
    twice = tmp_path / "twice.yaml"
    twice.write_text(text)
    findings = [f for f in check_system(twice) if f.code == "KVF216"]
    assert findings and "one count, in one place" in findings[0].message


def test_a_send_to_a_role_with_ranks_reaches_every_rank() -> None:
    system = load_system(BUNDLED / "nixl_mla.yaml")
    assert system.roles["prefill"].ranks == 2
    expanded = system.expanded()
    assert list(expanded.roles) == ["prefill#0", "prefill#1", "decode"]
    assert expanded.outgoing("decode", "read") == ("read>prefill#0", "read>prefill#1")
    local = LocalSystem(expanded)
    complete = next(
        move
        for moves in local.moves
        for _j, move in moves
        if move.event == "complete" and all(k for _m, k in move.sent)
    )
    assert [local.message_names[m] for m, _k in complete.sent] == ["read>prefill#0", "read>prefill#1"]


def test_ranks_are_interchangeable_so_the_search_merges_their_permutations() -> None:
    result = explore(BUNDLED / "nixl_mla.yaml")
    assert result.verdict == "verified"
    assert result.local_states == 75 and result.nodes == 13


def test_the_mla_broadcast_with_the_relation_reversed_frees_under_the_read() -> None:
    result = explore(BUNDLED / "nixl_mla_reversed.yaml")
    (broken,) = result.violated
    assert broken.trace is not None and broken.trace.violation == "decode is in reading while prefill#0 is in expired"


def test_prefill_frees_only_once_every_decode_rank_has_said_so() -> None:
    result = explore(BUNDLED / "nixl_fanin.yaml")
    assert result.verdict == "verified"


def test_counting_one_of_two_frees_under_the_other_read(tmp_path: Path) -> None:
    system = load_system(fanin_counting_one(tmp_path))
    (broken,) = explore(system).violated
    trace = broken.trace
    assert trace is not None
    assert [(s.role, s.event, s.action) for s in trace.moves] == [
        ("decode#0", "complete", "fire"),
        ("prefill", "read@decode#0", "fire"),
    ]
    check_trace(Trace.from_dict(json.loads(json.dumps(trace.as_dict()))), system)


def test_a_counted_copy_waits_for_the_last_rank() -> None:
    system = load_system(BUNDLED / "nixl_fanin.yaml").expanded()
    local = LocalSystem(system)
    counted = [move for moves in local.moves for _j, move in moves if move.action == "count"]
    assert counted and all(m.role == 0 and m.source == m.target for m in counted)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("client: {spec: client.yaml, ranks: 0}", "ranks must be at least 1"),
        ("client: {spec: client.yaml, ranks: two}", "ranks must be a whole number"),
    ],
)
def test_malformed_ranks_are_schema_errors(tmp_path: Path, edit: str, message: str) -> None:
    path = write_pingpong(tmp_path, edits={"client: {spec: client.yaml}": edit})
    with pytest.raises(SpecError, match=message):
        load_system(path)


def test_a_malformed_count_is_a_schema_error(tmp_path: Path) -> None:
    path = write_pingpong(
        tmp_path, edits={"ping: {from: client, to: server}": "ping: {from: client, to: server, count: most}"}
    )
    with pytest.raises(SpecError, match="count must be a whole number"):
        load_system(path)


def test_a_count_beyond_the_sender_ranks_is_a_finding(tmp_path: Path) -> None:
    path = write_pingpong(
        tmp_path, edits={"ping: {from: client, to: server}": "ping: {from: client, to: server, count: 2}"}
    )
    found = [f for f in check_system(path) if f.code == "KVF215"]
    assert found and "counted to 2, but 'client' has 1 rank(s)" in found[0].message


@needs_spin
@pytest.mark.spin
def test_spin_agrees_when_one_count_is_enough(tmp_path: Path) -> None:
    """The violated counting variant, two requests; the bundled compositions are checked in test_promela.py."""
    system = load_system(fanin_counting_one(tmp_path))
    ours = explore(system, requests=2, symmetry=False, merge=False)
    spin = check_with_spin(
        to_promela(system, requests=2), tmp_path / "safety", optimise="-O0", hash_bits=18, depth=100_000
    )
    assert spin.complete and spin.states == ours.states
    assert set(spin.violated) == {p.name for p in ours.violated if p.kind != "eventually"}
    assert spin_verdicts(system, tmp_path / "live") == {
        p.name: p.status for p in explore(system, requests=1).properties if p.kind == "eventually"
    }
