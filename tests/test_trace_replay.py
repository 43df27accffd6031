"""Explorer traces replayed on real trackers and on the PD loopback's drivers over real KV tensors."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from buggy_drivers import frees_only_on_ack, never_takes_pages

from kvfsm.drivers import pd_loopback
from kvfsm.drivers.pd_loopback import DecodeDriver, PDLoopback, PrefillDriver, pattern
from kvfsm.errors import BindingError, KvfsmError
from kvfsm.explore import Trace, TraceError, explore
from kvfsm.spec import load
from kvfsm.testing import DriverFactory, run
from kvfsm.testing.ledger import LedgerDriver, LedgerError
from kvfsm.testing.trace_replay import TraceRun, replay_trace
from kvfsm.testing.trace_set import trace_set

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
PD = ROOT / "specs" / "pd_abort"
MERGED, CORRECTED = PD / "merged_fix.yaml", PD / "corrected.yaml"


@pytest.fixture(scope="module")
def write_after_free() -> Trace:
    """The explorer's shortest write_after_free trace of the merged fix."""
    found = next(p for p in explore(MERGED).properties if p.name == "write_after_free")
    assert found.trace is not None
    return found.trace


def loopback(replay: TraceRun) -> PDLoopback:
    decode = replay.drivers["decode"]
    assert isinstance(decode, DecodeDriver)
    return decode.loop


# -- the drivers on their own ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["decode_merged_fix.yaml", "decode_corrected.yaml"])
def test_the_loopback_decode_driver_keeps_to_its_specs_under_model_based_tests(spec: str) -> None:
    report = run(PD / spec, pd_loopback.factories()["decode"], examples=50, seed=0)
    assert report.passed, report.story or report.error


# -- the merged fix's race, on real tensors ----------------------------------------------------


def test_write_after_free_is_reproduced_on_the_pd_loopback(write_after_free: Trace) -> None:
    replay = TraceRun(MERGED, write_after_free, pd_loopback.factories())
    result = replay.run()
    assert result.verdict == "reproduced" and result.mismatch is None
    assert (
        result.summary
        == "step 4: prefill is in transferring while decode lacks kv_pages — reproduced on the real drivers"
    )
    loop = loopback(replay)
    [write] = loop.writes
    assert write.room == "r0" and write.dst == loop.metadata["r0"].pages
    # The pages prefill wrote into are back in decode's free pool, carrying r0's KV.
    assert all(loop.decode_pool.ref_cnt[p] == 0 for p in write.dst)
    assert loop.decode_pool.num_free == loop.decode_pool.num_blocks
    assert loop.page_values(write.dst) == {pattern("r0")}
    loop.check()


def test_the_next_request_that_takes_the_freed_pages_has_its_kv_overwritten(write_after_free: Trace) -> None:
    replay = TraceRun(MERGED, write_after_free, pd_loopback.factories(decode_pages=2))
    loop = loopback(replay)
    while (done := replay.step()) is not None and done.number != 2:  # up to decode's abort, which frees at once
        pass
    sent = loop.metadata["r0"].pages
    decode = replay.trackers["decode"]
    decode.begin("next")
    decode.fire("next", "bootstrapped")  # the pool has only r0's freed pages to give
    assert loop.decode.pages("next") == list(sent)
    loop.decode_cache.storage[list(sent)] = 7.0  # next's own KV lands in its pages
    result = replay.run()  # prefill r0 gets the old indices and writes
    assert result.reproduced
    assert loop.decode.observe("next") == {"kv_pages"}
    assert loop.page_values(sent) == {pattern("r0")} != {7.0}
    loop.check()


# -- the corrected protocol: the pages stay held until prefill has stopped writing ---------------


def step(role: str, event: str, source: str, target: str, *, holds: Iterable[str] = (), **how: Any) -> dict[str, Any]:
    """One step of a hand-built trace of r0; ``how`` may set cause, action, sent (names) and lost (names)."""
    peer = "decode" if role == "prefill" else "prefill"
    sent, lost = how.pop("sent", ()), how.pop("lost", ())
    return {
        "request": "r0",
        "role": role,
        "action": how.pop("action", "fire"),
        "cause": how.pop("cause", "local"),
        "event": event,
        "from": source,
        "to": target,
        "sent": [{"message": m, "to": peer, "lost": m in lost} for m in sent],
        "holds": list(holds),
        **how,
    }


