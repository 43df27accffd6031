"""SGLang with its deferred drain ACK on and decode keeping a room's pages until it: no page is ever corrupted.

The servers run SGLang's own classes with
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1`` and the ``corrected``
role specs: decode's tracker frees an aborted room's pages only on the ACK
that SGLang's prefill sends once the room's transfer has drained (or on a
final status), and resends ABORT where no answer came, instead of giving up.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import start_pair
from sglang_checks import closed_clean

PROTOCOL = "corrected"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from start_pair(PROTOCOL, tmp_path_factory.mktemp("journals"), base_port=19010)


def test_a_transfer_lands_the_prefill_bytes_in_decodes_pages(pair: Any) -> None:
    assert pair.transfer(1) == ("done", "received")
    assert pair.decode.call("finish", 1) == []


def test_an_abort_before_the_indices_ends_both_sides(pair: Any) -> None:
    pair.begin(2)
    assert pair.decode.call("abort", 2) == "aborted"
    assert pair.wait_prefill(2) == "failed"


def test_an_abort_before_the_forward_pass_keeps_the_pages_until_the_ack(pair: Any) -> None:
    pair.begin(3)
    pair.bootstrapped(3)
    pair.wait_prefill(3, "waiting_input")
    assert pair.decode.call("abort", 3) in ("aborting", "aborted")
    assert pair.wait_prefill(3) == "failed"
    assert pair.wait_decode(3) == "aborted"  # SGLang's prefill ACKed: nothing was in flight


@pytest.mark.parametrize("hold", ["abort", "chunk"])
def test_the_merged_fix_trace_corrupts_nothing(pair: Any, hold: str) -> None:
    from kvfsm.adapters.sglang_pair import race

    a, b = (10, 11) if hold == "abort" else (12, 13)
    assert race(pair, a, b, hold=hold) == []


def test_a_mid_transfer_abort_keeps_the_pages_while_the_chunk_is_in_flight(pair: Any) -> None:
    p0 = pair.prefills[0]
    p0.call("gate", "chunk", True)
    try:
        pair.begin(20)
        pair.bootstrapped(20)
        pair.wait_prefill(20, "waiting_input")
        p0.call("forward", 20)
        assert p0.call("reached", "chunk", 20, 60.0)
        assert pair.decode.call("abort", 20) == "aborting"
        assert pair.wait_prefill(20, "draining") == "draining"  # SGLang holds the ACK: the chunk has not landed
        assert pair.decode.call("state", 20) == "aborting"
        pair.begin(21, 1)
        assert pair.bootstrapped(21) is None  # the pool's pages are still room 20's
    finally:
        p0.call("gate", "chunk", False)
    assert pair.wait_prefill(20) == "failed"
    assert pair.wait_decode(20) == "aborted"
    assert pair.bootstrapped(21) == "waiting"
    pair.wait_prefill(21, "waiting_input", prefill=1)
    pair.prefills[1].call("forward", 21)
    assert pair.wait_decode(21) == "received"
    assert pair.decode.call("finish", 21) == []


def test_a_soak_of_a_thousand_rooms_with_random_aborts_corrupts_nothing(pair: Any) -> None:
    from kvfsm.adapters.sglang_pair import FAULTS, soak

    result = soak(pair, 1000, seed=3, first_room=1000)
    assert result["corrupted"] == dict.fromkeys(FAULTS, 0)
    assert all(result["drawn"][f] > 50 for f in FAULTS)


def test_closed_servers_hold_nothing_and_their_journals_replay_clean(pair: Any) -> None:
    closed_clean(pair, PROTOCOL)
