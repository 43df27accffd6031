"""The journal's versioned header: the tracker's params (so replay checks by them), hashed ids, a sample of keys."""

from __future__ import annotations

import io
import json
from collections.abc import Hashable
from pathlib import Path

import pytest
from drivers import recording_driver

import kvfsm
from kvfsm import Tracker
from kvfsm.cli import main
from kvfsm.replay import JsonlJournal, check_log, codes
from kvfsm.replay.read import first_header
from kvfsm.replay.record import IDS_HASHED, VERSION
from kvfsm.spec.bundled import SPECS
from kvfsm.testing import VirtualClock

CANONICAL = SPECS / "kv_request.yaml"
SPEC = kvfsm.load(CANONICAL)


def slow_transfer(path: Path, *, attach: bool, transfer_timeout: float = 50.0, seconds: float = 40.0) -> None:
    """One transfer that takes ``seconds`` on a tracker whose transfer_timeout is raised to ``transfer_timeout``."""
    clock = VirtualClock(1000.0)
    with JsonlJournal(path, append=False) as journal:
        tracker = Tracker(
            SPEC, recording_driver(SPEC), clock=clock, params={"transfer_timeout": transfer_timeout}, observer=journal
        )
        if attach:
            journal.attach(tracker)
        tracker.begin("r")
        tracker.fire("r", "enqueue")
        tracker.fire("r", "start")
        clock.advance(seconds)
        tracker.fire("r", "complete")
        tracker.close()


def replay(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["replay", str(CANONICAL), *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def lifecycles(journal: JsonlJournal, keys: list[Hashable]) -> None:
    """Each key through a whole lifecycle (begin, enqueue, start, complete) on a tracker the journal observes."""
    tracker = Tracker(SPEC, recording_driver(SPEC), observer=journal, on_anomaly=journal.anomaly)
    journal.attach(tracker)
    for key in keys:
        tracker.begin(key)
        tracker.fire(key, "enqueue")
        tracker.fire(key, "start")
        tracker.fire(key, "complete")
    tracker.fire("ghost-request", "complete")  # an unknown id: an anomaly line
    tracker.close()
    journal.close()


def written(stream: io.BytesIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_replay_checks_deadlines_by_the_params_the_header_records_so_no_param_flag_is_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "raised.jsonl"
    slow_transfer(log, attach=True)
    header = json.loads(log.read_text().splitlines()[0])
    assert header["journal"] == VERSION and header["params"] == {"transfer_timeout": 50.0}
    code, out, _err = replay(capsys, str(log))
    assert code == 0, out  # 40 s under the 50 s the tracker ran with: no KVF310
    code, out, _err = replay(capsys, str(log), "--param", "transfer_timeout=30")
    assert code == 1 and codes.OVERRUN in out  # --param still wins over the header


def test_a_journal_not_attached_records_no_params_and_replay_falls_back_to_the_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "unattached.jsonl"
    slow_transfer(log, attach=False)
    assert "params" not in json.loads(log.read_text().splitlines()[0])
    code, out, _err = replay(capsys, str(log))
    assert code == 1 and codes.OVERRUN in out


def test_a_version_1_journal_is_still_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "v1.jsonl"
    log.write_text(
        '{"journal":1,"machine":"kv_request","pid":4711,"opened":1718000000.25}\n'
        '{"key":"r","generation":1,"event":"begin","from":"","to":"pinned","time":100.0}\n'
        '{"key":"r","generation":1,"event":"abort","from":"pinned","to":"aborted","time":100.5}\n'
    )
    header, _lines = first_header([log.read_bytes().splitlines(keepends=True)[0]])
    assert header is not None and header.journal == 1 and header.params is None
    code, out, _err = replay(capsys, str(log), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["conforms"] and doc["journal"] == 1 and doc["params"] == {}


def test_a_later_session_run_with_other_params_is_named_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    slow_transfer(first, attach=True, transfer_timeout=50.0, seconds=1.0)
    slow_transfer(second, attach=True, transfer_timeout=60.0, seconds=1.0)
    both = tmp_path / "both.jsonl"
    both.write_bytes(first.read_bytes() + second.read_bytes())
    code, _out, err = replay(capsys, str(both))
    assert code == 0 and f"{both}:6:" in err and "transfer_timeout=60" in err
    code, _out, err = replay(capsys, str(both), "--strict")  # the warning fails the run
    assert code == 1 and f"{both}:6:" in err


def test_attach_refuses_another_machine_and_a_header_already_written(tmp_path: Path) -> None:
    journal = JsonlJournal(io.BytesIO(), machine="nixl_prefill")
    with pytest.raises(ValueError, match="one journal serves one tracker"):
        journal.attach(Tracker(SPEC, recording_driver(SPEC)))
    late = JsonlJournal(io.BytesIO())
    tracker = Tracker(SPEC, recording_driver(SPEC), observer=late)
    tracker.begin("r")
    with pytest.raises(ValueError, match="before the first transition"):
        late.attach(tracker)


def test_hashed_ids_are_one_value_per_key_within_a_journal_and_name_no_request() -> None:
    keys: list[Hashable] = ["req-secret-1", "req-secret-2", 7, "7"]
    stream = io.BytesIO()
    lifecycles(JsonlJournal(stream, hash_ids=True), keys)
    text = stream.getvalue().decode()
    assert "secret" not in text
    lines = written(stream)
    assert lines[0]["ids"] == IDS_HASHED
    anomaly = next(line for line in lines if "anomaly" in line)
    assert anomaly["anomaly"] == "unknown" and "ghost" not in str(anomaly["id"])
    by_key: dict[object, set[str]] = {}
    for line in lines[1:]:
        if "anomaly" in line:
            continue
        by_key.setdefault(line["key"], set()).add(str(line["event"]))
    assert len(by_key) == 4  # 7 and "7" stay two keys
    assert all(events == {"begin", "enqueue", "start", "complete"} for events in by_key.values())
    report = check_log(SPEC, [raw + b"\n" for raw in stream.getvalue().splitlines()])
    assert report.conforms and report.instances == 4


def test_a_shared_secret_gives_two_journals_the_same_hashes_and_a_drawn_one_does_not() -> None:
    def first_key(hash_ids: bool | bytes) -> object:
        stream = io.BytesIO()
        lifecycles(JsonlJournal(stream, hash_ids=hash_ids), ["req-1"])
        return written(stream)[1]["key"]

    assert first_key(b"shared secret") == first_key(b"shared secret")
    assert first_key(True) != first_key(True)
    with pytest.raises(ValueError, match="secret"):
        JsonlJournal(io.BytesIO(), hash_ids=b"")


def test_a_sample_keeps_whole_lifecycles_of_the_same_keys_in_every_journal() -> None:
    keys: list[Hashable] = [f"req-{i}" for i in range(400)]
    streams = [io.BytesIO(), io.BytesIO()]
    for stream in streams:
        lifecycles(JsonlJournal(stream, sample=0.25), keys)
    kept = [{line["key"] for line in written(stream)[1:] if "key" in line} for stream in streams]
    assert kept[0] == kept[1] and 50 < len(kept[0]) < 150
    events: dict[object, int] = {}
    for line in written(streams[0])[1:]:
        if "key" in line:
            events[line["key"]] = events.get(line["key"], 0) + 1
    assert set(events.values()) == {4}  # every line of a kept key, none of the others
    assert written(streams[0])[0]["sample"] == 0.25
    assert check_log(SPEC, [raw + b"\n" for raw in streams[0].getvalue().splitlines()]).conforms
    with pytest.raises(ValueError, match="share"):
        JsonlJournal(io.BytesIO(), sample=0.0)
