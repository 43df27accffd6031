"""Diagrams: what they show, that they are deterministic, and that docs/diagrams/ is fresh."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvfsm
from kvfsm.gen.diagram import render, to_dot, to_mermaid
from kvfsm.spec import is_system_file, read

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted(p for p in (ROOT / "specs").rglob("*.yaml") if not is_system_file(p))
"""Every bundled machine spec; a composition is drawn through its roles."""
DIAGRAMS = ROOT / "docs" / "diagrams"
FORMATS = {"svg": "svg", "mermaid": "mmd"}


def test_dot_shows_holds_timeouts_releases_and_grouped_wildcards() -> None:
    dot = to_dot(kvfsm.load(ROOT / "specs" / "kv_request.yaml"))
    assert "holds: gpu_blocks, queue_slot" in dot
    assert "after transfer_timeout" in dot and "style=dashed" in dot
    assert "complete\\nfrees gpu_blocks, queue_slot" in dot
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


def test_rendering_is_deterministic() -> None:
    spec = kvfsm.load(ROOT / "specs" / "kv_request.yaml")
    assert render(spec, "svg") == render(spec, "svg")
