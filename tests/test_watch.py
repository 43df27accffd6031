"""kvfsm watch without vLLM: the Watch fed as the wrapping connector feeds it, on a clock the test moves."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from kvfsm.adapters.watch import LOAD_SPEC, SEND_SPEC, Watch, WatchSettings
from kvfsm.replay import check_log
from kvfsm.spec import load


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watch(clock: Clock, **settings: object) -> Watch:
    base: dict[str, object] = {"slow_after": 2.0, "send_timeout": 5.0, "load_timeout": 5.0, "check_every": 0.0}
    return Watch(WatchSettings.of({**base, **settings}), connector="Test", clock=clock)


def test_a_hold_never_sent_is_slow_then_dead_and_a_late_send_still_ends_it(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    w = watch(clock)
    w.finished("r1", ([4, 5, 6],), delay_free=True)
    w.finished("r2", ([7],), delay_free=True)
    w.finished("r3", ([8],), delay_free=False)  # not held: nothing to watch
    clock.now = 1.0
    w.output(["r2"], None, set())
    w.step()
    assert w.send.state("r1") == "held" and w.send.state("r3") is None
    clock.now = 2.5
    with caplog.at_level(logging.WARNING, logger="kvfsm.watch"):
        w.step()
        clock.now = 5.0
        w.step()
    slow, dead = w.reports
    assert (slow.verdict, slow.state, slow.request, slow.blocks) == ("slow", "held", "r1", 3)
    assert (dead.verdict, dead.state, dead.holds) == ("dead", "overdue", ("gpu_blocks",))
    assert dead.age == pytest.approx(5.0)
    assert "DEAD: request 'r1' in 'overdue' 5.0 s after request_finished(delay_free=True)" in caplog.text
    assert "holding gpu_blocks (3 blocks)" in caplog.text
    clock.now = 7.0
    w.output(["r1"], None, set())  # the connector's own reaper, say: the watch never ended it, this does
    summary = w.summary()
    assert summary["outcomes"] == {"vllm_send:sent": 1, "vllm_send:sent_late": 1}
    assert summary["held"] == 0 and summary["live"] == {"vllm_send": {}, "vllm_load": {}}


def test_an_async_load_with_invalid_blocks_or_an_abort_waits_for_finished_recving() -> None:
    clock = Clock()
    w = watch(clock)
    for rid in ("a", "b", "c", "d"):
        w.matched(rid, 64, True)
    w.matched("a", 64, True)  # asked again (allocation failed last step): same load
    w.matched("e", 0, False)  # no load: nothing begun
    w.allocated("a", ([1, 2],), 64)
    w.allocated("b", ([3, 4],), 64)
    w.allocated("c", ([5],), 0)  # phase B with no external tokens
    w.finished("d", ([],), delay_free=False)  # aborted between the phases
    w.output(None, None, {4})
    assert w.load.state("b") == "invalid"
    w.finished("a", ([1, 2],), delay_free=False)  # aborted while loading: vLLM keeps the blocks
    assert w.load.state("a") == "abandoned" and w.load.held("a") == ("gpu_blocks",)
    w.output(None, ["a", "b"], set())
    w.step()
    assert w.summary()["outcomes"] == {
        "vllm_load:dropped": 2,
        "vllm_load:recomputed": 1,
        "vllm_load:skipped": 1,
    }
    assert w.load.state("e") is None


def test_a_report_the_contract_does_not_allow_is_counted_not_raised() -> None:
    w = watch(Clock())
    w.matched("x", 32, True)
    w.output(None, ["x"], set())  # finished_recving before update_state_after_alloc
    assert w.violations == {"vllm_load:recved": 1}
    w.output(["nobody"], None, set())  # an id no hold has
    assert w.send.counts["unknown"] == 1


def test_hashed_ids_and_sampling() -> None:
    clock = Clock()
    w = watch(clock, hash_ids=True, sample=0.5)
    ids = [f"req-{i}" for i in range(200)]
    for rid in ids:
        w.finished(rid, ([1],), delay_free=True)
    live = w.send.census()["held"]
    assert 60 < live < 140  # about half, chosen by a hash of the id
    assert all(len(str(k)) == 16 and not str(k).startswith("req") for k, _ in _live(w))
    w.output(ids, None, set())  # the same ids pick the same requests: every one watched ends, none is unknown
    assert w.send.census()["held"] == 0 and w.send.counts["unknown"] == 0


def _live(w: Watch) -> list[tuple[object, str]]:
    return [(k, s) for k, s in ((k, w.send.state(k)) for k in list(w.send._live)) if s]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown setting"):
        WatchSettings.of({"send_timout": 3})
    with pytest.raises(ValueError, match="must exceed slow_after"):
        WatchSettings.of({"slow_after": 10, "send_timeout": 5})
    with pytest.raises(ValueError, match="sample"):
        WatchSettings.of({"sample": 0})


def test_the_journal_replays_clean(tmp_path: Path) -> None:
    clock = Clock()
    w = watch(clock, journal=str(tmp_path))
    w.finished("r1", ([1],), delay_free=True)
    w.finished("r2", ([2],), delay_free=True)
    w.matched("l1", 32, True)
    w.allocated("l1", ([3],), 32)
    clock.now = 1.0
    w.output(["r1"], ["l1"], set())
    clock.now = 6.0
    w.step()  # r2 overdue
    clock.now = 7.0
    w.output(["r2"], None, set())
    w.close()
    logs = {p.name.split("-")[0]: p for p in tmp_path.glob("*.jsonl")}
    assert set(logs) == {"vllm_send", "vllm_load"}
    params = {"slow_after": 2.0, "send_timeout": 5.0, "load_timeout": 5.0, "remind_after": 300.0}
    for machine, spec in (("vllm_send", SEND_SPEC), ("vllm_load", LOAD_SPEC)):
        model = load(spec)
        report = check_log(model, logs[machine], params={k: v for k, v in params.items() if k in model.params})
        assert not report.findings, [str(f) for f in report.findings]
        assert report.instances == {"vllm_send": 2, "vllm_load": 1}[machine] and report.live == 0


def test_the_watch_imports_without_vllm_and_the_connector_says_how_to_get_it() -> None:
    script = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvfsm.adapters.watch\n"
        "import kvfsm.adapters.vllm as m\n"
        "try:\n    m.WatchConnector\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "WatchConnector is a vLLM connector" in out


def test_the_debug_endpoint_serves_both_trackers_and_closes_with_the_watch() -> None:
    import urllib.request

    clock = Clock()
    w = watch(clock, debug_port=0)
    try:
        w.finished("r1", ([1, 2],), delay_free=True)
        clock.now = 6.0
        w.step()
        with urllib.request.urlopen(w.server.url + "/state?limit=5", timeout=10) as answer:
            state = json.loads(answer.read())
        overdue = state["trackers"]["vllm_send"]["states"]["overdue"]
        assert overdue["count"] == 1 and overdue["oldest"][0]["key"] == "r1"
        assert "vllm_load" in state["trackers"]
    finally:
        w.close()
    assert w.server.counts is not None