def trace_doc(path: Path, steps: list[dict[str, Any]], requests: Iterable[str] = ("r0",)) -> dict[str, Any]:
    begins = [
        {"request": r, "role": role, "action": "begin", "cause": "begin", "event": None, "from": None}
        | {"to": "bootstrapping", "holds": []}
        for r in requests
        for role in ("prefill", "decode")
    ]
    roles = {role: {"spec": f"{role}.yaml", "machine": role, "key": "room"} for role in ("prefill", "decode")}
    return {
        "format": "kvfsm-trace/1",
        "system": path.stem,
        "path": str(path),
        "property": "write_after_free",
        "violation": "prefill is in transferring or draining while decode lacks kv_pages",
        "request": "r0",
        "roles": roles,
        "steps": begins + steps,
    }


PAGES = ["kv_pages"]
SRC = ["src_pages"]
ABORTED_BEFORE_ANY_WRITE = [
    step("decode", "bootstrapped", "bootstrapping", "waiting", holds=PAGES, sent=["metadata"]),
    step("decode", "abort", "waiting", "aborting", holds=PAGES, cause="abort", sent=["abort_req"]),
    step("prefill", "abort_req", "bootstrapping", "failed", cause="message", sent=["abort_ack"]),
    step("decode", "abort_ack", "aborting", "aborted", cause="message"),
    step("prefill", "metadata", "failed", "failed", cause="message", action="ignore"),
]
ABORT_DUPLICATED_AND_ANSWERED_BY_THE_SERVER = [
    step("decode", "bootstrapped", "bootstrapping", "waiting", holds=PAGES, sent=["metadata"], lost=["metadata"]),
    step("decode", "abort", "waiting", "aborting", holds=PAGES, cause="abort", sent=["abort_req"]),
    step("prefill", "abort_req", "bootstrapping", "failed", cause="message", sent=["abort_ack"], duplicate=True),
    step("prefill", "abort_req", "failed", "failed", cause="message", action="reply", sent=["abort_ack"]),
    step("decode", "abort_ack", "aborting", "aborted", cause="message"),
    step("decode", "abort_ack", "aborted", "aborted", cause="message", action="ignore"),
]
ABORTED_MID_TRANSFER = [  # the merged fix's race schedule, on the corrected roles
    step("decode", "bootstrapped", "bootstrapping", "waiting", holds=PAGES, sent=["metadata"]),
    step("decode", "abort", "waiting", "aborting", holds=PAGES, cause="abort", sent=["abort_req"]),
    step("prefill", "metadata", "bootstrapping", "waiting_input", holds=SRC, cause="message"),
    step("prefill", "forward_done", "waiting_input", "transferring", holds=SRC),
    step("prefill", "abort_req", "transferring", "draining", holds=SRC, cause="message"),
    step("prefill", "drained", "draining", "failed", cause="timeout", sent=["failure"]),
    step("decode", "failure", "aborting", "aborted", cause="message"),
]


@pytest.mark.parametrize(
    ("steps", "freed_by", "writes"),
    [
        pytest.param(ABORTED_BEFORE_ANY_WRITE, "abort_ack", 0, id="abort-before-any-write"),
        pytest.param(ABORTED_MID_TRANSFER, "failure", 1, id="abort-mid-transfer"),
        pytest.param(ABORT_DUPLICATED_AND_ANSWERED_BY_THE_SERVER, "abort_ack", 0, id="duplicate-abort-replied"),
    ],
)
def test_corrected_decode_keeps_its_pages_until_prefill_has_stopped_writing(
    steps: list[dict[str, Any]], freed_by: str, writes: int
) -> None:
    replay = TraceRun(CORRECTED, trace_doc(CORRECTED, steps), pd_loopback.factories())
    loop = loopback(replay)
    held: list[int] = []
    freed = False
    for done in replay:
        assert done.mismatch is None, done.mismatch
        if done.step.event == "bootstrapped":
            held = loop.decode.pages("r0")
        freed = freed or done.step.event == freed_by
        if freed:
            assert loop.decode.observe("r0") == set() and all(loop.decode_pool.ref_cnt[p] == 0 for p in held)
        elif held:
            assert loop.decode.observe("r0") == {"kv_pages"} and loop.decode.pages("r0") == held
            assert all(loop.decode_pool.ref_cnt[p] == 1 for p in held)
    assert freed
    result = replay.result()
    assert result.verdict == "not reproduced" and "write_after_free did not show" in result.summary
    assert [w.dst for w in loop.writes] == [tuple(held)] * writes  # a write lands only while decode holds the pages
    loop.check()


def test_a_reply_step_calls_no_tracker() -> None:
    result = replay_trace(CORRECTED, trace_doc(CORRECTED, ABORT_DUPLICATED_AND_ANSWERED_BY_THE_SERVER))
    reply = next(s for s in result.steps if s.step.action == "reply")
    assert reply.mismatch is None and reply.state == "failed"
    assert reply.call == "none (the server answers with abort_ack)"


