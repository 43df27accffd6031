"""Soaks in the scheduler simulator: thousands of requests under eviction pressure, preemptions, aborts and faults.

Every run ends with each CPU and GPU block's ref count back at baseline, no
live instance, every loaded block holding the bytes its prefix hash names,
and none of the checks vLLM's scheduler makes with ``assert`` failing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.adapters.vllm_cpu_offload import CpuOffloadScheduler
from kvfsm.drivers.cpu_offload import StoreDriver
from kvfsm.showcase.sim import SimConfig, SimReport, Simulation, Workload, simulate


def assert_clean(report: SimReport) -> None:
    assert report.assertion_failures == [], report.summary()
    assert report.leaked_cpu_refs == {} and report.leaked_gpu_refs == {}, report.summary()
    assert report.live_instances == 0 and report.unfinished_requests == 0, report.summary()
    assert report.stale_blocks == 0 and report.cpu_cache_mismatches == 0, report.summary()
    assert report.clean


def test_soak_ends_clean_with_the_acceptance_mix_of_preemptions_and_aborts_mid_load() -> None:
    report = simulate(Workload(num_requests=5000, seed=7), SimConfig(check_every=5))
    assert_clean(report)
    assert report.preempted_fraction >= 0.05, report.summary()
    assert report.aborted_mid_load_fraction >= 0.05, report.summary()
    # The run exercised what it claims to: hits, byte-checked loads, eviction, every fault.
    c = report.connector
    assert report.loads_checked > 500 and report.cpu_evictions > 1000
    assert c.retries > 0 and report.alloc_failures_after_hit > 0
    assert (
        report.loads_recomputed > 0
        and c.expired > 0
        and report.anomalies["unknown"] + report.anomalies.get("late", 0) > 0
    )
    assert report.duplicated_outputs > 0 and report.late_outputs > 0


def test_same_seed_same_run() -> None:
    def figures(r: SimReport) -> dict[str, Any]:
        out = dataclasses.asdict(r)
        del out["wall_seconds"]
        return out

    small = Workload(num_requests=200, seed=5)
    assert figures(simulate(small)) == figures(simulate(small))


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    gpu=st.sampled_from([48, 96, 128]),
    cpu=st.sampled_from([32, 64, 256]),
    preempt=st.sampled_from([0.0, 0.02]),
)
def test_small_runs_end_clean_whatever_the_pressure(seed: int, gpu: int, cpu: int, preempt: float) -> None:
    cfg = SimConfig(num_gpu_blocks=gpu, num_cpu_blocks=cpu, preempt_rate=preempt, check_every=1, max_num_seqs=16)
    assert_clean(simulate(Workload(num_requests=120, seed=seed, prefix_len=(16, 96)), cfg))


class UnheldStoreDriver(StoreDriver):
    """Seed-#52360's bug: the store trusts the request's GPU blocks to outlive the copy, without a reference."""

    def hold_gpu_src(self, key: Hashable, /, gpu_blocks: Sequence[int], hashes: Sequence[Hashable]) -> None:
        self._src[key] = list(gpu_blocks)

    def free_gpu_src(self, key: Hashable, /) -> None:
        self._src.pop(key)


def test_the_byte_checks_catch_a_store_that_reads_reused_blocks() -> None:
    sim = Simulation(Workload(num_requests=400, seed=1), SimConfig(check_every=10**9))
    sim.offload.store = UnheldStoreDriver(sim.offload.cpu_pool, sim.gpu_pool)
    sim.connector = CpuOffloadScheduler(
        sim.offload, clock=lambda: sim.step_no * sim.config.step_seconds, load_timeout=1.0, store_timeout=1.0
    )
    report = sim.run()
    assert report.stale_blocks + report.cpu_cache_mismatches > 0, report.summary()
    assert not report.clean


@pytest.mark.slow
def test_long_soak_ends_clean() -> None:
    report = simulate(
        Workload(num_requests=30_000, seed=11, arrival_rate=0.6),
        SimConfig(num_gpu_blocks=192, num_cpu_blocks=512, max_num_seqs=48, check_every=50),
    )
    assert_clean(report)
    assert report.preempted_fraction >= 0.05 and report.aborted_mid_load_fraction >= 0.05, report.summary()
