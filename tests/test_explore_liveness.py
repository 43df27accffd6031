"""``eventually`` properties: fair lassos in the explorer, their traces, and SPIN agreeing on every verdict."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_explore_system import write_pingpong

from kvfsm.explore import Trace, TraceError, check_trace, explore, format_trace
from kvfsm.gen.promela import to_promela
from kvfsm.gen.spin import check_liveness_with_spin
from kvfsm.spec import SpecError
from kvfsm.spec.system import System, load_system

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "specs" / "explore"
PD = ROOT / "specs" / "pd_abort"
LIVE = "properties:\n  eventually: [final, released]\n"

needs_spin = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None, reason="needs Debian spin and gcc"
)


def with_liveness(source: Path, folder: Path) -> Path:
    """A copy of a bundled system file with ``eventually: [final, released]``, its roles found where they were."""
    text = source.read_text().replace("{spec: ", f"{{spec: {source.parent}/")
    text = text.replace("properties:\n", LIVE, 1) if "properties:\n" in text else text + LIVE
    path = folder / source.name
    path.write_text(text)
    return path


def pingpong_without_answer(folder: Path) -> Path:
    """The server never answers and nothing times it out: a request that stays put forever."""
    return write_pingpong(
        folder,
        edits={
            "  - {event: answer, from: replying, to: served, send: {to: client, message: pong}}\n": "",
            "properties:\n": LIVE,
        },
    )


def verdicts(system: System) -> dict[str, str]:
    return {p.name: p.status for p in explore(system, requests=1).properties if p.kind == "eventually"}


def test_a_deferred_task_without_deadline_is_a_lasso_that_polls_forever() -> None:
    result = explore(BUNDLED / "moriio_write_no_defer_deadline.yaml", requests=1)
    final = next(p for p in result.properties if p.name == "final")
    assert final.status == "violated" and final.kind == "eventually"
    trace = final.trace
    assert trace is not None and trace.loop is not None
    assert [(s.role, s.event) for s in trace.cycle] == [("producer", "recheck")]
    assert trace.violation == "the request never finishes: producer in deferred forever"
    chart = format_trace(trace)
    assert "from here on, forever" in chart and "back to move" in chart
    released = next(p for p in result.properties if p.name == "released")
    assert released.trace is not None and "producer keeps src_blocks forever" in released.trace.violation


def test_with_the_deadline_every_request_finishes_and_frees() -> None:
    assert verdicts(load_system(BUNDLED / "moriio_write.yaml")) == {"final": "holds", "released": "holds"}


def test_the_corrected_pd_protocol_is_live(tmp_path: Path) -> None:
    system = load_system(with_liveness(PD / "corrected.yaml", tmp_path))
    assert verdicts(system) == {"final": "holds", "released": "holds"}


def test_a_request_nothing_owes_a_move_stays_forever_with_an_empty_cycle(tmp_path: Path) -> None:
    result = explore(pingpong_without_answer(tmp_path), requests=1)
    final = next(p for p in result.properties if p.name == "final")
    assert final.trace is not None
    assert final.trace.loop == len(final.trace.moves) and final.trace.cycle == ()
    assert "nothing more happens, forever" in format_trace(final.trace)


def test_a_lasso_round_trips_through_json_and_checks_against_its_system() -> None:
    system = load_system(BUNDLED / "moriio_write_no_defer_deadline.yaml")
    trace = next(p.trace for p in explore(system, requests=1).violated if p.name == "released")
    assert trace is not None
    doc = json.loads(json.dumps(trace.as_dict()))
    back = Trace.from_dict(doc)
    assert back == trace
    check_trace(back, system)
    bad = dict(doc, loop=0)
    with pytest.raises(TraceError, match="does not end where it began"):
        check_trace(Trace.from_dict(bad), system)
    with pytest.raises(TraceError, match="loop"):
        Trace.from_dict(dict(doc, loop=99))


def test_an_unknown_eventually_property_is_a_schema_error(tmp_path: Path) -> None:
    path = write_pingpong(tmp_path, edits={"properties:\n": "properties:\n  eventually: [finished]\n"})
    with pytest.raises(SpecError, match="unknown eventually property 'finished'"):
        load_system(path)


def spin_verdicts(system: System, work: Path, requests: int = 1) -> dict[str, str]:
    """Each ``eventually`` property's verdict from SPIN on the export (one pan, one acceptance-cycle run each)."""
    claims = [p.name for p in system.eventually]
    runs = check_liveness_with_spin(
        to_promela(system, requests=requests), work, claims, optimise="-O0", hash_bits=18, depth=200_000
    )
    for run in runs.values():
        assert "errors:" in run.output, run.output
    return {name: "violated" if name in run.violated else "holds" for name, run in runs.items()}


@needs_spin
@pytest.mark.spin
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda t: with_liveness(PD / "corrected.yaml", t), id="pd-corrected"),
        pytest.param(pingpong_without_answer, id="pingpong-stays-put"),
    ],
)
def test_spin_agrees_on_every_liveness_verdict(tmp_path: Path, make: object) -> None:
    assert callable(make)
    system = load_system(make(tmp_path))
    ours = verdicts(system)
    assert ours == spin_verdicts(system, tmp_path / "spin")


def test_the_cli_prints_the_lasso_and_writes_it_with_its_loop(tmp_path: Path) -> None:
    out = tmp_path / "lasso.json"
    system = str(BUNDLED / "moriio_write_no_defer_deadline.yaml")
    result = subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "explore", system, "-n", "1", "--trace", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr
    assert "lasso: 1 steps, then 1 steps repeated forever" in result.stdout
    assert "from here on, forever" in result.stdout
    doc = json.loads(out.read_text())
    assert doc["loop"] == 1 and doc["property"] in ("final", "released")
