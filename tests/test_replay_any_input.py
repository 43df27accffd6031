"""The log checker takes any bytes: damage to a journal is a KVF3xx finding at its line, never an exception.

A valid journal is written by a real Tracker with a JsonlJournal on the bundled
kv_request spec; the tests damage it the ways files get damaged (bytes flipped,
cut, inserted or deleted, lines duplicated or lost, text that is not UTF-8,
nesting far deeper than a decoder follows, numbers no float holds, gzip that
is corrupt or cut short) and check that ``check_log`` and ``kvfsm replay``
report findings and go on reading wherever the log can still be read.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import random
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvfsm
import kvfsm.cli
from kvfsm import ActionError, IllegalTransition, Tracker
from kvfsm.replay import JsonlJournal, LogReport, check_log, codes
from kvfsm.spec.bundled import SPECS
from kvfsm.testing.clock import VirtualClock

SPEC_PATH = SPECS / "kv_request.yaml"
SPEC = kvfsm.load(SPEC_PATH)
FINDING_FIELDS = {"code", "severity", "path", "line", "message", "fix", "col"}


class HoldingDriver:
    """kv_request's actions on a per-key ledger of what is held; a failing enqueue when the queue is full."""

    def __init__(self, slots: int = 3) -> None:
        self.held: dict[Hashable, set[str]] = {}
        self.slots = slots

    def pin(self, key: Hashable) -> None:
        """What the engine does before ``begin``: keep the request's GPU blocks."""
        self.held.setdefault(key, set()).add("gpu_blocks")

    def free_gpu_blocks(self, key: Hashable) -> None:
        self.held[key].remove("gpu_blocks")

    def enqueue_job(self, key: Hashable) -> None:
        if sum("queue_slot" in held for held in self.held.values()) >= self.slots:
            raise RuntimeError("transfer queue full")
        self.held[key].add("queue_slot")

    def task_done(self, key: Hashable) -> None:
        self.held[key].remove("queue_slot")

    def start_transfer(self, key: Hashable) -> None:
        assert "gpu_blocks" in self.held[key]


def write_journal(path: Path, *, seed: int = 3, steps: int = 120) -> None:
    """A journal of a seeded run: reused str and int keys, a full queue, deadlines that fire, and close()."""
    rng = random.Random(seed)
    clock, driver = VirtualClock(100.0), HoldingDriver()
    keys: list[Hashable] = ["a", "b", "c", 7, 8]
    with JsonlJournal(path, machine=SPEC.name, append=False) as journal:
        tracker = Tracker(SPEC, driver, clock=clock, observer=journal)
        for _ in range(steps):
            key = rng.choice(keys)
            state = tracker.state(key)
            clock.advance(rng.uniform(0.0, 0.9))  # a poll loop that ticks within the tolerance
            tracker.poll()
            try:
                if state is None or state in SPEC.finals:
                    driver.pin(key)
                    tracker.begin(key)
                else:
                    tracker.fire(key, rng.choice(["enqueue", "start", "start", "complete", "abort", "fail"]))
            except (IllegalTransition, ActionError):
                pass
        tracker.close()
    assert journal.dropped == 0


