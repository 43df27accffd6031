"""Crash and restart: a role's process may die at any moment; the properties must still hold.

SPIN's agreement on the bundled crash compositions is in test_promela.py."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_explore_system import write_pingpong

from kvfsm.explore import Trace, check_trace, explore, format_trace
from kvfsm.explore.local import LocalSystem
from kvfsm.spec import SpecError
from kvfsm.spec.system import check_system, load_system

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "specs" / "explore"


def decode_crashes(folder: Path) -> Path:
    """The PD crash composition with the crash moved from prefill to decode."""
    text = (BUNDLED / "pd_prefill_crash.yaml").read_text().replace("spec: ../", f"spec: {BUNDLED}/../")
    text = text.replace("    crash: true\n", "").replace("decode: {spec: ", "decode: {crash: true, spec: ")
    path = folder / "pd_decode_crash.yaml"
    path.write_text(text)
    return path


def test_the_corrected_pd_protocol_survives_prefill_crashes_with_four_requests() -> None:
    started = time.process_time()  # CPU seconds: a busy machine does not inflate them as it does the wall clock
    result = explore(BUNDLED / "pd_prefill_crash.yaml")
    assert result.requests == 4 and result.complete
    assert result.verdict == "verified", [p.name for p in result.violated]
    assert time.process_time() - started < 60
    assert ("prefill", "crashed") in LocalSystem(load_system(BUNDLED / "pd_prefill_crash.yaml")).reached()


def test_a_prefill_that_stays_down_leaves_decode_resending_forever() -> None:
    system = load_system(BUNDLED / "pd_prefill_crash_no_restart.yaml")
    result = explore(system, requests=1)
    assert {p.name for p in result.violated} == {"final", "released"}
    trace = next(p.trace for p in result.violated if p.name == "released")
    assert trace is not None
    assert ("prefill", "crash", "crashed") in [(s.role, s.cause, s.target) for s in trace.moves]
    assert [(s.role, s.event, s.action) for s in trace.cycle] == [
        ("decode", "resend", "fire"),
        ("prefill", "abort_req", "ignore"),
    ]
    assert "the process died" in format_trace(trace)
    check_trace(Trace.from_dict(json.loads(json.dumps(trace.as_dict()))), system)


def test_a_decode_crash_lets_prefill_write_into_pages_the_restarted_decode_reuses(tmp_path: Path) -> None:
    result = explore(decode_crashes(tmp_path), requests=1)
    (broken,) = result.violated
    assert broken.name == "write_after_free" and broken.trace is not None
    assert [(s.role, s.event) for s in broken.trace.moves][1] == ("decode", "crash")


def test_crash_is_read_as_a_flag_or_with_restart(tmp_path: Path) -> None:
    path = write_pingpong(
        tmp_path,
        edits={
            "client: {spec: client.yaml}": "client: {spec: client.yaml, crash: true}",
            "server: {spec: server.yaml}": "server: {spec: server.yaml, crash: {restart: false}}",
        },
    )
    roles = load_system(path).roles
    assert (roles["client"].crash, roles["client"].restart) == (True, True)
    assert (roles["server"].crash, roles["server"].restart) == (True, False)


def test_a_malformed_crash_is_a_schema_error(tmp_path: Path) -> None:
    path = write_pingpong(tmp_path, edits={"client: {spec: client.yaml}": "client: {spec: client.yaml, crash: often}"})
    with pytest.raises(SpecError, match="crash"):
        load_system(path)


def test_a_role_with_its_own_crashed_state_cannot_crash(tmp_path: Path) -> None:
    path = write_pingpong(
        tmp_path,
        edits={
            "client: {spec: client.yaml}": "client: {spec: client.yaml, crash: true}",
            "  failed:  {final: failure}\n": "  failed:  {final: failure}\n  crashed: {final: failure}\n",
            '  - {event: abort, from: "*", to: failed}\n': '  - {event: abort, from: "*", to: failed}\n'
            "  - {event: die, from: waiting, to: crashed}\n",
        },
    )
    found = [f for f in check_system(path) if f.code == "KVF214"]
    assert found and "its own state 'crashed'" in found[0].message
