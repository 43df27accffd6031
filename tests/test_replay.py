"""Log replay: a journal the Tracker really wrote is accepted; edited ones are rejected at the right line.

The workload drives the canonical spec with a driver that really holds things:
torch KV blocks pinned out of a pool, transfer-queue slots from a bounded
semaphore (an extra release raises), and transfers that copy the blocks to
host tensors. A virtual clock and a poll loop make timeouts fire on time; keys
are reused, some actions fail, the queue fills up, requests are aborted, and
the tracker is closed at the end.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import random
import re
import subprocess
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvfsm
from kvfsm import ActionError, BindingError, IllegalTransition, Tracker
from kvfsm.replay import JsonlJournal, LogReport, check_log, codes
from kvfsm.spec import Finding
from kvfsm.spec.bundled import SPECS
from kvfsm.testing.clock import VirtualClock

ROOT = Path(__file__).resolve().parents[1]
CANONICAL = SPECS / "kv_request.yaml"
SPEC = kvfsm.load(CANONICAL)
FINALS = set(SPEC.finals)
TIMEOUT = SPEC.params["transfer_timeout"]
START = 1000.0
"""Where the tests' clocks start, so times in messages are easy to tell apart from durations."""


# -- a driver that really holds what kv_request says -------------------------------------


class KvDriver:
    """kv_request's actions on real resources; ``observe(key)`` reads them back.

    Invariant: a block index is in ``free`` ⇔ no key's ``pinned`` list holds it;
    ``queued`` is exactly the keys holding a semaphore slot.
    """

    def __init__(self, *, blocks: int = 96, per_request: int = 2, slots: int = 6) -> None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.kv = torch.randn(blocks, 64, device=device)
        self.blocks = blocks
        self.per_request = per_request
        self.free: deque[int] = deque(range(blocks))
        self.pinned: dict[Hashable, list[int]] = {}
        self.slots = threading.BoundedSemaphore(slots)
        self.capacity = slots
        self.queued: set[Hashable] = set()
        self.copies: dict[Hashable, torch.Tensor] = {}
        self.faults: list[str] = []

    def pin(self, key: Hashable) -> bool:
        """What the engine's delay-free does before ``begin``: keep the request's blocks."""
        if len(self.free) < self.per_request:
            return False
        assert key not in self.pinned, f"{key!r} pinned twice"
        self.pinned[key] = [self.free.popleft() for _ in range(self.per_request)]
        return True

    def _maybe_fail(self, action: str) -> None:
        if action in self.faults:
            self.faults.remove(action)
            raise RuntimeError(f"injected fault in {action}")

    def free_gpu_blocks(self, key: Hashable) -> None:
        self.free.extend(self.pinned.pop(key))

    def enqueue_job(self, key: Hashable) -> None:
        self._maybe_fail("enqueue_job")
        if not self.slots.acquire(blocking=False):
            raise RuntimeError("transfer queue full")
        assert key not in self.queued
        self.queued.add(key)

    def task_done(self, key: Hashable) -> None:
        self.queued.remove(key)
        self.slots.release()

    def start_transfer(self, key: Hashable) -> None:
        self._maybe_fail("start_transfer")
        self.copies[key] = self.kv[self.pinned[key]].to("cpu", copy=True)

    def observe(self, key: Hashable) -> set[str]:
        held = {"gpu_blocks"} if key in self.pinned else set()
        return held | ({"queue_slot"} if key in self.queued else set())

    def idle(self) -> bool:
        """Nothing held: every block free and every slot back."""
        slots = sum(self.slots.acquire(blocking=False) for _ in range(self.capacity))
        for _ in range(slots):
            self.slots.release()
        return len(self.free) == self.blocks and not self.pinned and not self.queued and slots == self.capacity


def advance(clock: VirtualClock, tracker: Tracker, seconds: float, *, poll: bool = True) -> None:
    """Move time on; a healthy poll loop fires each deadline the moment it is due."""
    target = clock.now + seconds
    while poll and (due := tracker.next_deadline()) is not None and due <= target:
        clock.now = max(clock.now, due)
        tracker.poll()
    clock.now = target


