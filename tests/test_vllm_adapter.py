"""The vLLM-shaped CPU-offload connector: vLLM's return conventions, and every way a pin or a load can end."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from kvfsm.adapters.vllm_api import KVConnectorOutput, RequestStatus
from kvfsm.adapters.vllm_cpu_offload import CpuOffloadScheduler, CpuOffloadWorker, CpuOffloadWorkerMeta
from kvfsm.drivers.cpu_offload import CpuOffload
from kvfsm.drivers.kv_cache import Copy, Done, KVLayout, copy_blocks
from kvfsm.showcase.sim import StepOutput, run_worker
from kvfsm.showcase.sim.workload import SimRequest

BS = 4
LAYOUT = KVLayout(num_layers=1, block_size=BS, num_kv_heads=1, head_size=4)
PREFIX = list(range(100, 100 + 4 * BS))


@dataclass
class HeldCopier:
    """A DMA engine the test drives: a copy runs, and is reported, only when the test says so."""

    queued: dict[int, Copy] = field(default_factory=dict)
    done: list[Done] = field(default_factory=list)

    def submit(self, copy: Copy) -> None:
        self.queued[copy.job] = copy

    def poll(self) -> list[Done]:
        out, self.done = self.done, []
        return out

    def finish_all(self, error: BaseException | None = None, report: bool = True) -> None:
        for job, c in self.queued.items():
            if error is None:
                copy_blocks(c.src, c.src_blocks, c.dst, c.dst_blocks)
            if report:
                self.done.append((job, error))
        self.queued.clear()


class Rig:
    """Both halves of the connector over real pools and tensors, stepped the way vLLM steps them."""

    def __init__(self, hold: bool = False, load_timeout: float = 30.0) -> None:
        self.now = 0.0
        self.offload = CpuOffload(LAYOUT, num_gpu_blocks=32, num_cpu_blocks=16, device="cpu")
        self.sched = CpuOffloadScheduler(self.offload, clock=lambda: self.now, load_timeout=load_timeout)
        self.copier = HeldCopier() if hold else None
        self.worker = CpuOffloadWorker(self.offload, self.copier)
        self.serial = 0
        self.finished: set[str] = set()

    def request(self, tokens: list[int]) -> SimRequest:
        self.serial += 1
        return SimRequest(f"req-{self.serial}", self.serial, tokens, max_output=4, block_size=BS)

    def step(self, preempted: set[str] | None = None, deliver: KVConnectorOutput | None = None) -> KVConnectorOutput:
        meta = self.sched.build_connector_meta(StepOutput({}, self.finished, preempted))
        out = run_worker(self.worker, meta, self.finished) if deliver is None else deliver
        self.finished = set()
        self.sched.update_connector_output(out)
        return out

    def finish(self, req: SimRequest, status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> None:
        req.status = status
        assert self.sched.request_finished(req, list(req.blocks)) == (False, None)
        self.finished.add(req.request_id)

    def store_prefix(self, tokens: list[int] = PREFIX) -> SimRequest:
        """A request that computed ``tokens`` finishes; its store runs to completion."""
        req = self.request(tokens)
        req.blocks = self.offload.gpu_pool.allocate(req.request_id, len(req.block_hashes))
        for i, b in enumerate(req.blocks):
            self.offload.gpu_cache.block(b).fill_(float(i + 1))
        req.num_computed_tokens = len(req.block_hashes) * BS
        self.finish(req)
        self.offload.gpu_pool.release(req.request_id)
        self.step()
        if self.copier:
            self.copier.finish_all()
            self.step()
        return req

    def load_hit(self, req: SimRequest, blocks: int = 4) -> None:
        """vLLM's two phases for a CPU hit of ``blocks`` blocks: match (A), allocate, then update (B)."""
        self.sched.get_num_new_matched_tokens(req, 0)
        self.allocate(req, blocks)
        self.sched.update_state_after_alloc(req, req, blocks * BS)

    def allocate(self, req: SimRequest, blocks: int) -> None:
        req.blocks = self.offload.gpu_pool.allocate(req.request_id, blocks)

    def free(self, req: SimRequest) -> None:
        """The scheduler lets the request's blocks go (the connector's own holds stay)."""
        self.offload.gpu_pool.release(req.request_id)

    def cpu_refs(self) -> dict[int, int]:
        return self.offload.cpu_pool.referenced()


def test_phase_a_reports_an_async_hit_and_pins_its_blocks() -> None:
    rig = Rig()
    rig.store_prefix()
    req = rig.request([*PREFIX, 1, 2])
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    assert rig.sched.loads.state(req.request_id) == "pinned"
    assert rig.cpu_refs() == dict.fromkeys(rig.offload.load.pinned(req.request_id), 1)