def test_a_timeout_step_lets_the_deadline_pass_and_polls() -> None:
    replay = TraceRun(CORRECTED, trace_doc(CORRECTED, ABORTED_MID_TRANSFER), pd_loopback.factories())
    drained = next(d for d in replay if d.step.event == "drained")
    assert drained.call == "poll at t=30"  # prefill's transfer_timeout, on prefill's own clock
    assert replay.clocks["prefill"].now == 30.0 and replay.clocks["decode"].now == 0.0


def test_a_timeout_another_instance_would_beat_is_fired_directly() -> None:
    expire = step("decode", "expire", "bootstrapping", "expired", cause="timeout")
    doc = trace_doc(CORRECTED, [expire], requests=("r0", "r1"))
    result = replay_trace(CORRECTED, doc)
    [done] = [s for s in result.steps if s.number == 1]
    assert done.mismatch is None and done.state == "expired"
    assert done.call == "fire (r1 would fall due first)"  # both were armed at t=0 for the same bootstrap_timeout


# -- drivers with a bug diverge where the bug shows --------------------------------------------


@pytest.mark.parametrize(
    ("factory", "number", "what", "actual"),
    [
        pytest.param(never_takes_pages, 1, "observe", "NeverTakesPages.observe says nothing", id="never-takes"),
        pytest.param(frees_only_on_ack, 2, "observe", "FreesOnlyOnAck.observe says kv_pages", id="frees-on-ack"),
        pytest.param(
            pd_loopback.factories(decode_pages=1)["decode"],
            1,
            "raised",
            "ActionError: send_metadata() raised NoFreeBlocks",
            id="pool-too-small",
        ),
    ],
)
def test_a_buggy_decode_driver_diverges_at_the_step_its_bug_shows(
    write_after_free: Trace, factory: DriverFactory, number: int, what: str, actual: str
) -> None:
    result = replay_trace(MERGED, write_after_free, {"decode": factory})
    assert result.verdict == "diverged" and not result.reproduced
    assert result.mismatch is not None
    assert (result.mismatch.label, result.mismatch.what) == (f"step {number}", what)
    assert result.mismatch.actual.startswith(actual)
    assert result.steps[-1].number == number  # the replay stops at the first mismatch
    assert result.summary.startswith(f"diverged at step {number}: {what}: expected ")


def test_the_trace_must_match_the_roles_it_runs_on(write_after_free: Trace) -> None:
    """The merged fix's trace on the corrected roles: decode keeps its pages, so step 2 goes elsewhere."""
    result = replay_trace(CORRECTED, {**write_after_free.as_dict(), "system": "pd_abort_corrected"})
    assert result.mismatch is not None
    assert str(result.mismatch) == "step 2: state: expected 'aborted', got 'aborting'"


def test_the_ledger_driver_stands_in_for_roles_without_a_driver(write_after_free: Trace) -> None:
    replay = TraceRun(MERGED, write_after_free, {"decode": pd_loopback.factories()["decode"]})
    result = replay.run()
    assert result.drivers == {"prefill": "ledger (built in)", "decode": "DecodeDriver"}
    assert result.summary.endswith("reproduced on the real decode driver (ledger for prefill)")
    prefill = replay.drivers["prefill"]
    assert isinstance(prefill, LedgerDriver) and prefill.observe("r0") == {"src_pages": 1}
    assert prefill.calls == [("send_kv", "r0")]


def test_the_ledger_refuses_a_release_of_what_is_not_held() -> None:
    ledger = LedgerDriver(load(PD / "decode_merged_fix.yaml"))
    ledger.alloc_kv_pages("r0")
    ledger.release_kv_cache("r0")
    assert ledger.observe("r0") == {}
    with pytest.raises(LedgerError, match=r"release_kv_cache\('r0'\) releases kv_pages, which 'r0' does not hold"):
        ledger.release_kv_cache("r0")


# -- what is refused before anything runs --------------------------------------------------------