EVENTS = ["enqueue", "enqueue", "start", "start", "complete", "complete", "fail", "abort", "expire"]


@dataclass
class Run:
    path: Path
    driver: KvDriver
    illegal: int
    ignored: int
    failures: int


def workload(path: Path, *, seed: int = 7, steps: int = 1500) -> Run:
    """Drive a journaled Tracker through a varied, seeded workload and close it."""
    rng = random.Random(seed)
    clock, driver = VirtualClock(START), KvDriver()
    keys: list[Hashable] = [f"req-{i}" for i in range(18)] + list(range(6))
    failures = 0
    with JsonlJournal(path, machine=SPEC.name, append=False) as journal:
        tracker = Tracker(SPEC, driver, clock=clock, observer=journal)
        for _ in range(steps):
            roll, key = rng.random(), rng.choice(keys)
            state = tracker.state(key)
            try:
                if roll < 0.06:
                    advance(clock, tracker, rng.uniform(0.0, 20.0))
                elif roll < 0.09:
                    driver.faults.append(rng.choice(["enqueue_job", "start_transfer"]))
                elif roll < 0.11:
                    tracker.finished()
                elif state in FINALS and roll < 0.2:
                    tracker.fire(key, rng.choice(["abort", "complete", "expire"]))  # late: a no-op
                elif state is None or state in FINALS:
                    if driver.pin(key):
                        tracker.begin(key)
                else:
                    tracker.fire(key, rng.choice(EVENTS))
            except IllegalTransition:
                pass
            except ActionError:
                failures += 1
            for k in keys:
                assert driver.observe(k) == set(tracker.held(k)), k
        tracker.close()
        assert journal.dropped == 0
    return Run(path, driver, tracker.counts["illegal"], tracker.counts["ignored"], failures)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return workload(tmp_path_factory.mktemp("replay") / "run.jsonl")


