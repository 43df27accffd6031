"""The PD abort protocol across two processes: the corrected role specs leave a clean ledger, the merged fix corrupts."""

from __future__ import annotations

import pytest

from kvfsm.drivers.pd import JobConfig, run_job
from kvfsm.drivers.pd.faults import KINDS
from kvfsm.drivers.pd.role import Sends, system


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
