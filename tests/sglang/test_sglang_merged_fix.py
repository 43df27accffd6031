"""SGLang as PR #27372 merged it (deferred release off): the explorer's race corrupts the next room's pages.

The servers run SGLang's own manager, sender, receiver and bootstrap server
with ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0`` and the
``merged_fix`` role specs; decode frees a room's pages at its abort.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import start_pair
from sglang_checks import closed_clean

from kvfsm.explore import explore
from kvfsm.spec.bundled import SPECS

PROTOCOL = "merged_fix"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from start_pair(PROTOCOL, tmp_path_factory.mktemp("journals"), base_port=18998)


def test_a_transfer_lands_the_prefill_bytes_in_decodes_pages(pair: Any) -> None:
    assert pair.transfer(1) == ("done", "received")
    assert pair.decode.call("finish", 1) == []  # every page of room 1 holds room 1's bytes


def test_an_abort_before_the_indices_ends_both_sides(pair: Any) -> None:
    pair.begin(2)
    assert pair.decode.call("abort", 2) == "aborted"
    assert pair.wait_prefill(2) == "failed"  # SGLang's bootstrap thread took the ABORT


def test_an_abort_before_the_forward_pass_ends_both_sides_unwritten(pair: Any) -> None:
    pair.begin(3)
    assert pair.bootstrapped(3) == "waiting"
    assert pair.wait_prefill(3, "waiting_input") == "waiting_input"
    assert pair.decode.call("abort", 3) == "aborted"
    assert pair.wait_prefill(3) == "failed"
    assert pair.prefills[0].call("forward", 3) == "failed"  # the scheduler finds the room failed: nothing sent


def test_the_explorer_trace_is_the_one_driven_here() -> None:
    result = explore(SPECS / "pd_abort" / f"{PROTOCOL}.yaml", first=True)
    (violated,) = [p for p in result.properties if p.trace is not None]
    moves = [(s.role, s.event) for s in violated.trace.steps if s.action == "fire"]
    assert moves == [
        ("decode", "bootstrapped"),
        ("decode", "abort"),
        ("prefill", "metadata"),
        ("prefill", "forward_done"),
    ]


@pytest.mark.parametrize("hold", ["abort", "chunk"])
def test_the_late_write_corrupts_every_page_of_the_next_room(pair: Any, hold: str) -> None:
    from kvfsm.adapters.sglang_pair import race

    a, b = (10, 11) if hold == "abort" else (12, 13)
    assert race(pair, a, b, hold=hold) == [0, 1, 2, 3]


def test_a_soak_corrupts_pages_only_where_an_abort_met_a_write(pair: Any) -> None:
    from kvfsm.adapters.sglang_pair import soak

    result = soak(pair, 200, seed=2, first_room=1000)
    corrupted, drawn = result["corrupted"], result["drawn"]
    assert corrupted["none"] == corrupted["abort_bootstrapping"] == corrupted["abort_waiting"] == 0
    assert corrupted["race_abort"] == 4 * drawn["race_abort"] > 0
    assert corrupted["race_chunk"] == 4 * drawn["race_chunk"] > 0


def test_closed_servers_hold_nothing_and_their_journals_replay_clean(pair: Any) -> None:
    closed_clean(pair, PROTOCOL)