# -- reading and editing logs -----------------------------------------------------------------


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def records(lines: list[bytes]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, record) for each transition line; the line number is index + 1."""
    for i, raw in enumerate(lines):
        doc = json.loads(raw)
        if "key" in doc:
            yield i, doc


def line(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def check_edited(tmp_path: Path, lines: list[bytes], **options: Any) -> LogReport:
    path = tmp_path / "edited.jsonl"
    path.write_bytes(b"".join(lines))
    return check_log(SPEC, path, **options)


def first(report: LogReport) -> Finding:
    assert report.first is not None, "the edited log was accepted"
    return report.first


def key_of(finding: Finding) -> Any:
    """The key a finding names, as the log wrote it (a message says ``key "req-7"`` or ``key 7``)."""
    found = re.search(r"\bkey (\S+?)(?=[ :,)]|$)", finding.message)
    assert found is not None, f"no key named in: {finding.message}"
    return json.loads(found.group(1))


def instance_lines(lines: list[bytes], key: Any, generation: int) -> list[int]:
    return [i for i, doc in records(lines) if doc["key"] == key and doc["generation"] == generation]


# -- the real log -------------------------------------------------------------------------------


def test_workload_is_varied_and_leaves_the_driver_idle(recorded: Run) -> None:
    """The log below must exercise what it claims to, or its acceptance would prove little."""
    docs = [doc for _i, doc in records(lines_of(recorded.path))]
    events = Counter(doc["event"] for doc in docs)
    assert {"begin", "enqueue", "start", "complete", "fail", "abort", "expire"} <= set(events)
    generations = Counter(doc["key"] for doc in docs if doc["event"] == "begin")
    assert max(generations.values()) >= 3, "keys are reused"
    assert {type(k) for k in generations} == {str, int}
    assert recorded.failures > 0 and recorded.illegal > 0 and recorded.ignored > 0
    assert recorded.driver.idle()


def test_log_the_tracker_wrote_conforms(recorded: Run) -> None:
    report = check_log(SPEC, recorded.path)
    assert report.findings == ()
    assert report.conforms and report.live == 0 and report.sessions == 1
    assert report.records == len(lines_of(recorded.path)) - 1


def test_ignored_and_illegal_events_are_not_logged(recorded: Run) -> None:
    """Every logged line is a real edge: no-ops and refused events leave no trace."""
    edges = {(e.source, e.event): e.target for e in SPEC.edges()}
    for _i, doc in records(lines_of(recorded.path)):
        if doc["event"] != "begin":
            assert edges[doc["from"], doc["event"]] == doc["to"], doc


# -- edited logs, rejected at the right line ------------------------------------------------------


def test_changed_target_is_rejected_at_its_line(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    i, doc = next((i, d) for i, d in records(lines) if d["event"] == "complete")
    lines[i] = line({**doc, "to": "failed"})
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line, key_of(d)) == (codes.WRONG_TARGET, i + 1, doc["key"])
    assert "'done'" in d.message and f"{CANONICAL}:" in d.message


def test_deleted_release_line_leaves_the_instance_holding(recorded: Run, tmp_path: Path) -> None:
    """Delete the line that finished an instance in 'queued': it ends the log holding both resources."""
    lines = lines_of(recorded.path)
    last_gen = {d["key"]: d["generation"] for _i, d in records(lines) if d["event"] == "begin"}
    i, doc = next(
        (i, d)
        for i, d in records(lines)
        if d["from"] == "queued" and d["to"] in FINALS and last_gen[d["key"]] == d["generation"]
    )
    entered = max(j for j in instance_lines(lines, doc["key"], doc["generation"]) if j < i)
    del lines[i]
    report = check_edited(tmp_path, lines)
    d = first(report)
    assert (d.code, d.line, key_of(d)) == (codes.UNRELEASED, entered + 1, doc["key"])
    assert "'queued' holding gpu_blocks, queue_slot" in d.message
    assert report.total == 1
    assert check_edited(tmp_path, lines, allow_live=True).conforms


def test_deleted_final_line_shows_at_the_keys_next_begin(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    begins = [(i, d) for i, d in records(lines) if d["event"] == "begin"]
    i, doc, nxt = next(
        (i, d, j) for i, d in records(lines) if d["to"] in FINALS for j, b in begins if b["key"] == d["key"] and j > i
    )
    del lines[i]
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line, key_of(d)) == (codes.DUPLICATE_BEGIN, nxt, doc["key"])  # nxt - 1 + 1: one line gone


def test_swapped_lines_are_rejected_where_the_order_breaks(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    i, doc = next((i, d) for i, d in records(lines) if d["event"] == "enqueue")
    j = next(j for j in instance_lines(lines, doc["key"], doc["generation"]) if j > i)
    lines[i], lines[j] = lines[j], lines[i]
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line, key_of(d)) == (codes.WRONG_SOURCE, i + 1, doc["key"])
    assert "'pinned'" in d.message


def test_overrun_deadline_is_rejected_at_the_late_line(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    i, doc = next((i, d) for i, d in records(lines) if d["from"] == "transferring" and d["event"] == "complete")
    entered = max(j for j in instance_lines(lines, doc["key"], doc["generation"]) if j < i)
    since = json.loads(lines[entered])["time"]
    lines[i] = line({**doc, "time": since + TIMEOUT + 1.5})
    report = check_edited(tmp_path, lines)
    d = first(report)
    assert (d.code, d.line, key_of(d)) == (codes.OVERRUN, i + 1, doc["key"])
    assert "transfer_timeout=30s" in d.message and f"line {entered + 1}" in d.message
    assert check_edited(tmp_path, lines, tolerance=2.0).by_code.get(codes.OVERRUN, 0) == 0


def test_duplicated_begin_is_rejected_at_the_copy(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    i, doc = next((i, d) for i, d in records(lines) if d["event"] == "begin" and i > 20)
    lines.insert(i + 1, lines[i])
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line, key_of(d)) == (codes.DUPLICATE_BEGIN, i + 2, doc["key"])


def test_malformed_lines_are_reported_by_line_and_the_rest_still_checked(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    _i, doc = next(records(lines))
    bad = [
        b"not json at all\n",
        b'{"key": "req-1", "generation": 3,\n',
        line({**doc, "generation": "7"}),
        line({k: v for k, v in doc.items() if k != "to"}),
        b"[1, 2, 3]\n",
        b"\xff\xfe\n",
    ]
    at = [10, 40, 41, 90, 200, 300]
    for offset, (where, text) in enumerate(zip(at, bad, strict=True)):
        lines.insert(where + offset, text)
    report = check_edited(tmp_path, lines)
    assert [(d.code, d.line) for d in report.findings] == [
        (codes.MALFORMED, where + offset + 1) for offset, where in enumerate(at)
    ]
    assert "generation" in report.findings[2].message and "`to`" in report.findings[3].message


def test_truncated_log_is_rejected_at_its_cut_line(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    cut = len(lines) // 2
    lines = [*lines[:cut], lines[cut][: len(lines[cut]) // 2]]
    report = check_edited(tmp_path, lines)
    d = first(report)
    assert (d.code, d.line) == (codes.TRUNCATED, cut + 1)
    assert report.by_code.get(codes.UNRELEASED, 0) == report.live > 0
    only = check_edited(tmp_path, lines, allow_live=True)
    assert [(d.code, d.line) for d in only.findings] == [(codes.TRUNCATED, cut + 1)]


def test_truncated_gzip_log_is_reported_not_raised(recorded: Run, tmp_path: Path) -> None:
    packed = gzip.compress(recorded.path.read_bytes())
    whole = tmp_path / "run.jsonl.gz"
    whole.write_bytes(packed)
    assert check_log(SPEC, whole).conforms
    whole.write_bytes(packed[: len(packed) // 2])
    report = check_log(SPEC, whole, allow_live=True)
    assert [d.code for d in report.findings] == [codes.TRUNCATED]


def test_deleted_begin_makes_the_next_line_an_unknown_instance(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    i, doc = next((i, d) for i, d in records(lines) if d["event"] == "begin" and i > 5)
    j = next(j for j in instance_lines(lines, doc["key"], doc["generation"]) if j > i)
    del lines[i]
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line, key_of(d)) == (codes.UNKNOWN_INSTANCE, j, doc["key"])


def test_changed_generation_is_rejected(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    i, doc = next((i, d) for i, d in records(lines) if d["event"] == "start")
    lines[i] = line({**doc, "generation": doc["generation"] + 1000})
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line) == (codes.GENERATION, i + 1)


def test_logged_ignored_event_is_illegal_and_says_so(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    i, doc = next((i, d) for i, d in records(lines) if d["to"] == "done")
    lines.insert(i + 1, line({**doc, "event": "abort", "from": "done", "to": "aborted"}))
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line) == (codes.ILLEGAL, i + 2)
    assert "ignored there" in d.message and "never logs" in d.message


def test_time_running_backwards_is_rejected(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    j, doc, later = next(
        (j, d, e) for (_i, d), (j, e) in itertools.pairwise(records(lines)) if e["time"] > d["time"] + 1
    )
    lines[j] = line({**later, "time": doc["time"] - 5})
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line) == (codes.TIME_BACKWARDS, j + 1)


def test_log_of_another_machine_is_rejected_at_its_header(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    lines[0] = line({**json.loads(lines[0]), "machine": "mooncake_store_send"})
    d = first(check_edited(tmp_path, lines))
    assert (d.code, d.line) == (codes.WRONG_MACHINE, 1)


# -- deadlines and params as a deployment sets them ---------------------------------------------------


def stalled(path: Path, *, timeout_param: dict[str, float] | None = None, stall: float) -> None:
    """One transfer that runs ``stall`` seconds before the poll loop (or the peer) gets to it."""
    clock, driver = VirtualClock(START), KvDriver()
    with JsonlJournal(path, machine=SPEC.name, append=False) as journal:
        tracker = Tracker(SPEC, driver, clock=clock, params=timeout_param, observer=journal)
        for key in ("slow", "quick"):
            driver.pin(key)
            tracker.begin(key)
            tracker.fire(key, "enqueue")
            tracker.fire(key, "start")
        tracker.fire("quick", "complete")
        advance(clock, tracker, stall, poll=False)
        tracker.poll()
        tracker.close()


def test_stalled_poll_loop_shows_as_an_overrun_on_the_timeout_line(tmp_path: Path) -> None:
    path = tmp_path / "stalled.jsonl"
    stalled(path, stall=TIMEOUT + 10)
    report = check_log(SPEC, path)
    d = first(report)
    expire = next(i for i, doc in records(lines_of(path)) if doc["event"] == "expire")
    assert (d.code, d.line, key_of(d)) == (codes.OVERRUN, expire + 1, "slow")
    assert "'expire' was due at t=1030.000" in d.message
    stalled(path, stall=TIMEOUT)
    assert check_log(SPEC, path).conforms


def test_overridden_timeout_is_checked_with_the_deployments_param(tmp_path: Path) -> None:
    path = tmp_path / "override.jsonl"
    stalled(path, timeout_param={"transfer_timeout": 50.0}, stall=40.0)
    lines = lines_of(path)
    assert not any(doc["event"] == "expire" for _i, doc in records(lines))
    assert [d.code for d in check_log(SPEC, path).findings] == [codes.OVERRUN]
    assert check_log(SPEC, path, params={"transfer_timeout": 50.0}).conforms
    with pytest.raises(BindingError, match="declared: transfer_timeout"):
        check_log(SPEC, path, params={"transfer_timout": 50.0})


def test_instance_left_past_its_deadline_at_the_end_is_an_overrun(tmp_path: Path) -> None:
    path = tmp_path / "stalled.jsonl"
    stalled(path, stall=TIMEOUT + 10)
    lines = [raw for raw in lines_of(path) if not (b'"slow"' in raw and b'"expire"' in raw)]
    lines.append(line({"key": "late", "generation": 99, "event": "begin", "from": "", "to": "pinned", "time": 2000}))
    lines.append(
        line({"key": "late", "generation": 99, "event": "abort", "from": "pinned", "to": "aborted", "time": 2000})
    )
    report = check_edited(tmp_path, lines)
    started = next(i for i, d in records(lines) if d["key"] == "slow" and d["event"] == "start")
    assert [(d.code, d.line, key_of(d)) for d in report.findings] == [(codes.OVERRUN, started + 1, "slow")]
    assert "still there at the end of the log" in report.findings[0].message


# -- sessions: one file appended to across restarts ------------------------------------------------------


def test_restarted_tracker_appends_a_new_session(tmp_path: Path) -> None:
    path = tmp_path / "appended.jsonl"
    for _restart in range(2):
        driver, clock = KvDriver(), VirtualClock(START)
        with JsonlJournal(path, machine=SPEC.name) as journal:
            tracker = Tracker(SPEC, driver, clock=clock, observer=journal)
            for key in ("a", "b"):
                driver.pin(key)
                tracker.begin(key)
                tracker.fire(key, "enqueue")
            tracker.close()
    report = check_log(SPEC, path)
    assert report.conforms and report.sessions == 2 and report.instances == 4


def test_crashed_session_reports_what_it_left_holding_at_the_restart(tmp_path: Path) -> None:
    path = tmp_path / "crashed.jsonl"
    with JsonlJournal(path, machine=SPEC.name) as journal:
        driver = KvDriver()
        tracker = Tracker(SPEC, driver, clock=VirtualClock(START), observer=journal)
        driver.pin("a")
        tracker.begin("a")  # the process dies here: no close()
    with JsonlJournal(path, machine=SPEC.name) as journal:
        tracker = Tracker(SPEC, KvDriver(), clock=VirtualClock(START), observer=journal)
        tracker.close()
    report = check_log(SPEC, path)
    assert [(d.code, d.line, key_of(d)) for d in report.findings] == [(codes.UNRELEASED, 2, "a")]
    assert "restart at line 3" in report.findings[0].message


# -- the journal itself -----------------------------------------------------------------------------------


def tracker_with(
    journal: JsonlJournal, clock: Callable[[], float] | None = None, **driver_options: int
) -> tuple[Tracker, KvDriver]:
    driver = KvDriver(**driver_options)
    return Tracker(SPEC, driver, clock=clock or VirtualClock(START), observer=journal), driver


def test_str_and_int_keys_stay_distinct_and_tuples_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "keys.jsonl"
    with JsonlJournal(path, append=False) as journal:
        tracker, driver = tracker_with(journal)
        for key in (7, "7", ("peer", 7)):
            driver.pin(key)
            tracker.begin(key)
        tracker.close()
    keys = [doc["key"] for _i, doc in records(lines_of(path)) if doc["event"] == "begin"]
    assert keys == [7, "7", ["peer", 7]]
    assert check_log(SPEC, path).conforms


def test_key_msgspec_cannot_encode_is_logged_as_its_str(tmp_path: Path) -> None:
    class Rid:
        def __init__(self, n: int) -> None:
            self.n = n

        def __str__(self) -> str:
            return f"rid-{self.n}"

    path = tmp_path / "objkeys.jsonl"
    with JsonlJournal(path, append=False) as journal:
        tracker, driver = tracker_with(journal)
        key = Rid(3)
        driver.pin(key)
        tracker.begin(key)
        tracker.fire(key, "abort")
    assert [doc["key"] for _i, doc in records(lines_of(path))] == ["rid-3", "rid-3"]


def test_line_buffered_journal_writes_each_line_at_once(tmp_path: Path) -> None:
    path = tmp_path / "tail.jsonl"
    with JsonlJournal(path, buffer_bytes=0) as journal:
        tracker, driver = tracker_with(journal)
        driver.pin("a")
        tracker.begin("a")
        assert len(lines_of(path)) == 2
        tracker.fire("a", "enqueue")
        assert json.loads(lines_of(path)[-1])["to"] == "queued"


def test_buffered_journal_writes_on_flush_and_once_its_interval_passes(tmp_path: Path) -> None:
    path = tmp_path / "buffered.jsonl"
    clock = VirtualClock(START)
    with JsonlJournal(path, flush_interval=1.0) as journal:
        tracker, driver = tracker_with(journal, clock)
        driver.pin("a")
        tracker.begin("a")
        assert len(lines_of(path)) == 2, "the header and the first line go out at once"
        tracker.fire("a", "enqueue")
        tracker.fire("a", "start")
        assert len(lines_of(path)) == 2
        journal.flush()
        assert len(lines_of(path)) == 4
        clock.now += 0.5
        tracker.fire("a", "complete")
        assert len(lines_of(path)) == 4
        driver.pin("b")
        clock.now += 0.6
        tracker.begin("b")
        assert len(lines_of(path)) == 6, "a second of tracker time passed since the last write"


def test_failed_writes_are_counted_never_raised_into_the_tracker() -> None:
    class FullDisk(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            raise OSError(28, "No space left on device")

    journal = JsonlJournal(FullDisk(), buffer_bytes=0)
    tracker, driver = tracker_with(journal)
    driver.pin("a")
    tracker.begin("a")
    assert tracker.fire("a", "enqueue") == "queued"
    assert journal.dropped == 3 and isinstance(journal.error, OSError)
    journal.close()
    tracker.close()
    assert journal.dropped == 4 and driver.idle()


def test_text_stream_target_is_flushed_and_left_open() -> None:
    stream = io.StringIO()
    journal = JsonlJournal(stream, machine=SPEC.name)
    tracker, driver = tracker_with(journal)
    driver.pin("a")
    tracker.begin("a")
    tracker.close()
    journal.close()
    assert not stream.closed
    report = check_log(SPEC, [raw.encode() for raw in stream.getvalue().splitlines(keepends=True)])
    assert report.conforms and report.records == 2


def test_journal_from_worker_threads_with_a_concurrent_flusher_conforms(tmp_path: Path) -> None:
    path = tmp_path / "threads.jsonl"
    journal = JsonlJournal(path, append=False, buffer_bytes=512)
    clock = VirtualClock(START)
    tracker, driver = tracker_with(journal, clock, blocks=2_500)
    stop = threading.Event()
    pin_lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(300):
            key = f"w{n}-{i}"
            with pin_lock:
                driver.pin(key)
            tracker.begin(key)
            for event in ("enqueue", "start", "complete") if i % 3 else ("enqueue", "abort"):
                try:
                    tracker.fire(key, event)
                except ActionError:
                    break  # the queue was full: the instance failed, releasing its blocks

    flushes = 0

    def flusher() -> None:
        nonlocal flushes
        while not stop.wait(0.0002):  # flushes all along the run; a loop with no pause starves the workers of the GIL
            journal.flush()
            flushes += 1

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    side = threading.Thread(target=flusher)
    side.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    side.join()
    tracker.close()
    journal.close()
    report = check_log(SPEC, path)
    assert report.conforms and report.instances == 1200 and journal.dropped == 0
    assert driver.idle() and flushes >= 10  # the flushes ran among the writes


# -- the command line ------------------------------------------------------------------------------------------


def kvfsm_cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", *args],
        capture_output=True,
        cwd=ROOT,
        timeout=120,
        input=stdin,
    )
    done = subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    )
    assert "Traceback" not in done.stdout + done.stderr
    return done


def test_cli_accepts_the_real_log(recorded: Run) -> None:
    result = kvfsm_cli("replay", str(CANONICAL), str(recorded.path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "conforms" in result.stdout


def test_cli_prints_the_first_finding_with_its_line_and_exits_one(recorded: Run, tmp_path: Path) -> None:
    lines = lines_of(recorded.path)
    edits = [i for i, d in records(lines) if d["event"] == "complete"][:3]
    for i in edits:
        lines[i] = line({**json.loads(lines[i]), "to": "failed"})
    path = tmp_path / "edited.jsonl"
    path.write_bytes(b"".join(lines))
    result = kvfsm_cli("replay", str(CANONICAL), str(path))
    assert result.returncode == 1
    assert result.stdout.count(codes.WRONG_TARGET) == 2 and f"{path}:{edits[0] + 1}:" in result.stdout
    assert "--all lists them" in result.stdout
    every = kvfsm_cli("replay", str(CANONICAL), str(path), "--all")
    assert [f"{path}:{i + 1}:" in every.stdout for i in edits] == [True] * 3
    doc = json.loads(kvfsm_cli("replay", str(CANONICAL), str(path), "--format", "json").stdout)
    assert doc["conforms"] is False and doc["errors"] == doc["total"] >= 3
    found = doc["files"][0]["findings"][0]
    assert (found["code"], found["line"], found["path"]) == (codes.WRONG_TARGET, edits[0] + 1, str(path))


def test_cli_reads_stdin_and_takes_params(tmp_path: Path) -> None:
    path = tmp_path / "override.jsonl"
    stalled(path, timeout_param={"transfer_timeout": 50.0}, stall=40.0)
    data = path.read_bytes()
    assert kvfsm_cli("replay", str(CANONICAL), "-", stdin=data).returncode == 1
    assert kvfsm_cli("replay", str(CANONICAL), "-", "--param", "transfer_timeout=50", stdin=data).returncode == 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["no/such.jsonl"], "does not exist"),
        (["."], "is a directory"),
        (["LOG", "--param", "transfer_timout=5"], "not declared"),
        (["LOG", "--param", "transfer_timeout"], "NAME=SECONDS"),
        (["LOG", "--tolerance", "-1"], "--tolerance"),
    ],
)
def test_cli_usage_errors_exit_two(recorded: Run, args: list[str], says: str) -> None:
    args = [str(recorded.path) if a == "LOG" else a for a in args]
    result = kvfsm_cli("replay", str(CANONICAL), *args)
    assert result.returncode == 2 and says in result.stderr, result.stderr


def test_cli_unusable_spec_exits_two(recorded: Run, tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kvfsm: 1\nmachine: m\nkey: k\nstates: {a: {initial: true}}\ntransitions: []\n")
    for spec in (broken, tmp_path / "missing.yaml"):
        result = kvfsm_cli("replay", str(spec), str(recorded.path))
        assert result.returncode == 2, result.stdout + result.stderr
