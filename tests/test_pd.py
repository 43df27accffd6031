"""The PD abort protocol across two processes: the corrected role specs leave a clean ledger, the merged fix corrupts."""

from __future__ import annotations

import ast
import inspect
import queue
from pathlib import Path
from typing import Any

import pytest
from test_driver_binding import constants_outside_docstrings

from kvfsm.harness.pd import JobConfig, run_job
from kvfsm.harness.pd.faults import KINDS
from kvfsm.harness.pd.role import Sends, system


def test_the_sends_come_from_the_verified_role_spec() -> None:
    spec = system("corrected").roles["decode"].spec
    sends = Sends(spec)
    sends("r", 1, "abort", "waiting", "aborting", 0.0)
    sends("r", 1, "abort_ack", "aborting", "aborted", 0.0)
    sends("r", 1, "bootstrapped", "bootstrapping", "waiting", 0.0)
    assert sends.drain() == [("r", "abort_req"), ("r", "metadata")]


def test_the_corrected_protocol_ends_every_request_with_nothing_leaked_hung_or_corrupted_under_every_fault() -> None:
    ledger = run_job(JobConfig(requests=400, concurrency=32, fault_rate=0.15, seed=3))
    assert ledger.errors == [] and ledger.finished == 400
    assert ledger.leaked_blocks == 0 and ledger.hung == 0 and ledger.corrupted == 0 and ledger.listener_deaths == 0
    assert set(ledger.faults_injected) == set(KINDS)
    assert ledger.outcomes.get("received", 0) > 0 and ledger.outcomes.get("aborted", 0) > 0
    assert ledger.prefill_incarnations == 2 and ledger.clean


def test_the_merged_fix_corrupts_pages_of_the_request_that_reused_them() -> None:
    ledger = run_job(JobConfig(requests=600, concurrency=32, fault_rate=0.2, seed=4, protocol="merged_fix"))
    assert ledger.errors == [] and ledger.finished == 600
    assert ledger.corrupted > 0 and not ledger.clean
    assert ledger.leaked_blocks == 0 and ledger.hung == 0  # what breaks is the bytes, not the bookkeeping


def test_a_killed_prefill_strands_no_request_every_one_ends_with_its_pages_released() -> None:
    ledger = run_job(JobConfig(requests=300, concurrency=64, fault_rate=0.0, seed=5), kill_prefill=True)
    assert ledger.prefill_incarnations == 2 and ledger.faults_injected == {"kill": 1}
    assert ledger.finished == 300 and ledger.hung == 0 and ledger.leaked_blocks == 0 and ledger.corrupted == 0


@pytest.mark.slow
def test_concurrency_512_with_ten_percent_faults_leaves_a_clean_ledger() -> None:
    ledger = run_job(JobConfig(requests=10_000, concurrency=512, fault_rate=0.1, seed=6, deadline=300.0))
    assert ledger.clean, ledger.as_dict()


@pytest.mark.slow
def test_an_abort_storm_leaves_a_clean_ledger() -> None:
    ledger = run_job(JobConfig(requests=3000, concurrency=256, fault_rate=0.5, seed=7, deadline=300.0))
    assert ledger.faults_injected["abort"] > 1000 and ledger.clean, ledger.as_dict()


@pytest.mark.mooncake
def test_over_the_mooncake_transfer_engine_the_corrected_protocol_leaves_a_clean_ledger() -> None:
    pytest.importorskip("mooncake.engine", reason="Mooncake TransferEngine wheel cannot import here")
    ledger = run_job(JobConfig(requests=300, concurrency=32, fault_rate=0.1, seed=8, backend="real"))
    assert ledger.errors == [] and ledger.clean, ledger.as_dict()
    assert ledger.outcomes.get("received", 0) > 0  # pages that went over the engine and were byte-checked


def test_the_deadline_bounds_a_stall_not_the_jobs_length() -> None:
    """A job that runs far longer than ``deadline`` while requests keep ending is not cut off (demo --requests 20000)."""
    ledger = run_job(JobConfig(requests=400, concurrency=8, fault_rate=0.0, seed=9, deadline=1.0), kill_prefill=False)
    assert ledger.seconds > 1.0, "the job must outlast its deadline for this test to mean anything"
    assert ledger.finished == 400 and ledger.hung == 0 and ledger.clean, ledger.as_dict()


def _decode(protocol: str) -> Any:
    """A decode role in this process, with no prefill: messages are handed to it by the test."""
    from kvfsm.harness.pd.decode import Decode
    from kvfsm.harness.pd.job import free_port

    config = JobConfig(
        requests=1, concurrency=1, fault_rate=0.0, protocol=protocol, decode_port=free_port(), prefill_port=free_port()
    )
    return Decode(config, queue.Queue())  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", ["corrected", "merged_fix"])
def test_the_decode_request_takes_the_pages_from_the_room_the_tracker_ends_in_success(protocol: str) -> None:
    decode = _decode(protocol)
    try:
        decode.tracker.begin(0)
        decode.fire(0, "bootstrapped")
        pages = decode.driver.pages(0)
        decode.pages.fill(0, pages)  # prefill's writes have landed
        decode._deliver(0, "success", now=0.0)
        assert decode.pool.holdings() == {("decoding", 0): tuple(sorted(pages))}  # the room let go, decoding holds
        decode._finish(now=0.0)
        assert decode.report.empty()  # a room that succeeded is reported when its decode request ends
        decode._end_decoding(now=1e9)
        _, room, outcome, _, bad = decode.report.get_nowait()
        assert (room, outcome, bad) == (0, "received", 0) and decode.pool.holdings() == {}
    finally:
        decode.close()


def test_a_status_that_ends_an_aborting_room_starts_no_decode_request() -> None:
    decode = _decode("corrected")
    try:
        decode.tracker.begin(0)
        decode.fire(0, "bootstrapped")
        decode.fire(0, "abort")
        decode._deliver(0, "success", now=0.0)  # prefill finished its writes before the ABORT: the room ends aborted
        assert decode.decoding == [] and decode.pool.holdings() == {}
        decode._finish(now=0.0)
        assert decode.report.get_nowait()[1:3] == (0, "aborted")
    finally:
        decode.close()


def test_the_decode_process_names_no_state_of_its_specs_and_reads_no_transition_table() -> None:
    """It asks the Tracker (accepts, state) and each state's declared outcome; a copy of the spec's names or its
    table would be a second lifecycle written by hand."""
    import kvfsm.harness.pd.decode as decode

    states = {s for protocol in ("corrected", "merged_fix") for s in system(protocol).roles["decode"].spec.states}
    assert constants_outside_docstrings(decode) & states == set()
    source = ast.parse(Path(inspect.getfile(decode)).read_text())
    assert [n.lineno for n in ast.walk(source) if isinstance(n, ast.Attribute) and n.attr == "table"] == []