def edit(trace: Trace, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    doc = copy.deepcopy(trace.as_dict())
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param(lambda d: d.update(format="kvfsm-trace/2"), "format: not a kvfsm-trace/1 trace", id="format"),
        pytest.param(lambda d: d.pop("property"), "property: missing", id="no-property"),
        pytest.param(lambda d: d["steps"][2].pop("to"), "steps[2].to: missing", id="no-to"),
        pytest.param(lambda d: d["steps"][2].update(holds="kv_pages"), "steps[2].holds: must be a list", id="holds"),
        pytest.param(lambda d: d["steps"][3].update(action="jump"), "steps[3].action: 'jump' is not one of", id="act"),
        pytest.param(
            lambda d: d["steps"][2].update(role="router"),
            "steps[2].role: pd_abort_merged_fix has no role 'router'",
            id="role",
        ),
        pytest.param(
            lambda d: d["steps"][2].update(event="teleport"), "steps[2].event: decode has no event 'teleport'", id="ev"
        ),
        pytest.param(
            lambda d: d["steps"][2].update(to="nowhere"), "steps[2].to: decode has no state 'nowhere'", id="state"
        ),
        pytest.param(
            lambda d: d["steps"][4].update(request="r7"),
            "steps[4].request: r7 was never begun on prefill before this step",
            id="request",
        ),
        pytest.param(
            lambda d: d["steps"][2]["sent"][0].update(lost=True),
            "steps[4].event: delivers metadata to prefill for r0, but none is in flight",
            id="lost-message",
        ),
        pytest.param(
            lambda d: d.update(property="served_but_failed"),
            "property: 'served_but_failed' is not a property of pd_abort_merged_fix",
            id="property",
        ),
    ],
)
def test_a_malformed_trace_is_refused_naming_the_field(
    write_after_free: Trace, change: Callable[[dict[str, Any]], None], says: str
) -> None:
    with pytest.raises(TraceError) as caught:
        replay_trace(MERGED, edit(write_after_free, change))
    assert str(caught.value).startswith(says)


def test_a_trace_file_that_is_not_json_is_refused_with_its_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text('{"format": "kvfsm-trace/1",\n "steps": [}\n')
    with pytest.raises(TraceError, match=r"t\.json: line 2 column 12: not JSON"):
        replay_trace(MERGED, bad)


def test_drivers_are_checked_before_anything_runs(write_after_free: Trace) -> None:
    with pytest.raises(KvfsmError, match="no role 'router' in pd_abort_merged_fix"):
        replay_trace(MERGED, write_after_free, {"router": pd_loopback.factories()["decode"]})
    with pytest.raises(BindingError, match="give driver PrefillWithoutHook a before_fire"):
        replay_trace(MERGED, write_after_free, {"prefill": lambda: PrefillWithoutHook(PDLoopback())})


class PrefillWithoutHook(PrefillDriver):
    """Cannot take its own pages when decode's indices arrive: nothing would show src_pages as held."""

    before_fire = None  # type: ignore[assignment]


# -- the command line ------------------------------------------------------------------------------