@pytest.fixture(scope="module")
def journal(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("journal") / "run.jsonl"
    write_journal(path)
    data = path.read_bytes()
    assert check_log(SPEC, path).conforms, "the undamaged journal must conform, or damage proves nothing"
    return data


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file the property tests overwrite per example (Hypothesis runs many examples per test call)."""
    return tmp_path_factory.mktemp("damaged") / "log"


def check_bytes(data: bytes, **options: Any) -> LogReport:
    """Check a log held in memory as a stream, so gzip is told by its first bytes like a file's."""
    return check_log(SPEC, io.BufferedReader(io.BytesIO(data)), name="damaged.jsonl", **options)


def cli(*args: str) -> tuple[int, str, str]:
    """``kvfsm`` in process: (exit status, stdout, stderr)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = kvfsm.cli.main(list(args))
    return status, stdout.getvalue(), stderr.getvalue()


def assert_well_formed(report: LogReport) -> None:
    """Every finding has a KVF3xx code and points at a line the log has, or the one where reading stopped."""
    assert report.total == sum(report.by_code.values()) >= len(report.findings)
    for f in report.findings:
        assert f.code in codes.NAMES and f.severity == "error", f
        assert 1 <= f.line <= report.lines + 1 and f.col >= 1, f
        assert f.message and f.fix, f


def lines_of(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


# -- the damage a file can take, one named case each -------------------------------------------------


def test_invalid_utf8_inside_a_string_is_a_malformed_line_and_the_rest_is_checked(journal: bytes) -> None:
    lines = lines_of(journal)
    later = next(i for i, raw in enumerate(lines) if i > 20 and b'"from":"pinned"' in raw)
    lines[later] = lines[later].replace(b'"to":"', b'"to":"nowhere', 1)  # a later edit must still be found
    lines.insert(5, lines[5].replace(b'"event":"', b'"event":"\xff\xfe', 1))
    report = check_bytes(b"".join(lines))
    assert [(f.code, f.line) for f in report.findings[:2]] == [(codes.MALFORMED, 6), (codes.WRONG_TARGET, later + 2)]
    assert "not UTF-8" in report.findings[0].message and report.findings[0].col > 1


@pytest.mark.parametrize("depth", [500, 50_000])
def test_a_key_nested_deeper_than_any_tracker_key_is_a_malformed_line(journal: bytes, depth: int) -> None:
    lines = lines_of(journal)
    doc = json.loads(lines[3])
    nested = b"[" * depth + b'"x"' + b"]" * depth
    lines.insert(
        3,
        b'{"key":'
        + nested
        + b',"generation":%d,"event":"begin","from":"","to":"pinned","time":%r}\n' % (10**6, doc["time"]),
    )
    report = check_bytes(b"".join(lines))
    assert [(f.code, f.line) for f in report.findings] == [(codes.MALFORMED, 4)]
    assert "nested" in report.findings[0].message
    assert report.records == len(lines) - 2, "every other line was checked"


def test_numbers_no_float_holds_are_malformed_lines(journal: bytes) -> None:
    lines = lines_of(journal)
    doc = json.loads(lines[4])
    lines[4] = lines[4].replace(b'"time":', b'"time":1' + b"0" * 400 + b',"was":', 1)
    lines[8] = lines[8].replace(b'"generation":', b'"generation":-1e999,"g":', 1)
    report = check_bytes(b"".join(lines))
    assert [(f.code, f.line) for f in report.findings[:2]] == [(codes.MALFORMED, 5), (codes.MALFORMED, 9)], doc


def test_corrupt_gzip_is_reported_where_reading_stopped_after_checking_what_came_before(journal: bytes) -> None:
    packed = bytearray(gzip.compress(journal))
    packed[-6] ^= 0xFF  # the CRC of the data: every line decompresses, then the check fails
    report = check_bytes(bytes(packed))
    last = len(lines_of(journal))
    assert [(f.code, f.line) for f in report.findings] == [(codes.UNREADABLE, last + 1)]
    assert report.records == last - 1 and "corrupt" in report.findings[0].message


def test_a_file_that_only_looks_gzip_is_unreadable_at_line_one() -> None:
    report = check_bytes(b"\x1f\x8b" + b"\x00" * 40)
    assert [(f.code, f.line) for f in report.findings] == [(codes.UNREADABLE, 1)]


def test_gzip_cut_short_is_truncated_at_the_line_where_reading_stopped(journal: bytes) -> None:
    packed = gzip.compress(journal)
    report = check_bytes(packed[: len(packed) * 2 // 3], allow_live=True)
    assert [f.code for f in report.findings] == [codes.TRUNCATED]
    assert report.findings[0].line == report.lines + 1 and 0 < report.records < len(lines_of(journal))


def test_gzip_is_told_by_its_content_not_its_name(journal: bytes, tmp_path: Path) -> None:
    packed, plain = tmp_path / "rotated.1", tmp_path / "mislabelled.jsonl.gz"
    packed.write_bytes(gzip.compress(journal))
    plain.write_bytes(journal)
    assert check_log(SPEC, packed).conforms and check_log(SPEC, plain).conforms


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda b: b.replace(b'"key":"a"', b'"key":"a\xc3"', 1), id="utf8"),
        pytest.param(lambda b: b.replace(b'"key":"a"', b'"key":' + b"[" * 500 + b"]" * 500, 1), id="deep-500"),
        pytest.param(lambda b: b.replace(b'"key":"a"', b'"key":' + b"[" * 5000 + b"]" * 5000, 1), id="deep-5000"),
        pytest.param(lambda b: gzip.compress(b)[:-20] + b"\x00" * 20, id="corrupt-gzip"),
        pytest.param(lambda b: gzip.compress(b)[:200], id="cut-gzip"),
    ],
)
def test_cli_reports_damage_as_findings_not_internal_errors(
    journal: bytes, scratch: Path, damage: Callable[[bytes], bytes]
) -> None:
    scratch.write_bytes(damage(journal))
    status, stdout, stderr = cli("replay", str(SPEC_PATH), str(scratch), "--format", "json")
    assert (status, stderr) == (1, "")
    doc = json.loads(stdout)
    assert doc["files"][0]["path"] == str(scratch) and not doc["files"][0]["clean"]
    assert all(set(f) == FINDING_FIELDS and f["code"] in codes.NAMES for f in doc["files"][0]["findings"])


# -- any damage at all ---------------------------------------------------------------------------------


def _flip(data: bytes, at: int, mask: int) -> bytes:
    if not data:
        return data
    i = at % len(data)
    return data[:i] + bytes([data[i] ^ mask]) + data[i + 1 :]


def _splice(data: bytes, at: int, cut: int, insert: bytes) -> bytes:
    i = at % (len(data) + 1)
    return data[:i] + insert + data[i + cut :]


def _lines(data: bytes, edit: Callable[[list[bytes]], None]) -> bytes:
    lines = lines_of(data)
    if lines:
        edit(lines)
    return b"".join(lines)


def _duplicate(at: int) -> Callable[[list[bytes]], None]:
    return lambda lines: lines.insert(at % len(lines), lines[at % len(lines)])


def _drop(at: int) -> Callable[[list[bytes]], None]:
    def drop(lines: list[bytes]) -> None:
        del lines[at % len(lines)]

    return drop


def _swap(at: int, other: int) -> Callable[[list[bytes]], None]:
    def swap(lines: list[bytes]) -> None:
        i, j = at % len(lines), other % len(lines)
        lines[i], lines[j] = lines[j], lines[i]

    return swap


def _in_a_string(data: bytes, at: int, inserted: bytes) -> bytes:
    """``inserted`` just after the n-th ``"`` of the log, so it lands inside a JSON string (or next to one)."""
    quotes = [i for i, byte in enumerate(data) if byte == 0x22]
    if not quotes:
        return data + inserted
    i = quotes[at % len(quotes)] + 1
    return data[:i] + inserted + data[i:]


def _nested(data: bytes, at: int, depth: int, open_: bytes) -> bytes:
    close = {b"[": b"]", b"{": b"}"}[open_]
    inner = b'"k":1' if open_ == b"{" else b"1"
    value = (open_ + (b'"k":' if open_ == b"{" else b"")) * (depth - 1) + open_ + inner + close * depth
    return _in_a_string(data, at, b'",' + b'"n":' + value + b',"x":"')


NOT_UTF8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80\x80", b"\xc0\xaf"])
HUGE = st.sampled_from([b"1" + b"0" * 400, b"-1e999", b"1e999", b"18446744073709551616", b"-9" * 50, b"1e-999"])
NUMBER_FIELD = st.sampled_from([b'"time":', b'"generation":', b'"key":', b'"journal":', b'"opened":'])


@st.composite
def damage(draw: st.DrawFn) -> Callable[[bytes], bytes]:
    """One of the ways a log file gets damaged, as a function of its bytes."""
    at = draw(st.integers(0, 1 << 20))
    kind = draw(
        st.sampled_from(
            ["flip", "delete", "insert", "truncate", "duplicate", "drop", "swap", "utf8", "nest", "huge", "zero"]
        )
    )
    if kind == "flip":
        mask = draw(st.integers(1, 255))
        return lambda b: _flip(b, at, mask)
    if kind == "delete":
        cut = draw(st.integers(1, 64))
        return lambda b: _splice(b, at, cut, b"")
    if kind == "insert":
        junk = draw(st.binary(min_size=1, max_size=32))
        return lambda b: _splice(b, at, 0, junk)
    if kind == "truncate":
        return lambda b: b[: at % (len(b) + 1)]
    if kind == "duplicate":
        return lambda b: _lines(b, _duplicate(at))
    if kind == "drop":
        return lambda b: _lines(b, _drop(at))
    if kind == "swap":
        other = draw(st.integers(0, 1 << 20))
        return lambda b: _lines(b, _swap(at, other))
    if kind == "utf8":
        bad = draw(NOT_UTF8)
        return lambda b: _in_a_string(b, at, bad)
    if kind == "nest":
        depth, open_ = draw(st.integers(1, 3000)), draw(st.sampled_from([b"[", b"{"]))
        return lambda b: _nested(b, at, depth, open_)
    if kind == "huge":
        field, number = draw(NUMBER_FIELD), draw(HUGE)
        return lambda b: b.replace(field, field + number + b',"was":', 1 + at % 3)
    size = draw(st.integers(1, 4096))
    return lambda b: _splice(b, at, 0, b"\x00" * size)  # a crashed file system's hole


@st.composite
def damaged(draw: st.DrawFn, journal: bytes) -> bytes:
    """The journal after a few kinds of damage; sometimes gzipped, and the gzip damaged too."""
    data = journal
    for harm in draw(st.lists(damage(), min_size=1, max_size=4)):
        data = harm(data)
    if draw(st.booleans()):
        data = gzip.compress(data)
        for harm in draw(st.lists(damage(), max_size=2)):
            data = harm(data)
    return data


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_is_findings_never_an_exception(journal: bytes, data: st.DataObject) -> None:
    log = data.draw(damaged(journal))
    for allow_live in (False, True):
        assert_well_formed(check_bytes(log, allow_live=allow_live))
    assert_well_formed(check_log(SPEC, log.splitlines(keepends=True)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_cli_never_ends_in_an_internal_error(journal: bytes, scratch: Path, data: st.DataObject) -> None:
    scratch.write_bytes(data.draw(damaged(journal)))
    status, stdout, stderr = cli("replay", str(SPEC_PATH), str(scratch), "--format", "json", "--all")
    assert status in (0, 1) and stderr == "", stderr
    doc = json.loads(stdout)
    assert doc["conforms"] is (status == 0)
    assert all(set(f) == FINDING_FIELDS for f in doc["files"][0]["findings"])
    status, stdout, stderr = cli("replay", str(SPEC_PATH), str(scratch), "--all")
    assert status in (0, 1) and stderr == "", stderr


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(1, 1 << 20), junk=st.binary(max_size=200).filter(lambda b: b"\n" not in b and b"\r" not in b))
def test_a_line_of_any_bytes_costs_only_that_line(journal: bytes, at: int, junk: bytes) -> None:
    """Whatever one line holds, every other line is still read and checked."""
    lines = lines_of(journal)
    i = 1 + at % (len(lines) - 2)  # neither the header nor the last line (a last line may be cut)
    lines[i] = junk + b"\n"
    report = check_bytes(b"".join(lines), allow_live=True)
    assert_well_formed(report)
    assert report.records >= len(lines) - 2
