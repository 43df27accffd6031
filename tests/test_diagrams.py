"""Diagrams: what they show, that they are deterministic, and that docs/diagrams/ is fresh."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvfsm
from kvfsm.cli import main
from kvfsm.gen.diagram import graphviz_formats, render, system_to_dot, system_to_mermaid, to_dot, to_mermaid
from kvfsm.spec import is_system_file, read, read_text
from kvfsm.spec.system import read_system

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(p for p in (ROOT / "specs").rglob("*.yaml") if not is_system_file(p))
"""Every bundled machine spec."""
SYSTEMS = sorted(p for p in (ROOT / "specs").rglob("*.yaml") if is_system_file(p))
"""Every bundled system file (a composition of roles)."""
DIAGRAMS = ROOT / "docs" / "diagrams"
FORMATS = {"svg": "svg", "mermaid": "mmd"}
PNGS = {
    "kv_request": "kv_request.yaml",
    "nixl_decode": "nixl_decode.yaml",
    "moriio_write_producer": "moriio/write_producer.yaml",
    "pd_abort_corrected": "pd_abort/corrected.yaml",
}
"""The pictures checked in as PNG (three machines and one system), by file name: `./dev.sh diagrams` draws them."""

PARALLEL = """
kvfsm: 1
machine: parallel
key: req
params: {wait_timeout: 5}
resources:
  blocks: {release: free_blocks}
states:
  waiting: {initial: true, holds: [blocks], timeout: {after: wait_timeout, fire: expire}}
  done: {final: success}
  failed: {final: failure}
transitions:
  - {event: ok, from: waiting, to: done}
  - {event: fine, from: waiting, to: done}
  - {event: peer_done, from: waiting, to: done}
  - {event: poll, from: waiting, to: waiting}
  - {event: nudge, from: waiting, to: waiting, do: ping}
  - {event: expire, from: waiting, to: failed}
  - {event: broken, from: waiting, to: failed}
events:
  peer_done: {by: req, remote: true}
