"""``kvfsm top``: pure JSON with ``--format json``, and it keeps watching across a restart of the process."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from drivers import recording_driver

import kvfsm
from kvfsm import Tracker
from kvfsm.cli import main, top
from kvfsm.observe import DebugServer, serve
from kvfsm.spec.bundled import SPECS

SPEC = kvfsm.load(SPECS / "kv_request.yaml")


def port_of(server: DebugServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def test_top_once_in_json_prints_only_the_state_document(capsys: pytest.CaptureFixture[str]) -> None:
    tracker = Tracker(SPEC, recording_driver(SPEC))
    tracker.begin("r")
    with DebugServer([tracker]) as server:
        assert main(["top", server.url, "--once", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["trackers"]["kv_request"]["states"]["pinned"]["count"] == 1


def test_top_keeps_reading_across_a_restart_of_the_process_and_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Between reads (top's pause) the process goes away, then a new one serves on the same port."""
    before = Tracker(SPEC, recording_driver(SPEC))
    before.begin("old")
    first = serve([before])
    port = port_of(first)
    after = Tracker(SPEC, recording_driver(SPEC))
    after.begin_many(["new-1", "new-2"])
    servers = [first]
    steps: Iterator[Callable[[], object]] = iter(
        [
            lambda: servers[0].close(),  # the process dies: the next read fails
            lambda: None,  # still down: top says nothing more
            lambda: servers.append(serve([after], port=port)),  # restarted on the same port
        ]
    )
    monkeypatch.setattr(top, "pause", lambda _seconds: next(steps)())
    try:
        assert main(["top", first.url, "--format", "json", "--count", "4", "--interval", "0.5"]) == 0
    finally:
        for server in servers:
            server.close()
    captured = capsys.readouterr()
    docs = [json.loads(line) for line in captured.out.splitlines()]
    assert [doc["trackers"]["kv_request"]["live"] for doc in docs] == [1, 2]
    assert captured.err.count("lost") == 1 and captured.err.count("reconnected") == 1, captured.err


def test_top_shows_a_state_s_stuck_threshold_and_marks_the_stuck(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfsm.testing import VirtualClock

    clock = VirtualClock()
    tracker = Tracker(SPEC, recording_driver(SPEC), clock=clock)
    for key in ("slow", "stuck"):
        tracker.begin(key)
        tracker.fire(key, "enqueue")
    tracker.fire("stuck", "start")
    clock.advance(25.0)
    tracker.fire("slow", "start")
    clock.advance(1.0)
    with DebugServer([tracker]) as server:
        assert main(["top", server.url, "--once", "--format", "json"]) == 0
        doc = json.loads(capsys.readouterr().out)["trackers"]["kv_request"]["states"]["transferring"]
        assert (doc["timeout"], doc["stuck_after"]) == (30.0, 24.0)
        assert [(row["key"], row["stuck"]) for row in doc["oldest"]] == [("stuck", True), ("slow", False)]
        assert main(["top", server.url, "--once"]) == 0
    text = capsys.readouterr().out
    assert "(stuck)" in text and "24/30" in text
