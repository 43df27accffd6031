"""The Promela export, and SPIN agreeing with the explorer on every verdict and on the plain state count.

SPIN runs compile pan with -O0 (a tenth of the -O2 compile time; these
models are small) and stay at one or two requests.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_explore_system import write_pingpong

from kvfsm.explore import explore
from kvfsm.gen.promela import to_promela
from kvfsm.gen.spin import check_liveness_with_spin, check_with_spin
from kvfsm.spec.system import System, is_system_file, load_system

ROOT = Path(__file__).resolve().parent.parent
PD = ROOT / "specs" / "pd_abort"
BUNDLED = sorted(
    p
    for p in (ROOT / "specs" / "explore").glob("*.yaml")
    if is_system_file(p) and not any(r.spec.owns for r in load_system(p).roles.values())
)  # a family (owns:) is not exported: tests/test_explore_owns.py checks the export refuses it

needs_spin = pytest.mark.skipif(
    shutil.which("spin") is None or shutil.which("gcc") is None, reason="needs Debian spin and gcc"
)


def agree(system: System, requests: int, work: Path) -> set[str]:
    """Explore the plain product and run SPIN on the export; both must store the same states and find the same."""
    ours = explore(system, requests=requests, symmetry=False, merge=False)
    spin = check_with_spin(to_promela(system, requests=requests), work, optimise="-O0", hash_bits=20, depth=200_000)
    assert spin.complete, spin.output
    assert spin.states == ours.states
    found = {p.name for p in ours.violated if p.kind != "eventually"}
    assert set(spin.violated) == found
    return found


def test_export_is_deterministic_and_numbers_every_property() -> None:
    system = load_system(PD / "merged_fix.yaml")
    text = to_promela(system, requests=2)
    assert text == to_promela(load_system(PD / "merged_fix.yaml"), requests=2)
    for k, name in enumerate(system.names, start=1):
        assert f" *   {k} {name}: " in text
    assert "#define N 2" in text and "#define CAP 2" in text


def test_export_refuses_zero_requests() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        to_promela(load_system(PD / "corrected.yaml"), requests=0)


@needs_spin
@pytest.mark.spin
@pytest.mark.parametrize("requests", [1, 2])
@pytest.mark.parametrize(("name", "expected"), [("merged_fix", {"write_after_free"}), ("corrected", set())])
def test_spin_agrees_on_the_pd_systems(tmp_path: Path, name: str, expected: set[str], requests: int) -> None:
    assert agree(load_system(PD / f"{name}.yaml"), requests, tmp_path) == expected


@needs_spin
@pytest.mark.spin
def test_spin_agrees_on_a_reliable_fifo_channel(tmp_path: Path) -> None:
    text = (PD / "merged_fix.yaml").read_text()
    text = text.replace("{spec: ", f"{{spec: {PD}/").replace(
        "channel: {loss: true, duplicate: true, reorder: true, capacity: 2}",
        "channel: {loss: false, duplicate: false, reorder: false, capacity: 3}",
    )
    path = tmp_path / "fifo.yaml"
    path.write_text(text)
    assert agree(load_system(path), 2, tmp_path / "spin") == {"overflow", "write_after_free"}


@needs_spin
@pytest.mark.spin
@pytest.mark.parametrize(
    ("edits", "expected"),
    [
        pytest.param(
            {
                "  - {event: pong, in: [idle, done, failed]}\n": "  - {event: pong, in: [idle]}\n",
                "  - {event: ping, in: [replying, served, gone]}\n": "  - {event: ping, in: [served, gone]}\n",
                "params: {idle_timeout: 30.0}\n": "params: {idle_timeout: 30.0}\nresources:\n  worker: {release: free_worker}\n",
                "replying:  {waits: local}": "replying:  {waits: local, holds: [worker]}",
            },
            {"late_message", "unexpected_message", "served_but_failed"},
            id="late-unexpected-never",
        ),
        pytest.param(
            {
                "  - {event: answer, from: replying, to: served, send: {to: client, message: pong}}\n": "",
                "loss: true, duplicate: true, reorder: true, capacity: 2": "loss: false, duplicate: true, reorder: false, capacity: 1",
            },
            {"deadlock", "overflow"},
            id="deadlock-overflow-fifo",
        ),
        pytest.param(
            {
                "  - {event: answer, from: replying, to: served, send: {to: client, message: pong}}\n": "",
                "params: {idle_timeout: 30.0}\n": "params: {idle_timeout: 30.0}\nresources:\n  worker: {release: free_worker}\n",
                "replying:  {waits: local}": "replying:  {waits: local, holds: [worker]}",
            },
            {"leak"},
            id="leak",
        ),
    ],
)
def test_spin_agrees_on_every_builtin(tmp_path: Path, edits: dict[str, str], expected: set[str]) -> None:
    system = load_system(write_pingpong(tmp_path, edits=edits))
    assert agree(system, 2, tmp_path / "spin") == expected


@needs_spin
@pytest.mark.spin
def test_plain_spin_run_stops_at_the_named_assertion(tmp_path: Path) -> None:
    system = load_system(PD / "merged_fix.yaml")
    text = to_promela(system, requests=1)
    quick = {"optimise": "-O0", "hash_bits": 16, "depth": 10_000}
    stopped = check_with_spin(text, tmp_path / "all", report=False, **quick)
    assert stopped.errors == 1 and stopped.violated == ("write_after_free",)
    assert "assertion violated (holds_write_after_free" in stopped.output
    deadlock_only = check_with_spin(
        text, tmp_path / "one", report=False, only=system.names.index("deadlock") + 1, **quick
    )
    assert deadlock_only.errors == 0 and deadlock_only.complete


def agree_on_liveness(system: System, work: Path, requests: int = 1) -> dict[str, str]:
    """SPIN's verdict on each ``eventually`` property must be the explorer's (which checks one request); both returned."""
    ours = {p.name: p.status for p in explore(system, requests=1).properties if p.kind == "eventually"}
    runs = check_liveness_with_spin(
        to_promela(system, requests=requests), work, list(ours), optimise="-O0", hash_bits=20, depth=500_000
    )
    theirs = {name: "violated" if name in run.violated else "holds" for name, run in runs.items()}
    assert all("errors:" in run.output for run in runs.values())
    assert theirs == ours
    return ours


@needs_spin
@pytest.mark.spin
@pytest.mark.parametrize("path", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_spin_agrees_on_every_bundled_composition(tmp_path: Path, path: Path) -> None:
    """Time, ranks, counting, crashes and liveness: the same states, the same safety and liveness verdicts."""
    system = load_system(path)
    found = agree(system, 1, tmp_path / "safety")
    live = agree_on_liveness(system, tmp_path / "live")
    assert found | {name for name, status in live.items() if status == "violated"} == EXPECTED[path.stem]


EXPECTED = {
    "moriio_write": set(),
    "moriio_write_no_defer_deadline": {"final", "released"},
    "nixl_fanin": set(),
    "nixl_mla": set(),
    "nixl_mla_reversed": {"read_after_free"},
    "pd_prefill_crash": set(),
    "pd_prefill_crash_no_restart": {"final", "released"},
}
"""The verdict each bundled composition is there to show (docs/explore.md)."""


@needs_spin
@pytest.mark.spin
@pytest.mark.slow
@pytest.mark.parametrize("path", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_spin_on_two_requests_agrees_with_the_liveness_of_one(tmp_path: Path, path: Path) -> None:
    """Liveness is checked per request; SPIN, fair over every request of two, reaches the same verdicts."""
    agree_on_liveness(load_system(path), tmp_path, requests=2)