"""
"""Two events from waiting to done (and one from a peer), two self-loops, and a deadline beside an event."""


def _edges(dot: str, source: str, target: str) -> list[str]:
    return [line for line in dot.splitlines() if f'"{source}" -> "{target}"' in line]


def test_dot_shows_holds_timeouts_releases_and_grouped_wildcards() -> None:
    dot = to_dot(kvfsm.load(ROOT / "specs" / "kv_request.yaml"))
    assert "holds: gpu_blocks, queue_slot" in dot
    assert "expire after transfer_timeout = 30 s" in dot and "style=dashed" in dot
    assert "complete<br/>frees gpu_blocks, queue_slot" in dot
    assert "start / start_transfer()" in dot
    # abort from "*" is one edge from one group node, not one per live state
    abort_edges = [line for line in dot.splitlines() if '-> "aborted"' in line]
    assert len(abort_edges) == 1 and "any live state" in dot


def test_final_kinds_look_different() -> None:
    dot = to_dot(kvfsm.load(ROOT / "specs" / "kv_request.yaml"))
    done = next(line for line in dot.splitlines() if line.strip().startswith('"done"'))
    failed = next(line for line in dot.splitlines() if line.strip().startswith('"failed"'))
    assert "peripheries=2" in done and "peripheries=2" in failed
    assert done.split("fillcolor=")[1] != failed.split("fillcolor=")[1]


def test_ignores_are_drawn_only_when_asked() -> None:
    spec = kvfsm.load(ROOT / "specs" / "kv_request.yaml")
    assert "ignores" not in to_mermaid(spec)
    assert "ignores abort, complete, fail, expire" in to_mermaid(spec, ignores=True)


def test_events_between_the_same_two_states_share_one_edge_self_loops_too() -> None:
    spec = read_text(PARALLEL, "parallel.yaml")
    dot = to_dot(spec)
    done = _edges(dot, "waiting", "done")
    assert len(done) == 1 and "ok, fine<br/>frees blocks<br/>" in done[0]
    loops = _edges(dot, "waiting", "waiting")
    assert len(loops) == 1 and "poll, nudge / ping()" in loops[0]
    mermaid = to_mermaid(spec)
    assert mermaid.count("waiting --> waiting") == 1 and "poll, nudge / ping()" in mermaid


def test_a_coverage_overlay_names_the_untaken_events_of_a_shared_edge() -> None:
    dot = to_dot(read_text(PARALLEL, "parallel.yaml"), coverage={("waiting", "ok"): 2})
    assert "taken 2× (never fine, peer_done)" in _edges(dot, "waiting", "done")[0]


def test_a_deadline_keeps_its_own_edge_beside_an_event_to_the_same_state() -> None:
    failed = _edges(to_dot(read_text(PARALLEL, "parallel.yaml")), "waiting", "failed")
    assert len(failed) == 2
    deadline = next(e for e in failed if "style=dashed" in e)
    assert "expire after wait_timeout = 5 s" in deadline and "broken" not in deadline


def test_events_from_a_peer_are_drawn_as_messages() -> None:
    spec = read_text(PARALLEL, "parallel.yaml")
    done = _edges(to_dot(spec), "waiting", "done")[0]  # shared with local events: only its lines are blue
    assert '<font color="#1864ab">✉ peer_done (remote)</font>' in done and done.endswith(">];")
    assert "waiting --> done : ok, fine<br/>frees blocks<br/>✉ peer_done (remote)<br/>" in to_mermaid(spec)
    notified = _edges(to_dot(read(ROOT / "specs" / "nixl_prefill.yaml")), "held", "read")[0]  # only from peers
    assert "✉ read (remote) ×readers senders" in notified and notified.endswith('color="#1864ab"];')


def test_messages_a_machine_sends_are_drawn_as_messages() -> None:
    decode = read(ROOT / "specs" / "nixl_decode.yaml")  # outgoing: sent from actions, on no one edge
    assert "sends its peers:" in to_dot(decode) and "✉ read → nixl_prefill ⟨remote_request_id⟩" in to_dot(decode)
    prefill = read(ROOT / "specs" / "pd_abort" / "prefill_corrected.yaml")  # send: on transitions
    assert "sends ✉ success → decode" in to_dot(prefill) and "sends ✉ success → decode" in to_mermaid(prefill)


def test_a_system_draws_each_role_as_a_cluster_and_messages_between_them() -> None:
    system, _errors = read_system(ROOT / "specs" / "pd_abort" / "corrected.yaml")
    dot = system_to_dot(system)
    assert 'subgraph "cluster_prefill"' in dot and 'subgraph "cluster_decode"' in dot
    assert '"prefill/bootstrapping"' in dot and '"decode/bootstrapping"' in dot
    # metadata: sent in decode's bootstrapping, taken in prefill's bootstrapping (one state each end)
    assert _edges(dot, "decode/bootstrapping", "prefill/bootstrapping")[0].count("✉ metadata") == 1
    # failure: sent from two prefill states, taken in two decode states: role to role
    failure = next(line for line in dot.splitlines() if "label=<✉ failure>" in line)
    assert 'ltail="cluster_prefill"' in failure and 'lhead="cluster_decode"' in failure
    assert "a finished prefill answers ✉ abort_ack" in dot
    mermaid = system_to_mermaid(system)
    assert 'state "prefill꞉ pd_prefill_corrected" as prefill {' in mermaid
    assert mermaid.count("decode --> prefill") == 1 and "decode --> prefill : ✉ metadata<br/>✉ abort_req" in mermaid


def test_a_family_system_draws_the_ownership_between_its_roles() -> None:
    """A role whose spec owns the machine another role runs: one dashed edge from its cluster to theirs."""
    system, _errors = read_system(ROOT / "specs" / "explore" / "mooncake_store_jobs.yaml")
    owned = [line for line in system_to_dot(system).splitlines() if "owns jobs (by request_id)" in line]
    assert len(owned) == 1
    assert 'ltail="cluster_request"' in owned[0] and 'lhead="cluster_job"' in owned[0]
    assert "hears jobs_ended<br/>passes on abort, preempt" in owned[0] and "arrowtail=diamond" in owned[0]
    mermaid = system_to_mermaid(system)
    assert "request --> job : owns jobs (by request_id)<br/>hears jobs_ended<br/>passes on abort, preempt" in mermaid
    plain, _errors = read_system(ROOT / "specs" / "pd_abort" / "corrected.yaml")
    assert "owns " not in system_to_dot(plain)


@pytest.mark.parametrize("system_path", SYSTEMS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_bundled_system_renders(system_path: Path) -> None:
    system, _errors = read_system(system_path)  # a seed's pre-fix roles are drawn as written
    assert render(system, "svg").lstrip().startswith(b"<?xml")
    assert render(system, "mermaid").count(b"stateDiagram-v2") == 1


def test_top_to_bottom_by_default_and_left_to_right_when_asked() -> None:
    spec = kvfsm.load(ROOT / "specs" / "kv_request.yaml")
    assert "rankdir=TB" in to_dot(spec) and "direction TB" in to_mermaid(spec)
    assert "rankdir=LR" in to_dot(spec, rankdir="LR") and "direction LR" in to_mermaid(spec, rankdir="LR")

    def width(svg: bytes) -> float:
        return float(svg.split(b'width="', 1)[1].split(b"pt", 1)[0])

    assert width(render(spec, "svg")) < width(render(spec, "svg", rankdir="LR"))


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["diagram", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    "name, magic",
    [("x.png", b"\x89PNG"), ("x.pdf", b"%PDF"), ("x.svg", b"<?xml"), ("x.dot", b"digraph"), ("x.mmd", b"---")],
)
def test_the_output_file_name_chooses_the_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, magic: bytes
) -> None:
    code, _text = _cli(capsys, str(ROOT / "specs" / "kv_request.yaml"), "-o", str(tmp_path / name))
    assert code == 0 and (tmp_path / name).read_bytes().startswith(magic)


def test_f_names_any_graphviz_format_and_wins_over_the_extension(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "png" in graphviz_formats() and "x11" not in graphviz_formats()
    out = tmp_path / "picture.img"
    code, _text = _cli(capsys, str(ROOT / "specs" / "pd_abort" / "corrected.yaml"), "-f", "png", "-o", str(out))
    assert code == 0 and out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("args", [("-f", "bogus"), ("-o", "x.txt")], ids=["-f", "extension"])
def test_an_unknown_format_is_a_usage_error_naming_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, str]
) -> None:
    flag, value = args
    target = value if flag == "-f" else str(tmp_path / value)
    code, text = _cli(capsys, str(ROOT / "specs" / "kv_request.yaml"), flag, target)
    assert code == 2 and "unknown diagram format" in text and "png" in text and "mermaid" in text
    assert ("from the extension of -o" in text) == (flag == "-o")
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_docs_diagrams_are_fresh(spec_path: Path, fmt: str) -> None:
    """docs/diagrams/ has every bundled machine, by machine name, as it is now: regenerate with `./dev.sh diagrams`.

    Read, not loaded: a seed's pre-fix shape is drawn although ``kvfsm check`` rejects it.
    """
    spec = read(spec_path)
    committed = DIAGRAMS / f"{spec.name}.{FORMATS[fmt]}"
    assert committed.exists(), f"{committed} is missing; run ./dev.sh diagrams"
    assert committed.read_bytes() == render(spec, fmt), f"{committed} is stale; run ./dev.sh diagrams"


@pytest.mark.parametrize("name", sorted(PNGS))
def test_docs_pngs_are_fresh(name: str) -> None:
    """Graphviz writes the same PNG for the same DOT (no timestamp in it), so the committed ones are compared."""
    path = ROOT / "specs" / PNGS[name]
    drawing = read_system(path)[0] if is_system_file(path) else read(path)
    committed = DIAGRAMS / f"{name}.png"
    assert committed.exists(), f"{committed} is missing; run ./dev.sh diagrams"
    assert committed.read_bytes() == render(drawing, "png"), f"{committed} is stale; run ./dev.sh diagrams"


def test_rendering_is_deterministic() -> None:
    spec = kvfsm.load(ROOT / "specs" / "kv_request.yaml")
    assert render(spec, "svg") == render(spec, "svg")