def kvfsm(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_cli_explore_then_replay_on_the_pd_loopback(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    assert kvfsm("explore", str(MERGED), "--trace", str(trace)).returncode == 1
    decode = "decode=kvfsm.drivers.pd_loopback:decode"
    result = kvfsm("test", str(MERGED), "--trace", str(trace), "--driver", decode, "--format", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["verdict"] == "reproduced" and doc["mismatch"] is None
    assert doc["drivers"] == {
        "prefill": "ledger (built in)",
        "decode": "DecodeDriver (kvfsm.drivers.pd_loopback:decode)",
    }
    assert [s["observed"] for s in doc["steps"] if s["step"]["role"] == "decode"] == [[], ["kv_pages"], []]


def test_cli_a_buggy_driver_exits_one_naming_the_step(write_after_free: Trace, tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(write_after_free.as_dict()))
    decode = "decode=buggy_drivers:frees_only_on_ack"
    result = kvfsm("test", str(MERGED), "--trace", str(trace), "--driver", decode, cwd=TESTS)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "✗ the drivers diverged from the trace at step 2: observe: expected nothing, got FreesOnlyOnAck" in (
        result.stdout
    )


@pytest.mark.parametrize(
    ("spec", "args", "says"),
    [
        pytest.param(MERGED, ["--driver", "kvfsm.drivers.pd_loopback:decode"], "names no role", id="no-role"),
        pytest.param(
            MERGED, ["--driver", "router=kvfsm.drivers.pd_loopback:decode"], "has no role 'router'", id="role"
        ),
        pytest.param(MERGED, ["--seed", "3"], "--seed does not apply to --trace", id="seed"),
        pytest.param(PD / "decode_merged_fix.yaml", [], "must be a system file", id="machine-spec"),
        pytest.param(MERGED, ["--malformed"], "steps[2].event: decode has no event 'teleport'", id="malformed"),
    ],
)
def test_cli_usage_errors_exit_two_without_a_traceback(
    write_after_free: Trace, tmp_path: Path, spec: Path, args: list[str], says: str
) -> None:
    trace = tmp_path / "t.json"
    if args == ["--malformed"]:
        args = []
        trace.write_text(json.dumps(edit(write_after_free, lambda d: d["steps"][2].update(event="teleport"))))
    else:
        trace.write_text(json.dumps(write_after_free.as_dict()))
    result = kvfsm("test", str(spec), "--trace", str(trace), *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert says in " ".join(result.stderr.split()) and "Traceback" not in result.stderr


# -- a role's process dies ------------------------------------------------------------------------

CRASHES = ROOT / "specs" / "explore" / "pd_prefill_crash.yaml"


def crash_in(state: str) -> Trace:
    """The trace set's run in which the prefill's process dies in ``state``."""
    return next(t for t in trace_set(CRASHES).traces if any(s.cause == "crash" and s.source == state for s in t.steps))


def test_a_crash_drops_the_prefills_tracker_and_driver_as_they_are_and_a_new_pair_stands_in() -> None:
    trace = crash_in("transferring")
    replay = TraceRun(CRASHES, trace, pd_loopback.factories())
    before: dict[str, object] = {}
    for done in replay:
        assert done.mismatch is None, done.mismatch
        if done.step.cause == "crash":
            assert replay.drivers["prefill"] is not before["prefill"]
            assert replay.trackers["prefill"].state("r0") is None and done.state == "crashed"
            assert done.observed == ()
            dead = before["prefill"]
            assert isinstance(dead, PrefillDriver) and dead.observe("r0") == {"src_pages"}  # lost with it, not freed
        before = dict(replay.drivers)
    assert len(replay.done) == len(trace.steps)  # every step matched (a trace set's run breaks no property)
    assert replay.drivers["decode"].observe("r0") == {"kv_pages"}  # decode's own deadlines and messages end it


def test_a_crash_with_another_request_live_in_the_process_is_a_mismatch() -> None:
    trace = crash_in("bootstrapping")
    other = [dataclasses.replace(s, request="r1") for s in trace.steps if s.action == "begin"]
    replay = TraceRun(CRASHES, dataclasses.replace(trace, steps=tuple(other) + trace.steps), pd_loopback.factories())
    mismatch = replay.run().mismatch
    assert mismatch is not None and mismatch.what == "crash"
    assert mismatch.actual == "r1 live there too: a real crash loses them all"


def test_a_lasso_after_a_crash_is_reproduced_when_its_cycle_comes_back_on_the_real_drivers() -> None:
    system = CRASHES.with_name("pd_prefill_crash_no_restart.yaml")
    [final] = [p for p in explore(system).properties if p.name == "final"]
    assert final.trace is not None and final.trace.loop is not None
    result = TraceRun(system, final.trace, pd_loopback.factories()).run()
    assert result.verdict == "reproduced", result.summary
    assert "the cycle came back to where it began: decode in aborting" in result.summary


# -- a family (owns:) ---------------------------------------------------------------------------------

OWNS = TESTS / "specs" / "owns"


def test_a_request_that_frees_at_its_first_failed_job_is_reproduced_the_engine_firing_job_failed() -> None:
    """The explorer's 3 moves: the request finishes, one job fails, and the engine fires ``job_failed`` on the
    request (a step of cause ``owner``), which frees while two jobs still pin: the same happens in the real
    trackers, the children's tracker attached to the request's."""
    system = OWNS / "frees_on_failure.yaml"
    [prop] = [p for p in explore(system).properties if p.name == "freed_while_pinned"]
    assert prop.trace is not None
    replay = TraceRun(system, prop.trace)
    result = replay.run()
    assert result.verdict == "reproduced", result.summary
    assert result.summary.endswith(
        "request is in sent while job#1 is in pinned — reproduced on real trackers with ledger drivers"
    )
    assert replay.trackers["job#0"] is replay.trackers["job#2"]  # one tracker for the ranks of the child role
    assert replay.trackers["job#1"].state("r0#1") == "pinned" and replay.trackers["request"].state("r0") == "sent"


def test_a_parent_role_with_ranks_is_refused_before_any_driver_is_made(tmp_path: Path) -> None:
    text = (OWNS / "frees_on_failure.yaml").read_text()
    specs = str(OWNS.resolve()) + "/"
    ranked = text.replace("spec: ", f"spec: {specs}").replace("request: {spec:", "request: {ranks: 2, spec:")
    (tmp_path / "s.yaml").write_text(ranked)
    [prop] = [p for p in explore(OWNS / "frees_on_failure.yaml").properties if p.name == "freed_while_pinned"]
    with pytest.raises(TraceError, match=r"owns instances of another machine \(owns:\) and has ranks"):
        TraceRun(tmp_path / "s.yaml", prop.trace)
