"""SGLang 0.5.23 as it ships: the drain ACK closes the merged fix's race until decode gives up waiting for it.

``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` is on by default in
0.5.23: decode keeps an aborted room's pages until prefill's drain ACK, and
frees them anyway after a release timeout (``decode_sglang.yaml``; 30 s in
SGLang, 0.2 s here). A write held past it lands in the next room's pages,
as ``kvfsm explore specs/pd_abort/sglang.yaml`` predicts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import start_pair
from sglang_checks import closed_clean

from kvfsm.explore import explore
from kvfsm.spec.bundled import SPECS

PROTOCOL = "sglang"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    journals = tmp_path_factory.mktemp("journals")
    yield from start_pair(PROTOCOL, journals, base_port=19030, decode_params={"release_timeout": 0.2})


def test_the_explorer_finds_the_release_timeouts_write_after_free() -> None:
    result = explore(SPECS / "pd_abort" / f"{PROTOCOL}.yaml", first=True)
    (violated,) = [p for p in result.properties if p.trace is not None]
    assert violated.name == "write_after_free"
    assert [s.event for s in violated.trace.steps if s.action == "fire"][-1] == "give_up"


@pytest.mark.parametrize("hold", ["abort", "chunk"])
def test_a_write_held_past_the_release_timeout_corrupts_the_next_room(pair: Any, hold: str) -> None:
    from kvfsm.adapters.sglang_pair import race

    a, b = (10, 11) if hold == "abort" else (12, 13)
    assert race(pair, a, b, hold=hold, give_up=True) == [0, 1, 2, 3]


def test_within_the_release_timeout_nothing_is_corrupted(pair: Any) -> None:
    assert pair.transfer(20) == ("done", "received")
    assert pair.decode.call("finish", 20) == []


def test_closed_servers_hold_nothing_and_their_journals_replay_clean(pair: Any) -> None:
    closed_clean(pair, PROTOCOL)
