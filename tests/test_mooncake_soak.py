"""Soaks of the Mooncake store worker on the real master with 10% of store calls failing.

The default run is small (a few hundred requests, about a second); the
thousands-of-requests soak is marked ``slow`` (``pytest --run-slow``), and
``python benchmarks/mooncake_soak.py`` reports its figures.
"""

from __future__ import annotations

import pytest
from mooncake_fixtures import mooncake_master_fixture, real_store_fixture  # noqa: F401

from kvfsm.drivers.mooncake import BlockBuffer, EmbeddedMaster, MooncakeStore, connect_embedded
from kvfsm.harness.mooncake import FaultyStore, raising
from kvfsm.showcase.bench.mooncake import HandSendWorker, per_job, soak, throughput


def check_clean(requests: int, store: MooncakeStore) -> None:
    result = soak(store, requests=requests, fault_rate=0.10, seed=requests)
    assert result.requests == requests
    assert sum(result.faults_injected.values()) > 0
    assert result.outcomes.get("send:failed") and result.outcomes.get("send:stored")
    assert result.outcomes.get("load:loaded") and result.outcomes.get("load:failed")
    problems = {
        name: getattr(result, name)
        for name in (
            "leaked_blocks",
            "leaked_holders",
            "hung_requests",
            "hung_loads",
            "reported_twice",
            "unfinished_tasks",
            "over_releases",
            "corrupt_loads",
        )
        if getattr(result, name)
    }
    assert not problems and result.clean, problems


@pytest.mark.mooncake
def test_a_soak_with_ten_percent_faults_leaks_nothing_and_hangs_nothing(real_store: MooncakeStore) -> None:
    check_clean(300, real_store)


@pytest.mark.slow
@pytest.mark.mooncake
def test_a_soak_of_five_thousand_requests_leaks_nothing_and_hangs_nothing(real_store: MooncakeStore) -> None:
    check_clean(5000, real_store)


@pytest.mark.mooncake
def test_the_hand_written_baseline_reports_every_request_too(real_store: MooncakeStore) -> None:
    """The overhead comparison is only fair if the baseline does the same work and releases everything."""
    result = throughput(real_store, requests=100, fault_rate=0.10, repeats=1)
    assert result.all_reported
    assert result.hand_requests_per_s > 0 and result.kvfsm_requests_per_s > 0


def test_per_job_costs_are_measured_on_both_paths() -> None:
    result = per_job(connect_embedded(EmbeddedMaster(), global_segment_size=1 << 30), jobs=50, repeats=1)
    assert result.direct_us > 0 and result.kvfsm_us > 0


def test_the_hand_written_worker_releases_on_failure() -> None:
    store = FaultyStore(connect_embedded(EmbeddedMaster()))
    buffer = BlockBuffer(4, 4096)
    hand = HandSendWorker(store, buffer, prefix="h", start=False)
    store.fail_next("batch_is_exist", raising())
    blocks = buffer.pool.allocate("r", 2)
    job = hand.save_job("r", blocks, ["a", "b"])
    hand.queue.get_nowait()
    hand.run_job(job)
    assert hand.request_finished("r") is False
    assert hand.get_finished() == {"r"}
    buffer.pool.release("r")
    assert buffer.pool.num_free == 4 and hand.failed == 1 and hand.queue.unfinished_tasks == 0
