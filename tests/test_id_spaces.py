"""Id spaces and remote events declared in the spec: linked by the engine, routed by the spec, late told from unknown.

The spec below is the prefill side of a NIXL-style read: prefill holds a
request's blocks until decode's notification names it — by prefill's own
request id, the id decode was told in the handshake, never decode's local one
(seed 004).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import pytest

import kvfsm
from kvfsm import Tracker
from kvfsm.replay import JsonlJournal
from kvfsm.testing import VirtualClock

SPEC = """
kvfsm: 1
machine: prefill_hold
key: request_id
params: {expiry: 480.0}
spaces:
  remote_request_id: {linked_at: begin, doc: the id decode names in its notification}
events:
  read_done: {by: remote_request_id, remote: true}
begin: {payload: [remote_request_id]}
resources:
  blocks: {release: free_blocks}
states:
  held:    {initial: true, holds: [blocks], timeout: {after: expiry, fire: expire}}
  done:    {final: success}
  expired: {final: failure}
  aborted: {final: failure}
transitions:
  - {event: read_done, from: held, to: done}
  - {event: expire,    from: held, to: expired}
  - {event: abort,     from: "*",  to: aborted}
ignore:
  - {event: read_done, in: [done, expired, aborted]}
"""


class Blocks:
    def __init__(self) -> None:
        self.held: set[Hashable] = set()

    def free_blocks(self, key: Hashable) -> None:
        self.held.discard(key)


def tracker(**kwargs: object) -> tuple[Tracker, Blocks]:
    blocks = Blocks()
    return Tracker(kvfsm.parse(SPEC, "prefill_hold.yaml"), blocks, clock=VirtualClock(), **kwargs), blocks  # type: ignore[arg-type]


def test_the_id_begin_carries_is_linked_and_a_message_is_routed_by_the_space_the_spec_names() -> None:
    t, blocks = tracker()
    blocks.held.add("p-7")
    t.begin("p-7", remote_request_id="r-42")
    assert t.ids("p-7") == {"remote_request_id": "r-42"}
    assert t.deliver("read_done", "r-42") == "done" and blocks.held == set()


def test_a_message_naming_the_local_id_is_unknown_and_frees_nothing() -> None:
    t, blocks = tracker()
    blocks.held.add("p-7")
    t.begin("p-7", remote_request_id="r-42")
    assert t.deliver("read_done", "p-7") is None  # the seed-004 shape: the wrong space's id
    assert t.state("p-7") == "held" and blocks.held == {"p-7"}
    [anomaly] = t.anomalies()
    assert (anomaly.kind, anomaly.space, anomaly.id) == ("unknown", "remote_request_id", "p-7")


def test_a_late_duplicate_is_late_not_unknown() -> None:
    t, _blocks = tracker()
    t.begin("p-7", remote_request_id="r-42")
    t.deliver("read_done", "r-42")
    t.finished()
    assert t.deliver("read_done", "r-42") is None
    assert (t.counts["late"], t.counts["unknown"]) == (1, 0)


def test_an_id_that_already_names_a_live_instance_fails_the_link_not_the_tracker() -> None:
    t, _blocks = tracker()
    t.begin("p-1", remote_request_id="r-1")
    with pytest.raises(kvfsm.ActionError) as caught:
        t.begin("p-2", remote_request_id="r-1")
    (failure,) = caught.value.failures
    assert failure.phase == "link" and t.state("p-2") == "held" and t.ids("p-1") == {"remote_request_id": "r-1"}


def test_anomalies_go_to_the_hook_and_a_rate_limited_log(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[kvfsm.Anomaly] = []
    t, _blocks = tracker(on_anomaly=seen.append)
    with caplog.at_level(logging.WARNING, logger="kvfsm.anomalies"):
        for i in range(50):
            t.deliver("read_done", f"nobody-{i}")
    assert len(seen) == 50 and {a.kind for a in seen} == {"unknown"}
    assert len(caplog.records) == 10  # the first ten, then every thousandth


def test_the_journal_records_anomalies_as_their_own_lines(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "j.jsonl"
    journal = JsonlJournal(path, machine="prefill_hold")
    t, _blocks = tracker(observer=journal, on_anomaly=journal.anomaly)
    t.begin("p-7", remote_request_id="r-42")
    t.deliver("read_done", "p-7")
    journal.close()
    lines = path.read_text().splitlines()
    assert any('"anomaly":"unknown"' in line and '"space":"remote_request_id"' in line for line in lines)


def test_the_diagram_shows_which_id_a_message_carries() -> None:
    from kvfsm.gen.diagram import to_mermaid

    text = to_mermaid(kvfsm.parse(SPEC, "prefill_hold.yaml"))
    assert "read_done ⟨remote_request_id⟩" in text