def test_a_miss_returns_zero_not_async_and_pins_nothing() -> None:
    rig = Rig()
    req = rig.request(PREFIX)
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert rig.sched.loads.state(req.request_id) is None and rig.cpu_refs() == {}


def test_the_hit_stops_before_the_last_token_the_model_must_compute() -> None:
    rig = Rig()
    rig.store_prefix()
    req = rig.request(PREFIX)  # exactly the four stored blocks
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_a_hit_beyond_locally_computed_tokens_counts_only_the_new_ones() -> None:
    rig = Rig()
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    assert rig.sched.get_num_new_matched_tokens(req, 2 * BS) == (2 * BS, True)
    assert len(rig.offload.load.pinned(req.request_id)) == 2


def test_phase_a_again_releases_the_earlier_pin_first() -> None:
    """allocate_slots failed after phase A (vLLM says nothing); the next phase A is the way out."""
    rig = Rig()
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    rig.sched.get_num_new_matched_tokens(req, 0)
    rig.sched.get_num_new_matched_tokens(req, 0)
    assert set(rig.cpu_refs().values()) == {1}
    assert rig.sched.stats.retries == 1
    rig.step()
    assert rig.sched.stats.outcomes["load.released"] == 1


@pytest.mark.parametrize(
    "way_out",
    ["phase B with no tokens", "preempted", "finished", "aborted"],
)
def test_every_way_out_before_phase_b_releases_the_pin(way_out: str) -> None:
    rig = Rig()
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    rig.sched.get_num_new_matched_tokens(req, 0)
    assert rig.cpu_refs()
    if way_out == "phase B with no tokens":
        rig.sched.update_state_after_alloc(req, req, 0)
    elif way_out == "preempted":
        rig.step(preempted={req.request_id})  # the only way a connector hears of it
    elif way_out == "finished":
        rig.finish(req)
    else:
        rig.finish(req, RequestStatus.FINISHED_ABORTED)
    assert rig.cpu_refs() == {}
    rig.step()
    assert rig.sched.live() == 0


def test_a_load_copies_the_pinned_blocks_and_reports_the_request_once() -> None:
    rig = Rig()
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    rig.load_hit(req)
    out = rig.step()
    assert out.finished_recving == {req.request_id} and out.invalid_block_ids == set()
    for i, b in enumerate(req.blocks):
        assert torch.all(rig.offload.gpu_cache.block(b) == float(i + 1))
    assert rig.cpu_refs() == {}
    rig.offload.check()
    assert rig.offload.driver_holdings() == {} and rig.offload.gpu_pool.holdings() == {
        req.request_id: tuple(req.blocks)
    }
    # vLLM calls phase B again after an async load, with no tokens: nothing happens.
    rig.sched.update_state_after_alloc(req, req, 0)
    assert rig.step().finished_recving is None


def test_an_abort_mid_load_keeps_both_ends_until_the_worker_reports() -> None:
    rig = Rig(hold=True)
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    rig.load_hit(req)
    rig.step()
    rig.finish(req, RequestStatus.FINISHED_ABORTED)
    rig.free(req)  # even if the scheduler let go, the load holds them
    assert rig.sched.loads.state(req.request_id) == "abandoned"
    assert len(rig.cpu_refs()) == 4 and all(rig.offload.gpu_pool.ref_cnt[b] == 1 for b in req.blocks)
    assert rig.step().finished_recving is None  # vLLM waits for the copy, as the spec does
    rig.copier.finish_all()  # type: ignore[union-attr]
    rig.step()  # the copy is over: everything is freed, and the unverified blocks go out first
    assert rig.cpu_refs() == {} and rig.offload.gpu_pool.referenced() == {}
    assert rig.sched.loads.state(req.request_id) == "aborted"
    assert rig.step().finished_recving == {req.request_id}


def test_a_failed_load_reports_its_blocks_as_errors_and_releases_everything() -> None:
    rig = Rig(hold=True)
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    rig.load_hit(req)
    rig.step()
    rig.copier.finish_all(error=RuntimeError("DMA error"))  # type: ignore[union-attr]
    out = rig.step()  # the worker reports the failed job; the blocks go out with the next metadata
    assert out.finished_recving is None and rig.cpu_refs() == {} and rig.sched.stats.loads_failed == 1
    out = rig.step()
    assert out.finished_recving == {req.request_id}
    assert out.invalid_block_ids == set(req.blocks)


def test_a_lost_report_expires_and_vllm_is_still_told_to_recompute() -> None:
    rig = Rig(hold=True, load_timeout=5.0)
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    rig.load_hit(req)
    rig.step()
    rig.copier.finish_all(report=False)  # type: ignore[union-attr]
    assert rig.step().finished_recving is None
    rig.now += 5.0
    out = rig.step()  # the deadline fires in build_connector_meta; the worker reports the give-up
    assert out.finished_recving == {req.request_id} and out.invalid_block_ids == set(req.blocks)
    assert rig.cpu_refs() == {} and rig.sched.stats.expired == 1


