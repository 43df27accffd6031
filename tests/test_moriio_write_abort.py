"""MoRIIO WRITE mode: an aborted decode request keeps its blocks until the prefill has stopped writing.

The bundled composition (``specs/moriio/write.yaml``) states it as
``write_after_free``: the consumer is never ``aborted`` (its blocks given
back) while the producer is ``writing`` or ``draining``. Two ways of getting
it wrong, each written as a copy of a bundled role spec with one transition
changed, are broken by the explorer: the decode side that frees at once and
tells the prefill afterwards (seed 002's merged fix, seen in two real vLLM
engines on a loaded machine), and the prefill that answers ``release`` before
its posted writes have drained (SGLang PR #38961's shape).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvfsm.explore import explore

SPECS = Path(__file__).parent.parent / "kvfsm" / "specs" / "moriio"


def write_after_free(system: Path):  # type: ignore[no-untyped-def]
    (prop,) = [p for p in explore(system).properties if p.name == "write_after_free"]
    return prop


def test_the_bundled_write_mode_keeps_an_aborted_requests_blocks_while_a_write_may_land() -> None:
    prop = write_after_free(SPECS / "write.yaml")
    assert prop.status == "holds", prop.trace and prop.trace.violation


def _with(tmp_path: Path, role_file: str, old: str, new: str) -> Path:
    for name in ("write.yaml", "write_consumer.yaml", "write_producer.yaml"):
        shutil.copy(SPECS / name, tmp_path / name)
    text = (tmp_path / role_file).read_text()
    assert text.count(old) == 1, f"{role_file} no longer has {old!r}"
    (tmp_path / role_file).write_text(text.replace(old, new))
    return tmp_path / "write.yaml"


@pytest.mark.parametrize(
    ("role_file", "old", "new", "moves"),
    [
        pytest.param(
            "write_consumer.yaml",
            "    from: waiting\n    to: aborting\n",
            "    from: waiting\n    to: aborted\n",
            3,
            id="consumer-frees-then-tells",
        ),
        pytest.param(
            "write_producer.yaml",
            "{event: release, from: writing, to: draining, do: withdraw_writes, payload: [reply_to]}",
            "{event: release, from: writing, to: draining, do: withdraw_writes, payload: [reply_to],"
            " send: {to: consumer, message: released}}",
            5,
            id="producer-answers-before-the-drain",
        ),
    ],
)
def test_a_composition_that_frees_before_the_writes_stop_is_broken(
    tmp_path: Path, role_file: str, old: str, new: str, moves: int
) -> None:
    prop = write_after_free(_with(tmp_path, role_file, old, new))
    assert prop.status == "violated"
    assert prop.trace is not None
    assert len([s for s in prop.trace.steps if s.cause != "begin"]) == moves, prop.trace.steps
