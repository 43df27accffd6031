"""A small model of vLLM v1's scheduler step, driving the CPU-offload connector as vLLM would.

Faithful where the connector can tell the difference (``vllm/v1/core/sched/
scheduler.py``): running requests first, preempting the lowest-priority one
when ``allocate_slots`` fails, with no connector call; waiting requests only
in a step without preemptions, phase A then ``allocate_slots`` (which may
fail, again with no callback) then phase B; async loads parked in
``WAITING_FOR_REMOTE_KVS`` until ``finished_recving``; invalid blocks handled
before ``update_connector_output``; an aborted request that waits for a load
keeps its blocks until the load is reported. Simplified: one KV-cache group;
no GPU prefix caching, so phase A always sees ``num_computed_tokens == 0`` and
every reuse goes through the CPU tier; one token sampled per step; FCFS.
"""

from __future__ import annotations

import random
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import cast

import torch

from ...adapters.vllm_api import KVConnectorOutput, RequestStatus
from ...adapters.vllm_cpu_offload import CpuOffloadMetadata, CpuOffloadScheduler, CpuOffloadWorker
from ...drivers.block_pool import BlockPool
from ...drivers.cpu_offload import CpuOffload
from ...drivers.kv_cache import KVLayout
from .report import SimReport
from .runner import DelayedCopier, KVPattern, OutputDelivery, run_worker
from .workload import SimRequest, Workload, make_requests, poisson


@dataclass(frozen=True)
class SimConfig:
    """The engine: pool sizes, batch limits, KV shape, and the faults of the worker side."""

    block_size: int = 16
    num_gpu_blocks: int = 128
    num_cpu_blocks: int = 256
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 8
    step_seconds: float = 0.01
    """Virtual time per step: what the connector's deadlines count in."""
    load_timeout: float = 1.0
    store_timeout: float = 1.0
    copy_delay_steps: tuple[int, int] = (1, 4)
    copy_failure_rate: float = 0.01
    report_loss_rate: float = 0.003
    duplicate_rate: float = 0.05
    late_rate: float = 0.02
    preempt_rate: float = 0.0
    """Chance per step that a running request is preempted for priority (besides memory pressure)."""
    check_every: int = 10
    """Steps between full reference-count checks (O(blocks) each)."""
    drain_steps: int = 2_000
    """Steps allowed after the last request ends for every load, store and report to settle."""
    device: str | None = None
    """Where the GPU cache lives; None: CUDA when available."""


@dataclass
class StepOutput:
    """The scheduler output of one step: what build_connector_meta and the worker read of it."""

    scheduled: dict[str, int]
    finished_req_ids: set[str]
    preempted_req_ids: set[str] | None


