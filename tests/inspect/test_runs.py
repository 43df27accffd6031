"""One machine's run on the inspect page: a failing ``kvfsm test`` story and a journal ``kvfsm replay`` checks.

The story comes from real runs of the seeded buggy drivers (``--format json``
as the CLI writes it); the journal from a real Tracker whose poll loop
stalled, so a transfer overran its deadline. Each moment of the page must
put every key where the run put it, with what the spec says that state
holds, and show each problem at the step where it happened.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvfsm
from kvfsm.drivers import pd_loopback
from kvfsm.explore import explore
from kvfsm.explore.trace import Trace
from kvfsm.inspect import InspectError, build_journal, build_replayed, build_story, html
from kvfsm.inspect.runs import MAX_LANES
from kvfsm.replay import JsonlJournal
from kvfsm.testing.runner import run
from kvfsm.testing.trace_replay import replay_trace

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
KV_REQUEST = ROOT / "specs/kv_request.yaml"
MERGED_FIX = ROOT / "specs/pd_abort/merged_fix.yaml"
pytestmark = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed (./dev.sh does)")
sys.path.insert(0, str(TESTS))

import buggy_drivers  # noqa: E402


def story_of(driver: type, seed: int, folder: Path) -> Path:
    report = run(KV_REQUEST, driver, seed=seed, examples=20)
    assert report.diverged, f"{driver.__name__} was not caught"
    out = folder / f"{driver.__name__}.json"
    out.write_text(json.dumps(report.as_dict()))
    return out


@pytest.mark.parametrize("driver", [buggy_drivers.SkipsDecOnPutError, buggy_drivers.TaskDoneFreesBlocks])
def test_every_moment_of_a_story_puts_each_key_where_the_run_did(driver: type, tmp_path: Path) -> None:
    result = story_of(driver, 4, tmp_path)
    failure = json.loads(result.read_text())["failure"]
    spec = kvfsm.load(KV_REQUEST)
    (view,) = build_story(KV_REQUEST, result).traces
    assert len(view.snaps) == len(failure["story"]) + 1 and not view.channel
    for snap, moves in zip(view.snaps[1:], failure["moves"], strict=False):
        where = {i.request: (i.state, i.holds) for i in snap.instances}
        for m in moves:
            assert where[m["key"]] == (m["to"], tuple(spec.states[m["to"]].holds)), snap.text
    assert [s.index for s in view.snaps if s.violation] == [len(failure["story"])]  # only where it diverged
    assert view.snaps[-1].problem == "; ".join(failure["problems"])
    assert not view.snaps[-1].text.endswith(failure["problems"][-1])  # the line, the problem apart


def test_seed_000s_story_shows_the_blocks_the_spec_freed_and_the_driver_kept(tmp_path: Path) -> None:
    result = story_of(buggy_drivers.SkipsDecOnPutError, 4, tmp_path)
    page = build_story(KV_REQUEST, result)
    last = page.traces[0].snaps[-1]
    (req,) = last.instances
    assert (req.state, req.holds) == ("failed", ())
    assert dict(req.freed)["gpu_blocks"] == last.index  # freed by the spec at the move where the driver kept them
    assert "observe says gpu_blocks still held by req-1" in last.problem
    text = html(page)
    assert "as kvfsm test prints it" in text and "start_transfer() raised" in text


def test_a_story_the_page_cannot_show_is_refused_with_why(tmp_path: Path) -> None:
    passed = run(KV_REQUEST, buggy_drivers.StoreSender, seed=0, examples=5)
    (tmp_path / "passed.json").write_text(json.dumps(passed.as_dict()))
    with pytest.raises(InspectError, match="the run passed, so it has no story"):
        build_story(KV_REQUEST, tmp_path / "passed.json")
    result = story_of(buggy_drivers.SkipsDecOnPutError, 4, tmp_path)
    with pytest.raises(InspectError, match="not 'nixl_prefill'"):
        build_story(ROOT / "kvfsm/specs/nixl_prefill.yaml", result)
    with pytest.raises(InspectError, match="system file"):
        build_story(ROOT / "kvfsm/specs/pd_abort/corrected.yaml", result)
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(InspectError, match="is not JSON"):
        build_story(KV_REQUEST, tmp_path / "junk.json")


def test_a_journal_shows_each_finding_at_the_line_of_the_key_it_names(stalled: Path) -> None:
    (view,) = build_journal(KV_REQUEST, stalled).traces
    assert view.lanes == ("req-2", "req-3")  # req-1 kept to its spec: not drawn unless asked for
    broken = {s.request: (s.text, s.problem) for s in view.snaps if s.violation}
    assert broken["req-2"][0] == "t=145.000 complete: transferring → done" and "KVF310" in broken["req-2"][1]
    assert broken["req-3"][0].endswith("enqueue: pinned → queued") and "KVF312" in broken["req-3"][1]
    last = {i.request: (i.state, i.holds) for i in view.snaps[-1].instances}
    assert last == {"req-2": ("done", ()), "req-3": ("queued", ("gpu_blocks", "queue_slot"))}
    assert view.violation == "2 finding(s) (1 KVF310, 1 KVF312)"


def test_a_journal_key_can_be_picked_and_an_unknown_one_is_named(stalled: Path) -> None:
    (view,) = build_journal(KV_REQUEST, stalled, ["req-1"]).traces
    assert view.lanes == ("req-1",) and not any(s.violation for s in view.snaps)
    assert [s.text.split(" ", 1)[1] for s in view.snaps[1:]] == [
        "begin → pinned",
        "enqueue: pinned → queued",
        "start: queued → transferring",
        "complete: transferring → done",
    ]
    with pytest.raises(InspectError, match=re.escape("no transition of key req-9 (its keys: req-1, req-2, req-3)")):
        build_journal(KV_REQUEST, stalled, ["req-9"])
    with pytest.raises(InspectError, match="system file"):
        build_journal(ROOT / "kvfsm/specs/pd_abort/corrected.yaml", stalled)


def test_a_journal_with_more_broken_keys_than_lanes_shows_the_first_and_says_so(tmp_path: Path, quiet: object) -> None:
    log = tmp_path / "queued.jsonl"
    journal = JsonlJournal(log, append=False, machine="kv_request")
    tracker = kvfsm.Tracker(kvfsm.load(KV_REQUEST), quiet, observer=journal)
    keys = [f"req-{n}" for n in range(MAX_LANES + 2)]
    for key in keys:
        tracker.begin(key)  # and never ended: each holds its blocks when the log ends (KVF312)
    journal.close()
    (view,) = build_journal(KV_REQUEST, log).traces
    assert view.lanes == tuple(keys[:MAX_LANES])
    assert f"the first {MAX_LANES} of {len(keys)} keys with findings; --key picks others" in view.purpose
    with pytest.raises(InspectError, match=f"names {len(keys)} keys; a page draws at most {MAX_LANES}"):
        build_journal(KV_REQUEST, log, keys)


def test_damage_in_a_gzip_journal_is_a_step_of_its_own(stalled: Path, tmp_path: Path) -> None:
    lines = stalled.read_bytes().splitlines(keepends=True)
    damaged = tmp_path / "kv.jsonl.gz"
    damaged.write_bytes(gzip.compress(b"".join([*lines[:3], b"{not a journal line\n", *lines[3:]])))
    (view,) = build_journal(KV_REQUEST, damaged).traces
    (junk,) = [s for s in view.snaps if s.text == "line 4"]
    assert junk.violation and "KVF301" in junk.problem and junk.role == ""
    assert "req-2" in view.lanes  # the overrun is still found past the damage


def test_the_cli_writes_both_pages_and_refuses_what_does_not_fit(stalled: Path, tmp_path: Path) -> None:
    result = story_of(buggy_drivers.SkipsDecOnPutError, 4, tmp_path)
    cli = [sys.executable, "-m", "kvfsm.cli", "inspect", str(KV_REQUEST)]

    def call(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120, check=False)

    for option, given in (("--story", result), ("--journal", stalled)):
        done = call(option, str(given), "--html", str(tmp_path / "p.html"))
        assert done.returncode == 0 and "self-contained" in done.stdout, done.stderr
    refused = call("--story", str(result), "--journal", str(stalled))
    assert refused.returncode == 2 and "--journal does not apply to --story" in refused.stderr
    refused = call("--key", "req-1", "--html", str(tmp_path / "p.html"))
    assert refused.returncode == 2 and "--key does not apply" in refused.stderr


@pytest.fixture(scope="module")
def merged_fix_trace() -> Trace:
    (violated,) = [p for p in explore(MERGED_FIX, requests=1).properties if p.trace is not None]
    assert violated.trace is not None
    return violated.trace


def replayed(trace: Trace, drivers: dict[str, Any], folder: Path) -> Path:
    out = folder / "replayed.json"
    out.write_text(json.dumps(replay_trace(MERGED_FIX, trace, drivers).as_dict()))
    return out


def test_a_trace_replay_that_diverged_is_marked_at_its_step(merged_fix_trace: Trace, tmp_path: Path) -> None:
    result = replayed(merged_fix_trace, {"decode": buggy_drivers.frees_only_on_ack}, tmp_path)
    page = build_replayed(MERGED_FIX, merged_fix_trace, result)
    (view,) = page.traces
    (diverged,) = [s for s in view.snaps if s.problem]
    assert diverged.index == 2 and diverged.violation and diverged.text == "abort: waiting → aborted"
    assert diverged.problem == (
        "the drivers diverged from the trace at step 2: observe: expected nothing, "
        "got FreesOnlyOnAck.observe says kv_pages"
    )
    assert view.snaps[-1].violation  # the trace's own violation stays where the explorer found it
    assert page.title == "write_after_free in pd_abort_merged_fix, diverged on the drivers"


def test_a_reproduced_trace_marks_nothing_more_and_another_trace_is_refused(
    merged_fix_trace: Trace, tmp_path: Path
) -> None:
    result = replayed(merged_fix_trace, dict(pd_loopback.factories()), tmp_path)
    page = build_replayed(MERGED_FIX, merged_fix_trace, result)
    assert not any(s.problem for s in page.traces[0].snaps) and page.title.endswith("reproduced on the drivers")
    data = json.loads(result.read_text())
    data["steps"][2]["step"]["event"] = "teleport"
    result.write_text(json.dumps(data))
    with pytest.raises(InspectError, match="replayed another trace: its step 2 differs"):
        build_replayed(MERGED_FIX, merged_fix_trace, result)


@pytest.mark.parametrize(
    ("system", "prop", "drivers", "last"),
    [
        (
            ROOT / "specs/explore/pd_prefill_crash_no_restart.yaml", "final", dict(pd_loopback.factories()),
            "abort_req arrives: ignored in crashed",
        ),
        (TESTS / "specs/owns/frees_on_failure.yaml", "freed_while_pinned", {}, "job_failed"),
    ],
    ids=["crash-lasso", "family"],
)  # fmt: skip
def test_a_replay_with_a_crash_or_a_family_is_drawn_reproduced(
    system: Path, prop: str, drivers: dict[str, Any], last: str, tmp_path: Path
) -> None:
    """A trace replay that crashed a process (a lasso) or let the engine fire a family's steps reads back as one
    reproduced trace, each move where the replay put it."""
    [found] = [p for p in explore(system).properties if p.name == prop]
    assert found.trace is not None
    out = tmp_path / "replayed.json"
    out.write_text(json.dumps(replay_trace(system, found.trace, drivers).as_dict()))
    page = build_replayed(system, found.trace, out)
    (view,) = page.traces
    assert page.title.endswith("reproduced on the drivers") and not any(s.problem for s in view.snaps)
    assert view.snaps[-1].text.startswith(last)
    states = {(i.role, i.state) for i in view.snaps[-1].instances}
    assert (
        ("prefill", "crashed") in states
        if "crash" in system.name
        else {("request", "sent"), ("job#1", "pinned")} <= states
    )
    assert "<html" in html(page)
