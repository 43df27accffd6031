"""A prefill server killed mid-room: decode's heartbeat finds it dead, the room fails and its pages come back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import start_pair

from kvfsm.replay import check_log
from kvfsm.spec.bundled import SPECS


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    # SGLang's heartbeat at its fastest (every 2 s, one failure): the wait below ends when it fires.
    env = {"SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1"}
    yield from start_pair("corrected", tmp_path_factory.mktemp("journals"), base_port=19020, env=env)


def test_a_killed_prefill_fails_its_rooms_and_frees_their_pages(pair: Any) -> None:
    pair.begin(1, 1)
    assert pair.bootstrapped(1) == "waiting"
    assert pair.wait_prefill(1, "waiting_input", prefill=1) == "waiting_input"
    pair.kill_prefill(1)
    assert pair.wait_decode(1) == "failed"  # _handle_node_failure: Lost connection with prefill instance
    assert pair.transfer(2, 0) == ("done", "received")  # the freed pages serve the next room
    assert pair.decode.call("finish", 2) == []
    summaries = pair.close()
    assert summaries["decode"]["held_pages"] == 0 and summaries["decode"]["refused"] == []
    report = check_log(SPECS / "pd_abort" / "decode_corrected.yaml", pair.journals["decode"])
    assert report.conforms, [f.message for f in report.findings]