class Simulation:
    """One engine: scheduler, connector (both halves), worker, and the requests of a workload."""

    def __init__(self, workload: Workload, config: SimConfig = SimConfig()) -> None:
        self.workload, self.config = workload, config
        self.rng = random.Random(workload.seed)
        self.step_no = 0
        layout = KVLayout(config.num_layers, config.block_size, config.num_kv_heads, config.head_size, torch.float32)
        self.gpu_pool = BlockPool(config.num_gpu_blocks)
        self.offload = CpuOffload(
            layout, config.num_gpu_blocks, config.num_cpu_blocks, gpu_pool=self.gpu_pool, device=config.device
        )
        self.connector = CpuOffloadScheduler(
            self.offload,
            clock=lambda: self.step_no * config.step_seconds,
            load_timeout=config.load_timeout,
            store_timeout=config.store_timeout,
        )
        self.copier = DelayedCopier(
            lambda: self.step_no,
            random.Random(self.rng.random()),
            config.copy_delay_steps,
            config.copy_failure_rate,
            config.report_loss_rate,
        )
        self.worker = CpuOffloadWorker(self.offload, self.copier)
        self.delivery = OutputDelivery(random.Random(self.rng.random()), config.duplicate_rate, config.late_rate)
        self.kv = KVPattern(layout)
        self.pending: deque[SimRequest] = deque(make_requests(workload, config.block_size, self.rng))
        self.requests: dict[str, SimRequest] = {}
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.finished_req_ids: set[str] = set()
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.report = SimReport(seed=workload.seed)

    # -- the loop ------------------------------------------------------------------

    def run(self) -> SimReport:
        """Run until every request has ended and everything in flight has settled, then check for leaks."""
        start = time.perf_counter()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the simulated tensors are tiny: thread hand-offs would cost more than the work
        try:
            idle = 0
            while (self.pending or self.requests or self._in_flight()) and idle <= self.config.drain_steps:
                self.step()
                idle = idle + 1 if not (self.pending or self.requests) else 0
            self._final_checks()
            self.connector.shutdown()  # releases anything still live; the checks above already counted it
        finally:
            torch.set_num_threads(threads)
        self.report.wall_seconds = time.perf_counter() - start
        return self.report

    def _in_flight(self) -> bool:
        return self.connector.live() > 0 or self.copier.busy() or self.delivery.busy()

    def step(self) -> None:
        self.step_no += 1
        self._arrive()
        self._client_aborts()
        out = self._schedule()
        meta = self.connector.build_connector_meta(out)
        kv_out = self._execute(meta, out)
        self._update_from_output(out, self.delivery.deliver(self.step_no, kv_out))
        if self.step_no % self.config.check_every == 0:
            self._check_holders()

    def _arrive(self) -> None:
        for _ in range(min(poisson(self.rng, self.workload.arrival_rate), len(self.pending))):
            req = self.pending.popleft()
            self.requests[req.request_id] = req
            self.waiting.append(req)
            self.report.requests += 1

    def _client_aborts(self) -> None:
        """Clients give up between steps (vLLM's ``finish_requests``); more often while a load is slow."""
        w = self.workload
        for req in [*self.running, *self.waiting]:
            loading = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req.request_id not in self.finished_recving
            if self.rng.random() < w.abort_rate + (w.abort_loading_rate if loading else 0.0):
                if loading:
                    self.report.aborted_mid_load += 1
                self._finish(req, RequestStatus.FINISHED_ABORTED)

    # -- schedule() ----------------------------------------------------------------

    def _schedule(self) -> StepOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[SimRequest] = []
        for req in list(self.running):  # priority preemption, if configured
            if cfg.preempt_rate and self.rng.random() < cfg.preempt_rate:
                self._preempt(req)
                preempted.append(req)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._allocate(req, n):
                victim = self.running[-1]  # FCFS: the latest admitted goes first
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled[req.request_id] = n
                budget -= n
                i += 1
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled)
        out = StepOutput(scheduled, self.finished_req_ids, {r.request_id for r in preempted} or None)
        self.finished_req_ids = set()
        return out

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int]) -> int:
        skipped: list[SimRequest] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not self._update_waiting_for_remote_kv(req):
                skipped.append(self.waiting.popleft())
                continue
            external, load_async = 0, False
            if req.num_computed_tokens == 0:
                matched, load_async = self.connector.get_num_new_matched_tokens(req, 0)
                if matched is None:
                    skipped.append(self.waiting.popleft())
                    continue
                external = matched
            new = 0 if load_async else min(req.num_tokens - req.num_computed_tokens - external, budget)
            if not self._allocate(req, external + new):
                if external:
                    self.report.alloc_failures_after_hit += 1  # the pin stays; vLLM says nothing
                break
            self.connector.update_state_after_alloc(req, req, external)
            self.waiting.popleft()
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.load = (0, external // self.config.block_size)
                skipped.append(req)
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = new
            budget -= new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _allocate(self, req: SimRequest, num_tokens: int) -> bool:
        """vLLM's allocate_slots: enough GPU blocks for the computed tokens plus ``num_tokens``, or False."""
        bs = self.config.block_size
        need = -(-(req.num_computed_tokens + num_tokens) // bs) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.gpu_pool.num_free:
            return False
        req.blocks += self.gpu_pool.allocate(req.request_id, need)
        return True

    def _preempt(self, req: SimRequest) -> None:
        """vLLM's _preempt_request: free the blocks, recompute from scratch later. No connector call."""
        self.running.remove(req)
        self._release_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        if req.num_preemptions == 0:
            self.report.preempted += 1
        req.num_preemptions += 1
        self.report.preemptions += 1
        self.waiting.appendleft(req)

    def _update_waiting_for_remote_kv(self, req: SimRequest) -> bool:
        """The load vLLM waited for is reported: take its tokens as computed (or recompute what failed)."""
        rid = req.request_id
        if rid not in self.finished_recving:
            return False
        self.finished_recving.discard(rid)
        if rid in self.failed_recving:
            self.failed_recving.discard(rid)
            self.report.loads_recomputed += 1
            if req.num_computed_tokens == 0:
                self._release_blocks(req)
        else:
            computed = min(len(req.blocks) * self.config.block_size, req.num_tokens)
            req.num_computed_tokens = computed - 1 if computed == req.num_tokens else computed
            self._check_load(req)
        req.load = None
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING
        return True

    def _check_load(self, req: SimRequest) -> None:
        """The bytes the load brought must be the ones the prefix hashes name."""
        assert req.load is not None
        first, n = req.load
        self.report.loads_checked += 1
        self.report.stale_blocks += self.kv.mismatches(
            self.offload.gpu_cache, req.blocks[first : first + n], req.block_hashes[first : first + n]
        )

    # -- the worker ----------------------------------------------------------------

    def _execute(self, meta: CpuOffloadMetadata, out: StepOutput) -> KVConnectorOutput:
        return run_worker(self.worker, meta, out.finished_req_ids, lambda: self._forward(out.scheduled))

    def _forward(self, scheduled: dict[str, int]) -> None:
        """The model computes the scheduled tokens: every block they fill gets the bytes of its hash."""
        bs = self.config.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        for rid, n in scheduled.items():
            req = self.requests[rid]
            c = req.num_computed_tokens
            for b in range(c // bs, (c + n) // bs):
                blocks.append(req.blocks[b])
                hashes.append(req.block_hashes[b])
        self.kv.write(self.offload.gpu_cache, blocks, hashes)

    # -- update_from_output() ----------------------------------------------------------

    def _update_from_output(self, out: StepOutput, kv_out: KVConnectorOutput) -> None:
        if kv_out.invalid_block_ids:
            self._handle_invalid_blocks(kv_out.invalid_block_ids)
        for rid, n in out.scheduled.items():
            req = self.requests.get(rid)
            if req is None or RequestStatus.is_finished(req.status) or req.status != RequestStatus.RUNNING:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                req.append_output()
                if len(req.output) >= req.max_output:
                    self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
        self.connector.update_connector_output(kv_out)
        for rid in kv_out.finished_recving or ():
            req = self.requests.get(rid)
            if req is None:
                self._assertion(
                    f"step {self.step_no}: finished_recving names {rid}, not a request (assert req_id in self.requests)"
                )
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(rid)
            elif RequestStatus.is_finished(req.status):
                self._free_blocks(req)  # aborted while loading: its blocks waited for this
            else:
                self._assertion(
                    f"step {self.step_no}: finished_recving names {rid} in {req.status.name} (assert is_finished)"
                )
        for rid in kv_out.finished_sending or ():
            self._assertion(f"step {self.step_no}: finished_sending names {rid}, but no store delays a free")

    def _handle_invalid_blocks(self, invalid: set[int]) -> None:
        """vLLM's recompute policy for async loads: tokens before the first bad block stay computed."""
        bs = self.config.block_size
        for req in self.waiting:
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            rid = req.request_id
            limit = req.num_computed_tokens // bs if rid in self.failed_recving else len(req.blocks)
            bad = next((i for i, b in enumerate(req.blocks[:limit]) if b in invalid), None)
            if bad is not None:
                req.num_computed_tokens = bad * bs
                self.failed_recving.add(rid)

    def _finish(self, req: SimRequest, status: RequestStatus) -> None:
        """vLLM's _free_request: the connector hears of it before the blocks are freed."""
        rid = req.request_id
        waited = req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in self.finished_recving
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.finished_recving.discard(rid)
        self.failed_recving.discard(rid)
        req.status = status
        delay_free, _params = self.connector.request_finished(req, list(req.blocks))
        if delay_free:
            self._assertion(f"{rid}: delay_free=True, but this connector never delays a free")
        self.finished_req_ids.add(rid)
        if status == RequestStatus.FINISHED_ABORTED:
            self.report.aborted += 1
        else:
            self.report.finished += 1
        if not waited:  # else the blocks stay until the load is reported
            self._free_blocks(req)

    def _free_blocks(self, req: SimRequest) -> None:
        self._release_blocks(req)
        del self.requests[req.request_id]

    def _release_blocks(self, req: SimRequest) -> None:
        """The request lets its GPU blocks go (the pool keeps those a load or a store still holds)."""
        if req.blocks:
            self.gpu_pool.release(req.request_id)
        req.blocks = []

    def _assertion(self, what: str) -> None:
        self.report.assertion_failures.append(what)

    # -- checks ---------------------------------------------------------------------------

    def _check_holders(self) -> None:
        """The pools keep their invariants, and the scheduler's holds on GPU blocks are exactly its requests' blocks."""
        self.offload.check()
        for req in self.requests.values():
            if self.gpu_pool.held_by(req.request_id) != tuple(sorted(req.blocks)):
                self._assertion(f"step {self.step_no}: {req.request_id} holds {self.gpu_pool.held_by(req.request_id)}")

    def _final_checks(self) -> None:
        r = self.report
        r.steps = self.step_no
        r.connector = self.connector.stats
        r.anomalies = self.connector.anomalies()
        r.failed_copies, r.lost_reports = self.copier.failed, self.copier.lost
        r.duplicated_outputs, r.late_outputs = self.delivery.duplicated, self.delivery.late
        r.cpu_evictions = self.offload.cpu_pool.evictions
        r.live_instances = self.connector.live()
        r.unfinished_requests = len(self.requests) + len(self.pending)
        self._check_holders()
        r.leaked_cpu_refs = self.offload.cpu_pool.referenced()
        scheduler = set(self.requests)
        leaked: Counter[int] = Counter()
        for holder, blocks in self.gpu_pool.holdings().items():
            if holder not in scheduler:
                leaked.update(blocks)
        r.leaked_gpu_refs = dict(leaked)
        pool = self.offload.cpu_pool
        cached = [b for b in range(pool.num_blocks) if pool.hash_of(b) is not None]
        r.cpu_cache_mismatches = self.kv.mismatches(
            self.offload.cpu_cache, cached, [cast(int, pool.hash_of(b)) for b in cached]
        )


def simulate(workload: Workload, config: SimConfig = SimConfig()) -> SimReport:
    """Run ``workload`` through the simulated engine and the CPU-offload connector; see :class:`SimReport`."""
    return Simulation(workload, config).run()