def test_a_late_duplicate_of_an_old_load_does_not_finish_a_newer_one() -> None:
    """The same request id loads twice (preempted in between); the first load's report comes again."""
    rig = Rig(hold=True)
    rig.store_prefix()
    req = rig.request([*PREFIX, 1])
    rig.load_hit(req)
    rig.step()
    rig.copier.finish_all()  # type: ignore[union-attr]
    first = rig.step()
    assert first.finished_recving == {req.request_id}
    old_meta = first.kv_connector_worker_meta
    assert isinstance(old_meta, CpuOffloadWorkerMeta)

    rig.free(req)  # preempted: vLLM frees and recomputes from scratch
    rig.step(preempted={req.request_id})
    rig.load_hit(req)
    rig.step()  # the second load is in flight
    late = KVConnectorOutput(finished_recving={req.request_id}, kv_connector_worker_meta=old_meta)
    out = rig.step(deliver=late)
    assert out.finished_recving is None  # vLLM is not told the second load is done
    assert rig.sched.loads.state(req.request_id) == "loading"
    dropped = rig.sched.anomalies()
    assert dropped["unknown"] + dropped["late"] == 1  # the old job id names a drained load: dropped, counted


def test_phase_b_asking_for_more_than_was_pinned_is_refused_and_recomputed() -> None:
    rig = Rig()
    rig.store_prefix()
    req = rig.request([*PREFIX, *PREFIX])
    assert rig.sched.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    rig.allocate(req, 6)
    rig.sched.update_state_after_alloc(req, req, 6 * BS)  # more than phase A offered
    out = rig.step()
    assert out.finished_recving == {req.request_id} and out.invalid_block_ids == set(req.blocks)
    assert rig.cpu_refs() == {} and rig.sched.stats.loads_refused == 1
    assert rig.sched.stats.outcomes["load.failed"] == 1


def test_a_store_takes_only_missing_blocks_and_publishes_them_after_the_copy() -> None:
    rig = Rig(hold=True)
    rig.store_prefix(PREFIX[: 2 * BS])
    req = rig.request(PREFIX)
    rig.allocate(req, 4)
    req.num_computed_tokens = 4 * BS
    rig.finish(req)
    rig.free(req)
    assert [rig.offload.gpu_pool.ref_cnt[b] for b in req.blocks] == [0, 0, 1, 1]  # the store's own holds
    rig.step()
    assert rig.offload.cpu_pool.lookup(req.block_hashes) == rig.offload.cpu_pool.lookup(req.block_hashes[:2])
    rig.copier.finish_all()  # type: ignore[union-attr]
    rig.step()
    assert len(rig.offload.cpu_pool.lookup(req.block_hashes)) == 4
    assert rig.offload.gpu_pool.referenced() == {} and rig.sched.stats.blocks_stored == 2 + 2


def test_request_finished_twice_is_counted_not_stored_twice() -> None:
    rig = Rig(hold=True)
    req = rig.request(PREFIX)
    rig.allocate(req, 4)
    req.num_computed_tokens = 4 * BS
    rig.finish(req)
    rig.finish(req)
    assert rig.sched.stats.duplicate_finishes == 1
    assert rig.sched.stats.outcomes == {} and rig.sched.stores.live() == 1


def test_the_worker_reports_nothing_when_nothing_ended() -> None:
    rig = Rig()
    out = rig.step()
    assert out.finished_recving is None and out.finished_sending is None
    assert out.kv_connector_worker_meta is None and out.invalid_block_ids == set()


def test_the_adapter_imports_without_vllm() -> None:
    code = "import sys; sys.modules['vllm'] = None; import kvfsm.adapters.vllm_cpu_offload; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_the_module_path_vllm_is_given_imports_neither_vllm_nor_torch() -> None:
    code = (
        "import sys; sys.modules['vllm'] = sys.modules['torch'] = None\n"
        "import kvfsm.adapters.vllm\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvfsm.adapters.')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "['kvfsm.adapters.vllm']", done.stderr


def test_a_vllm_connector_asked_for_without_vllm_says_how_to_install_it() -> None:
    script = (
        "import sys; sys.modules['vllm'] = None\n"
        "import kvfsm.adapters.vllm as m\n"
        "try:\n    m.CpuOffloadConnector\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert "CpuOffloadConnector is a vLLM connector" in out and "docs/vllm.md" in out


def test_the_connector_reports_every_anomaly_kind_the_engine_has_and_nothing_else() -> None:
    from typing import get_args

    from kvfsm.errors import AnomalyKind

    assert set(Rig().sched.anomalies()) == set(get_args(AnomalyKind))  # ignored events are no anomaly
