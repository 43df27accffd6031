"""kvfsm's connectors inside vLLM's real ``Scheduler``, stepped with fake model outputs and checked after every step.

The scheduler is vLLM's own (CPU, a small GPU pool, prefix caching on); it
loads the connector (:class:`RealEngine`: CPU offload, :class:`MooncakeEngine`:
Mooncake store) through ``kv_connector_module_path`` and builds the SCHEDULER
role itself. The WORKER role is driven the way vLLM's
``KVConnectorModelRunnerMixin`` drives it, and the model's output is faked
the way vLLM's ``tests/v1/kv_connector/unit/utils.py`` fakes it. Faults: a DMA
engine that is late, fails or loses reports
(:class:`~kvfsm.showcase.sim.runner.DelayedCopier`), a process boundary that
delivers worker outputs twice or much later
(:class:`~kvfsm.showcase.sim.runner.OutputDelivery`), store calls that raise
or fail (:class:`~kvfsm.harness.mooncake.FaultyStore`).

After every step, :meth:`Engine.check` holds vLLM and kvfsm to each other:
every GPU block's ``ref_cnt`` is exactly the requests vLLM gives it plus the
connector's references on it, vLLM's free queue is exactly the unreferenced
blocks, and each engine adds what its connector owes vLLM (see their
docstrings).

Needs vLLM (``./dev.sh setup`` installs it; see docs/vllm.md).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM must not look for an accelerator here

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from ...adapters import vllm_api
from ...adapters.vllm_connector import CpuOffloadConnector, as_worker_report
from ...adapters.vllm_mooncake import VLLM, MooncakeStoreConnector
from ...drivers.mooncake import EmbeddedMaster
from ...engine import Tracker
from ...harness.mooncake import FaultyStore, store_plan
from .opt125m import model_dir
from .runner import DelayedCopier, OutputDelivery

EOS_TOKEN_ID = 50256
_none_hash_ready = False


@dataclass(frozen=True)
class EngineConfig:
    """The scheduler's shape, the connector's settings, and how badly the worker and the process boundary behave."""

    num_gpu_blocks: int = 24
    num_cpu_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    load_timeout: float = 40.0
    store_timeout: float = 40.0
    """Deadlines in steps (the Trackers' clock is the step count)."""
    copy_delay: tuple[int, int] = (1, 3)
    copy_failure_rate: float = 0.0
    copy_loss_rate: float = 0.0
    duplicate_rate: float = 0.0
    late_rate: float = 0.0
    kv_load_failure_policy: str = "recompute"


@dataclass(frozen=True)
class EngineWorkload:
    """What arrives: requests sharing a few prefixes, and clients that give up."""

    num_requests: int = 200
    arrival_rate: float = 0.12
    num_prefixes: int = 4
    prefix_blocks: tuple[int, int] = (2, 6)
    unique_len: tuple[int, int] = (1, 40)
    output_len: tuple[int, int] = (1, 64)
    abort_rate: float = 0.001
    """Chance per step that the client of any one live request aborts it."""
    abort_loading_rate: float = 0.05
    """Chance per step that a request vLLM parks in WAITING_FOR_REMOTE_KVS is aborted (mid-load)."""
    reset_prefix_cache_every: int = 25
    """Steps between ``reset_prefix_cache()`` calls: the GPU forgets, so the CPU tier must serve."""
    seed: int = 0


@dataclass
class EngineReport:
    """What happened, and what leaked (nothing, for a correct connector)."""

    steps: int = 0
    requests: int = 0
    finished: int = 0
    preemptions: int = 0
    aborts: int = 0
    aborts_mid_load: int = 0
    aborts_between_phases: int = 0
    prefix_resets: int = 0
    checks: int = 0
    connector: dict[str, Any] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    leaked_gpu_blocks: int = 0
    leaked_cpu_holds: int = 0
    live_instances: int = 0

    @property
    def clean(self) -> bool:
        return self.leaked_gpu_blocks == 0 and self.leaked_cpu_holds == 0 and self.live_instances == 0


def vllm_config(
    config: EngineConfig, connector: str, extra: dict[str, Any], *, role: str = "kv_both", engine_id: str | None = None
) -> VllmConfig:
    """The VllmConfig of vLLM's connector unit tests, with a kvfsm connector named by module path.

    ``role`` and ``engine_id`` are what a disaggregated pair sets apart (``kv_producer``/``kv_consumer``).
    """
    model = ModelConfig(model=str(model_dir()), skip_tokenizer_init=True, dtype="float16", seed=42)
    identity = {"engine_id": engine_id} if engine_id is not None else {}
    return VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(block_size=config.block_size, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path="kvfsm.adapters.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy=config.kv_load_failure_policy,
            **identity,
        ),
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(config: EngineConfig) -> KVCacheConfig:
    """One full-attention layer, its blocks placed in one allocation as vLLM's CPU backend places them."""
    spec = FullAttentionSpec(block_size=config.block_size, num_kv_heads=1, head_size=4, dtype=torch.float16)
    page = spec.page_size_bytes
    size = config.num_gpu_blocks * page
    placement = KVCacheTensor(size=size, layers=["layer"], layer_stride=size, block_stride=page)
    return KVCacheConfig(
        num_blocks=config.num_gpu_blocks,
        kv_cache_tensors=[placement],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def model_output(req_ids: list[str], sampled: list[list[int]], kv: KVConnectorOutput) -> ModelRunnerOutput:
    """What a model runner returns for one step: ``sampled[i]`` for ``req_ids[i]`` (empty for a partial prefill)."""
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
    )


def make_request(request_id: str, prompt: list[int], max_tokens: int, block_size: int) -> Request:
    """A request as vLLM's tests make one: block hashes by sha256 from the first token on."""
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def engine_kv_caches(config: KVCacheConfig) -> dict[str, torch.Tensor]:
    """Per-layer KV caches allocated as vLLM's CPU attention backend allocates them, views of one buffer shaped
    ``[blocks, kv_heads, block_size, 2 * head_size]``: what a real engine hands ``register_kv_caches``."""
    spec = config.kv_cache_groups[0].kv_cache_spec
    caches = {}
    for place in config.kv_cache_tensors:
        raw = torch.zeros(place.size, dtype=torch.uint8)
        for i, name in enumerate(place.layers):
            region = raw[place.offset + i * place.layer_stride :][: config.num_blocks * place.block_stride]
            shape = (config.num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
            caches[name] = region.view(spec.dtype).view(shape)
    return caches


class Engine:
    """vLLM's Scheduler with a kvfsm connector, stepped with fake model outputs and checked after every step.

    Subclasses name the connector and add what is to be checked of it; this
    class checks vLLM's side: every GPU block's ``ref_cnt`` is what vLLM's
    requests and the connector's own references account for, and vLLM's free
    queue is exactly the unreferenced blocks.
    """

    connector_name = ""

    def __init__(self, config: EngineConfig = EngineConfig(), seed: int = 0) -> None:
        self.config = config
        self.rng = random.Random(seed)
        self.now = 0
        self.vllm_config = vllm_config(config, self.connector_name, self.extra_config())
        self.kv_cache_config = kv_cache_config(config)
        self.vllm_config.cache_config.num_gpu_blocks = config.num_gpu_blocks
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=config.block_size,
        )
        if type(self.scheduler.connector).__name__ != self.connector_name:
            raise TypeError(f"vLLM built {type(self.scheduler.connector).__name__}, not kvfsm's {self.connector_name}")
        self.block_pool = self.scheduler.kv_cache_manager.block_pool
        self.delivery = OutputDelivery(self.rng, duplicate_rate=config.duplicate_rate, late_rate=config.late_rate)
        self.report = EngineReport()
        self._seen: set[str] = set()
        """Request ids added and possibly still known to the connector: where to look for what vLLM forgot."""

    # -- what a connector adds ---------------------------------------------------------

    def extra_config(self) -> dict[str, Any]:
        """The connector's ``kv_connector_extra_config``."""
        return {}

    @property
    def worker(self) -> Any:
        """The connector's WORKER role, built by the subclass."""
        raise NotImplementedError

    def connector_refs(self) -> dict[int, int]:
        """References the connector holds on vLLM's GPU blocks, by block id."""
        return {}

    def check_connector(self) -> None:
        """The connector's own state against what vLLM believes (AssertionError if they disagree)."""

    def connector_busy(self) -> bool:
        """Whether the connector still has work under way (the run drains until it has none)."""
        return self.delivery.busy()

    def between_phases(self, request_id: str) -> bool:
        """Whether phase A answered for the request and phase B has not come (for counting aborts)."""
        return False

    def finish_connector(self, report: EngineReport) -> None:
        """Fill the connector's figures and leak counts into ``report``."""

    # -- one step ---------------------------------------------------------------------

    def step(self) -> None:
        """One scheduler step, one worker step, one model output, and every check."""
        self.now += 1
        out = self.scheduler.schedule()
        self.report.preemptions += len(out.preempted_req_ids or ())
        kv = self.delivery.deliver(self.now, self._worker_step(out.kv_connector_metadata, set(out.finished_req_ids)))
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            # The model runner discards the token of a partial prefill; the rest sample one.
            sampled.append([self.rng.randrange(1000)] if req.num_computed_tokens >= req.num_tokens else [])
        runner_out = model_output(
            req_ids,
            sampled,
            KVConnectorOutput(
                finished_sending=kv.finished_sending,
                finished_recving=kv.finished_recving,
                invalid_block_ids=set(kv.invalid_block_ids),
                kv_connector_worker_meta=self.worker_meta(kv.kv_connector_worker_meta),
            ),
        )
        for req in self.scheduler.update_from_output(out, runner_out).values():
            self.report.finished += sum(1 for o in req.outputs if o.finish_reason is not None)
        self.report.steps += 1
        self.check()

    def worker_meta(self, meta: Any) -> Any:
        """The worker metadata as vLLM receives it (after the flaky boundary merged outputs)."""
        return meta

    def settle(self) -> None:
        """Let the worker's own threads finish this step's work before it reports (a forward pass's worth of time)."""

    def _worker_step(self, meta: Any, finished_req_ids: set[str]) -> vllm_api.KVConnectorOutput:
        """The WORKER role's calls in the order of vLLM's ``KVConnectorModelRunnerMixin`` (no forward pass here)."""
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        self.settle()
        sending, recving = w.get_finished(finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        return vllm_api.KVConnectorOutput(
            sending, recving, invalid_block_ids=invalid, kv_connector_worker_meta=worker_meta
        )

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self._seen.add(request.request_id)
        self.report.requests += 1

    def abort(self, request_id: str) -> None:
        """The client gives up; counted by where the request was in the connector's lifecycle."""
        req = self.scheduler.requests.get(request_id)
        if req is None or RequestStatus.is_finished(req.status):
            return
        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.report.aborts_mid_load += 1
        elif self.between_phases(request_id):
            self.report.aborts_between_phases += 1
        self.report.aborts += 1
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    # -- the checks ----------------------------------------------------------------------

    def owners(self) -> dict[str, list[Any]]:
        """vLLM's requests and the GPU blocks it gives each (``KVCacheBlock``s)."""
        return self.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks  # type: ignore[no-any-return]

    def check(self) -> None:
        """vLLM's block pool is consistent with its requests plus the connector's references; then the connector."""
        self.report.checks += 1
        expected = dict.fromkeys(range(len(self.block_pool.blocks)), 0)
        for blocks in self.owners().values():
            for b in blocks:
                if not b.is_null:
                    expected[b.block_id] += 1
        for b, n in self.connector_refs().items():
            expected[b] += n
        for b, block in enumerate(self.block_pool.blocks):
            if not block.is_null and block.ref_cnt != expected[b]:
                raise AssertionError(
                    f"step {self.now}: GPU block {b} has ref_cnt {block.ref_cnt}, but vLLM's requests and the "
                    f"connector's references account for {expected[b]}"
                )
        free = self.block_pool.free_block_queue.num_free_blocks
        unreferenced = sum(1 for b in self.block_pool.blocks if not b.is_null and b.ref_cnt == 0)
        if free != unreferenced:
            raise AssertionError(
                f"step {self.now}: vLLM's free queue has {free} blocks, {unreferenced} are unreferenced"
            )
        self.check_connector()

    # -- a whole run -----------------------------------------------------------------------

    def run(self, workload: EngineWorkload, max_steps: int = 100_000) -> EngineReport:
        """Arrivals, aborts and prefix-cache resets until every request is over; then drain and count leaks."""
        rng = random.Random(workload.seed)
        bs = self.config.block_size
        prefixes = [
            [rng.randrange(1, 30_000) for _ in range(bs * rng.randint(*workload.prefix_blocks))]
            for _ in range(workload.num_prefixes)
        ]
        arrivals = iter(self._requests(rng, workload, prefixes))
        pending = workload.num_requests
        while pending:
            if self.now > max_steps:
                raise AssertionError(f"not drained after {max_steps} steps: {self.scheduler.get_request_counts()}")
            while pending and rng.random() < workload.arrival_rate:
                self.add(next(arrivals))
                pending -= 1
            for rid in list(self.scheduler.requests):
                loading = self.scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
                if rng.random() < (workload.abort_loading_rate if loading else workload.abort_rate):
                    self.abort(rid)
            if workload.reset_prefix_cache_every and self.now % workload.reset_prefix_cache_every == 0:
                self._reset_prefix_cache()
            self.step()
        self.drain(max_steps)
        return self.finish()

    def drain(self, max_steps: int = 10_000) -> None:
        """Step until vLLM has no request and the connector nothing under way (AssertionError if it never does)."""
        for _ in range(max_steps):
            if not (self.scheduler.has_requests() or self.connector_busy()):
                return
            self.step()
        raise AssertionError(f"not idle after {max_steps} steps: {self.stuck()}")

    def stuck(self) -> str:
        """What a drain that never ends is waiting on: vLLM's requests and free blocks, and the connector's state."""
        s = self.scheduler
        queues = {
            "running": s.running, "waiting": s.waiting, "holding": getattr(s, "kv_holding_waiting", ()),
            "in-flight prefill": getattr(s, "_inflight_prefills", ()),
        }  # fmt: skip

        def where(r: Request) -> str:
            return ",".join(name for name, queue in queues.items() if r in queue) or "in no queue"

        requests = [
            f"{rid} {r.status.name} {r.num_computed_tokens}/{r.num_tokens} tokens ({where(r)})"
            for rid, r in list(s.requests.items())[:6]
        ]
        running, waiting = s.get_request_counts()
        return (
            f"vLLM: {running} running, {waiting} waiting ({'; '.join(requests)}), heard loaded "
            f"{sorted(s.finished_recving_kv_req_ids)}, {self.block_pool.get_num_free_blocks()} free GPU blocks; "
            f"connector: {self.connector_state()}"
        )

    def connector_state(self) -> str:
        """The connector's instances under way, for :meth:`stuck`."""
        return f"busy {self.connector_busy()}"

    def _reset_prefix_cache(self) -> None:
        """Make the GPU forget its prefix cache, preempting every running request, when vLLM can.

        vLLM raises if blocks stay in use after the preemption: held by a
        request it cannot preempt, or by the connector; then only an idle reset is tried.
        """
        owners = self.owners()
        stuck = any(
            r.status != RequestStatus.RUNNING and owners.get(rid) for rid, r in self.scheduler.requests.items()
        )  # a request vLLM cannot preempt keeps blocks: waiting for a load, or finished with a delayed free
        preempt = not (stuck or self.connector_refs())
        self.report.prefix_resets += int(bool(self.scheduler.reset_prefix_cache(reset_running_requests=preempt)))

    def _requests(self, rng: random.Random, workload: EngineWorkload, prefixes: list[list[int]]) -> Iterator[Request]:
        for i in range(workload.num_requests):
            prompt = list(rng.choice(prefixes)) + [
                rng.randrange(1, 30_000) for _ in range(rng.randint(*workload.unique_len))
            ]
            yield make_request(f"r{i}", prompt, rng.randint(*workload.output_len), self.config.block_size)

    def finish(self) -> EngineReport:
        """Count what is still held once vLLM and the connector are idle: all zero for a correct connector."""
        r = self.report
        r.leaked_gpu_blocks = sum(1 for b in self.block_pool.blocks if not b.is_null and b.ref_cnt > 0)
        r.faults = {"outputs_duplicated": self.delivery.duplicated, "outputs_late": self.delivery.late}
        self.finish_connector(r)
        return r


class RealEngine(Engine):
    """vLLM's Scheduler with kvfsm's CPU-offload connector, a faulty DMA engine and a flaky process boundary.

    On top of :class:`Engine`'s checks: a request vLLM parks in
    ``WAITING_FOR_REMOTE_KVS`` is owed its answer by a load that holds
    ``recv_report``, or by the report, or vLLM has heard; conversely a load
    that holds ``recv_report`` is for a request vLLM waits for (or finished
    and keeps until it hears); an instance kept for a request vLLM has
    forgotten is in a state whose deadline ends it.
    """

    connector_name = "CpuOffloadConnector"

    def __init__(self, config: EngineConfig = EngineConfig(), seed: int = 0) -> None:
        super().__init__(config, seed)
        connector = self.scheduler.connector
        assert isinstance(connector, CpuOffloadConnector)
        self.connector = connector
        connector.set_clock(lambda: float(self.now))
        self._worker = CpuOffloadConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self._worker.register_kv_caches(engine_kv_caches(self.kv_cache_config))
        self.copier = DelayedCopier(
            lambda: self.now,
            self.rng,
            delay=config.copy_delay,
            failure_rate=config.copy_failure_rate,
            loss_rate=config.copy_loss_rate,
        )
        self._worker.worker_half.copier = self.copier

    def extra_config(self) -> dict[str, Any]:
        c = self.config
        return {"num_cpu_blocks": c.num_cpu_blocks, "load_timeout": c.load_timeout, "store_timeout": c.store_timeout}

    @property
    def worker(self) -> CpuOffloadConnector:
        return self._worker

    def worker_meta(self, meta: Any) -> Any:
        return as_worker_report(meta)

    def connector_refs(self) -> dict[int, int]:
        return self.connector.scheduler_half.offload.gpu_pool.referenced()

    def between_phases(self, request_id: str) -> bool:
        return self.connector.scheduler_half.loads.accepts(request_id, "retry")  # phase A pinned, no phase B yet

    def connector_busy(self) -> bool:
        return self.connector.scheduler_half.live() > 0 or self.copier.busy() or super().connector_busy()

    def check_connector(self) -> None:
        half = self.connector.scheduler_half
        half.offload.gpu_pool.check()
        half.offload.cpu_pool.check()
        for rid, req in self.scheduler.requests.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not (
                "recv_report" in half.loads.held(rid)
                or half.report.owes(rid)
                or rid in self.scheduler.finished_recving_kv_req_ids
            ):
                raise AssertionError(f"step {self.now}: vLLM waits for {rid}'s load, but no load or report owes it")
        for rid in list(self._seen):
            req = self.scheduler.requests.get(rid)
            if "recv_report" in half.loads.held(rid) and not (
                req is not None
                and (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS or RequestStatus.is_finished(req.status))
            ):
                raise AssertionError(
                    f"step {self.now}: a load owes {rid} a finished_recving, but vLLM "
                    + ("has forgotten it" if req is None else f"has it {req.status.name}, waiting for none")
                )
            if req is not None:
                continue
            known = False
            for tracker in (half.loads, half.stores):
                state = tracker.state(rid)
                if state is None or state not in tracker.spec.live:
                    continue
                known = True
                if tracker.spec.states[state].timeout is None and not self._sent_this_step(tracker, rid):
                    raise AssertionError(
                        f"step {self.now}: {tracker.spec.name} holds {sorted(tracker.held(rid))} for {rid}, which "
                        f"vLLM has forgotten, in '{state}', which no deadline ends"
                    )
            if not known:
                self._seen.discard(rid)

    @staticmethod
    def _sent_this_step(tracker: Tracker, rid: str) -> bool:
        """A store planned by request_finished leaves with the next step's metadata (its only way on is dispatch)."""
        return tracker.accepts(rid, "dispatch")

    def finish_connector(self, r: EngineReport) -> None:
        half = self.connector.scheduler_half
        r.leaked_cpu_holds = half.offload.cpu_pool.holder_count()
        r.live_instances = half.live()
        r.connector = {k: v for k, v in vars(half.stats).items() if k != "outcomes"} | {
            "outcomes": dict(half.stats.outcomes)
        }
        r.faults |= {"copies_failed": self.copier.failed, "reports_lost": self.copier.lost}
        r.faults |= {f"tracker_{k}": v for k, v in half.anomalies().items()}


class MooncakeEngine(Engine):
    """vLLM's Scheduler with kvfsm's Mooncake store connector on the in-process store, whose calls fail at ``fault_rate``.

    On top of :class:`Engine`'s checks: every block a store job or a load
    pins in the worker is one vLLM still gives that job's request (a store
    never reads a block vLLM has freed: delay_free until finished_sending),
    and a request vLLM parks in ``WAITING_FOR_REMOTE_KVS`` is owed its
    answer by a load that holds ``recv_report``, or by the report.
    """

    connector_name = "MooncakeStoreConnector"

    def __init__(
        self, config: EngineConfig = EngineConfig(), seed: int = 0, fault_rate: float = 0.0, lag_rate: float = 0.0
    ) -> None:
        self.master = EmbeddedMaster()
        self.lag_rate = lag_rate
        """Chance per step that the worker's threads are still at work when it reports (loads span steps)."""
        super().__init__(config, seed)
        connector = self.scheduler.connector
        assert isinstance(connector, MooncakeStoreConnector)
        self.connector = connector
        self._worker = MooncakeStoreConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.faulty = FaultyStore(self._worker.store, store_plan(fault_rate, seed))
        self._worker.rebuild_worker(clock=lambda: float(self.now), store=self.faulty)
        self._worker.register_kv_caches(engine_kv_caches(self.kv_cache_config))

    def extra_config(self) -> dict[str, Any]:
        c = self.config
        return {"master_address": self.master.address, "store_timeout": c.store_timeout, "load_timeout": c.load_timeout}

    @property
    def worker(self) -> MooncakeStoreConnector:
        return self._worker

    def connector_busy(self) -> bool:
        return self._worker.worker.live() > 0 or self._worker.worker.report.owed() > 0 or super().connector_busy()

    def settle(self) -> None:
        """Wait (up to a second) until the worker's threads have taken every queued store and load.

        The step count is the deadlines' clock, and a step takes far less than
        Python's thread switch interval: without this, every load would
        expire before a load thread ran, which says nothing about the connector.
        At ``lag_rate`` the step does not wait, so loads and stores span steps
        (aborts land mid-load, some deadlines fire).
        """
        if self.rng.random() < self.lag_rate:
            return
        w = self._worker.worker
        until = time.monotonic() + 1.0
        while w.unfinished_tasks() and time.monotonic() < until:
            time.sleep(0.0001)

    def connector_state(self) -> str:
        w = self._worker.worker
        trackers = {"requests": w.requests, "send": w.send, "load": w.load}
        census = {name: {s: n for s, n in t.census().items() if n} for name, t in trackers.items()}
        holders = sorted(str(h) for h in w.pool.holdings() if h != VLLM)[:6]
        return (
            f"states {census}, first live {[(n, k, st) for n, t in trackers.items() for k, st in t.snapshot()][:6]}, "
            f"reports owed {w.report.owed()}, queued tasks {w.unfinished_tasks()}, worker pool holders {holders}"
        )

    def check_connector(self) -> None:
        w = self._worker.worker
        owners = self.owners()
        for holder, blocks in w.pool.holdings().items():
            if holder == VLLM:
                continue
            # ("store", (request_id, n)) or ("load", (request_id, "load", n)): see MooncakeStoreWorker
            if not (isinstance(holder, tuple) and len(holder) == 2 and isinstance(holder[1], tuple)):
                raise AssertionError(f"step {self.now}: the worker's pool has a holder {holder!r} no job or load names")
            rid = holder[1][0]
            given = {b.block_id for b in owners.get(rid, ())}
            if not set(blocks) <= given:
                raise AssertionError(
                    f"step {self.now}: the worker's {holder} pins blocks {sorted(set(blocks) - given)} that vLLM "
                    f"no longer gives {rid}: a store would read, or a load write, a reused block"
                )
        w.load.live()  # takes the Tracker's lock: a transition a thread is making completes first
        for rid, req in self.scheduler.requests.items():
            if req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            load = w.load.route("request_id", rid)
            if not (
                (load is not None and "recv_report" in w.load.held(load))
                or w.report.owes(rid)
                or rid in self.scheduler.finished_recving_kv_req_ids
            ):
                raise AssertionError(f"step {self.now}: vLLM waits for {rid}'s load, but no load or report owes it")

    def finish_connector(self, r: EngineReport) -> None:
        w = self._worker.worker
        r.live_instances = w.live() + w.report.owed()
        r.leaked_cpu_holds = sum(1 for h in w.pool.holdings() if h != VLLM)
        r.connector = {"outcomes": dict(w.outcomes), **w.sender.stats, **w.loader.stats}
        r.faults |= {f"store_{k}": v for k, v in self.faulty.injected.items()}
        r.faults["bugs"] = len(w.bugs)

    def close(self) -> None:
        """Stop the worker's threads and the embedded master."""
        self._worker.shutdown()
        self.master.stop()


if __name__ == "__main__":  # pragma: no cover - a demonstration: python -m kvfsm.showcase.sim.real
    faulty = EngineConfig(copy_failure_rate=0.05, copy_loss_rate=0.03, duplicate_rate=0.05, late_rate=0.05)
    cpu = RealEngine(faulty, seed=1).run(EngineWorkload(num_requests=300, seed=1))
    mooncake = MooncakeEngine(seed=1, fault_rate=0.05, lag_rate=0.3)
    try:
        store = mooncake.run(EngineWorkload(num_requests=300, seed=1))
    finally:
        mooncake.close()
    print(json.dumps({"CpuOffloadConnector": vars(cpu), "MooncakeStoreConnector": vars(store)}, indent=1, default=str))
