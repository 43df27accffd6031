"""A CPU-offload KV connector in the shape of vLLM's ``KVConnectorBase_V1``, built on kvfsm Trackers.

Read it as the template for a connector of your own. Each request's KV
lifecycle lives in a Tracker bound to a spec, so this file never decides *when*
to free anything: it turns vLLM's calls into events, and the spec's derived
releases do the rest.

- ``specs/cpu_offload_load.yaml``: a CPU prefix hit, pinned in phase A
  (``get_num_new_matched_tokens``), planned in phase B
  (``update_state_after_alloc``), sent in ``build_connector_meta``, finished
  when the worker reports it in ``update_connector_output``.
- ``specs/cpu_offload_store.yaml``: a finished request's full blocks, taken in
  ``request_finished``, sent, and published in the CPU cache once copied.

Three habits make it robust against the failure reports in vLLM's history:

1. **Pin at the moment of the lookup** (seed 003): the hit is a state that
   holds the CPU blocks, and every way out releases them.
2. **Name jobs, not requests**: the worker reports job ids, unique per load
   and store; a late or duplicate report of an old job names no live
   instance and is counted, never applied to a newer generation of the same
   request id. The ``finished_recving`` vLLM acts on is rebuilt from the jobs.
3. **Never leave vLLM waiting, never let it read garbage**: a request vLLM
   parks in ``WAITING_FOR_REMOTE_KVS`` appears in ``finished_recving`` exactly
   once, even when its load was cancelled before it was sent, refused or
   expired; the GPU blocks of a load that did not happen are reported as load
   errors, so vLLM recomputes them. Both go through the worker, because vLLM
   reads ``invalid_block_ids`` *before* it calls ``update_connector_output``.

The two sides talk only through :class:`CpuOffloadMetadata` (scheduler to
worker) and :class:`CpuOffloadWorkerMeta` (worker to scheduler, inside
``KVConnectorOutput.kv_connector_worker_meta``), as they would across vLLM's
process boundary. Single KV-cache group, one worker (tensor parallel size 1).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ..drivers.cpu_offload import LOAD_SPEC, STORE_SPEC, CpuOffload
from ..drivers.kv_cache import BlockCopier, Copier, Copy
from ..engine import Tracker
from ..errors import ActionError
from .vllm_api import (
    KVCacheBlocks,
    KVConnectorMetadata,
    KVConnectorOutput,
    Request,
    RequestStatus,
    SchedulerOutput,
)

LOAD_LIVE = ("pinned", "load_pending", "loading", "abandoned")
"""States of the load machine that are not final."""


@dataclass(frozen=True)
class TransferJob:
    """One copy the worker must run: block ``src_blocks[i]`` to ``dst_blocks[i]``."""

    job_id: int
    request_id: str
    src_blocks: list[int]
    dst_blocks: list[int]


@dataclass
class CpuOffloadMetadata(KVConnectorMetadata):
    """Scheduler to worker, once per step: loads are CPU to GPU, stores GPU to CPU.

    ``failed_loads`` are loads vLLM waits for that will not happen (refused,
    cancelled before they were sent, expired): the worker reports each as a
    failed load at once, with its ``dst_blocks`` as load errors.
    """

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    failed_loads: list[TransferJob] = field(default_factory=list)


@dataclass
class CpuOffloadWorkerMeta:
    """Worker to scheduler, once per step: which jobs are over, by job id (failed ones included)."""

    loads_done: list[int] = field(default_factory=list)
    loads_failed: list[int] = field(default_factory=list)
    stores_done: list[int] = field(default_factory=list)
    stores_failed: list[int] = field(default_factory=list)


@dataclass
class ConnectorStats:
    """What the scheduler side did, for reports and tests."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0
    """Tokens pinned by phase A (a retried request counts again)."""
    retries: int = 0
    """Phase A asked again while its earlier pin was still held (allocation had failed)."""
    loads_sent: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    loads_refused: int = 0
    """Phase B asked for tokens this connector had not pinned: reported as load errors, recomputed."""
    blocks_loaded: int = 0
    stores_sent: int = 0
    stores_done: int = 0
    stores_failed: int = 0
    stores_without_room: int = 0
    """Stores cut short (or skipped) because every CPU block was referenced."""
    blocks_stored: int = 0
    duplicate_finishes: int = 0
    expired: int = 0
    action_errors: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    """Final states reached, as 'machine.state' -> count."""


class CpuOffloadScheduler:
    """The scheduler-side half: vLLM's five scheduler-side connector calls, on two Trackers."""

    def __init__(
        self,
        offload: CpuOffload,
        *,
        clock: Callable[[], float] = time.monotonic,
        load_timeout: float | None = None,
        store_timeout: float | None = None,
    ) -> None:
        self.offload = offload
        self.block_size = offload.layout.block_size
        # The scheduler calls a connector from one thread only: no lock needed.
        self.loads = Tracker(
            LOAD_SPEC,
            offload.load,
            clock=clock,
            params=None if load_timeout is None else {"load_timeout": load_timeout},
            spaces=["load_job"],
            threadsafe=False,
        )
        self.stores = Tracker(
            STORE_SPEC,
            offload.store,
            clock=clock,
            params=None if store_timeout is None else {"store_timeout": store_timeout},
            spaces=["store_job"],
            threadsafe=False,
        )
        self.stats = ConnectorStats()
        self._job_ids = itertools.count(1)
        self._first_block: dict[str, int] = {}
        """Phase A's ``num_computed_tokens // block_size``: where the pinned blocks start in the request."""
        self._awaited: dict[str, list[int]] = {}
        """Loads vLLM waits for in WAITING_FOR_REMOTE_KVS -> their GPU blocks; each must reach finished_recving."""
        self._loads_to_send: list[str] = []
        self._stores_to_send: list[str] = []
        self._give_up: list[TransferJob] = []
        """Loads vLLM waits for that will not happen, for the next metadata."""
        self._given_up: dict[int, str] = {}
        """Job ids of those, until the worker reports them."""

    # -- phase A ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` the CPU cache supplies, and whether the load is async.

        vLLM's docstring asks for no side effects here. The one this call must
        have is the pin: a hit that is only remembered can be evicted before
        phase B. Every way out of the pinned state releases it (see the spec).
        """
        rid = request.request_id
        state = self.loads.state(rid)
        if state == "pinned":
            # Phase A again with no phase B in between: allocate_slots failed
            # last time (vLLM says nothing then). The old pin goes first.
            self.loads.fire(rid, "retry")
            self.stats.retries += 1
        elif state in LOAD_LIVE:
            return None, False  # a load for this request is still under way: ask again in a later step
        self.stats.lookups += 1
        first = num_computed_tokens // self.block_size
        # The model must compute at least the last token, so the hit stops before it.
        last = (request.num_tokens - 1) // self.block_size
        hashes = list(request.block_hashes[first:last])
        if not self.offload.cpu_pool.lookup(hashes):
            return 0, False
        # Lookup and pin happen in one action, so nothing can evict in between.
        self.loads.begin(rid, hashes=hashes)
        pinned = len(self.offload.load.pinned(rid))
        self._first_block[rid] = first
        self.stats.hits += 1
        self.stats.hit_tokens += pinned * self.block_size
        return (first + pinned) * self.block_size - num_computed_tokens, True

    # -- phase B ---------------------------------------------------------------

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """allocate_slots succeeded: plan the load of ``num_external_tokens`` into the request's new GPU blocks.

        Decided on ``num_external_tokens``, never on whether ``blocks`` is
        empty. vLLM calls this again after an async load with 0 tokens; that
        call finds no pinned hit and does nothing.
        """
        rid = request.request_id
        first = self._first_block.pop(rid, request.num_computed_tokens // self.block_size)
        n = -(-num_external_tokens // self.block_size)
        gpu_blocks = list(blocks.get_block_ids()[0][first : first + n])
        if self.loads.state(rid) != "pinned":
            if num_external_tokens > 0:
                self._refuse(rid, gpu_blocks)
            return
        if num_external_tokens == 0:
            self.loads.fire(rid, "skip")
            return
        try:
            self.loads.fire(rid, "allocated", gpu_blocks=gpu_blocks)
        except ActionError:
            # plan_load refused (more tokens than were pinned): the spec's
            # on_error path already released the pin; make vLLM recompute.
            self.stats.action_errors += 1
            self._refuse(rid, gpu_blocks)
            return
        self._awaited[rid] = gpu_blocks
        self._loads_to_send.append(rid)

    def _refuse(self, rid: str, gpu_blocks: list[int]) -> None:
        """vLLM will wait for tokens no load will supply: have them reported as load errors.

        Skipping the load quietly (what vLLM's first fix for #39702 did) would
        let the model read whatever the GPU blocks held before.
        """
        self.stats.loads_refused += 1
        self._give_up_load(rid, gpu_blocks)

    def _give_up_load(self, rid: str, invalid_blocks: list[int]) -> None:
        """vLLM waits for ``rid``'s load: have the worker report it over, failed on ``invalid_blocks``."""
        self._give_up.append(TransferJob(next(self._job_ids), rid, [], invalid_blocks))

    # -- once per step ------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CpuOffloadMetadata:
        """Apply preemptions and deadlines, then send every load and store planned this step."""
        for rid in scheduler_output.preempted_req_ids or ():
            # Preemption is never a connector call; this set is how we learn of it.
            if self.loads.state(rid) in ("pinned", "load_pending"):
                self.loads.fire(rid, "preempt")
                self._awaited.pop(rid, None)  # a preempted request is not waiting for a load
        self._fire_deadlines()
        meta = CpuOffloadMetadata()
        for rid in self._loads_to_send:
            if self.loads.state(rid) != "load_pending":
                continue  # the request ended since phase B
            job = next(self._job_ids)
            self.loads.link(rid, "load_job", job)
            self.loads.fire(rid, "dispatch")
            src, dst = self.offload.load.transfer(rid)
            meta.loads.append(TransferJob(job, rid, src, dst))
        for rid in self._stores_to_send:
            if self.stores.state(rid) != "planned":
                continue
            job = next(self._job_ids)
            self.stores.link(rid, "store_job", job)
            self.stores.fire(rid, "dispatch")
            src, dst = self.offload.store.transfer(rid)
            meta.stores.append(TransferJob(job, rid, src, dst))
        meta.failed_loads, self._give_up = self._give_up, []
        self._given_up.update((job.job_id, job.request_id) for job in meta.failed_loads)
        self._loads_to_send.clear()
        self._stores_to_send.clear()
        self.stats.loads_sent += len(meta.loads)
        self.stats.stores_sent += len(meta.stores)
        self._retire()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Apply the worker's reports by job id, then rebuild ``finished_recving`` from them.

        vLLM calls this before it reads ``finished_recving``: rebuilt from job
        ids, a late or duplicate request id from the worker cannot wake a newer
        load of the same request id (the ABA of vLLM #51637 and #51786).
        """
        meta = connector_output.kv_connector_worker_meta
        recving: set[str] = set()
        if isinstance(meta, CpuOffloadWorkerMeta):
            for job in meta.loads_done:
                self._load_over(job, "complete", recving)
            for job in meta.loads_failed:
                self._load_over(job, "load_error", recving)
            for job in meta.stores_done:
                self._store_over(job, "complete")
            for job in meta.stores_failed:
                self._store_over(job, "store_error")
        connector_output.finished_recving = recving or None

    def _load_over(self, job: int, event: str, recving: set[str]) -> None:
        given_up = self._given_up.pop(job, None)
        if given_up is not None:
            recving.add(given_up)
            return
        rid = cast(str | None, self.loads.route("load_job", job))  # keys are request ids
        if rid is None or self.loads.state(rid) not in ("loading", "abandoned"):
            self.loads.fire_by("load_job", job, event)  # late or duplicate: counted by the tracker, not applied
            return
        gpu_blocks = self._awaited.pop(rid, None)  # None: the request ended mid-copy
        self.loads.fire(rid, event)
        recving.add(rid)
        if gpu_blocks is not None and event == "complete":
            self.stats.loads_done += 1
            self.stats.blocks_loaded += len(gpu_blocks)
        elif gpu_blocks is not None:
            self.stats.loads_failed += 1  # the worker reported the blocks as load errors itself

    def _store_over(self, job: int, event: str) -> None:
        rid = self.stores.route("store_job", job)
        was = self.stores.state(rid) if rid is not None else None
        if rid is None or was not in ("storing", "abandoned"):
            self.stores.fire_by("store_job", job, event)  # late or duplicate: counted by the tracker, not applied
            return
        blocks = len(self.offload.store.transfer(rid)[1])
        try:
            state = self.stores.fire(rid, event)
        except ActionError:
            self.stats.action_errors += 1  # publish raised; the spec freed the blocks unpublished
            state = "failed"
        if was == "storing" and state == "stored":
            self.stats.stores_done += 1
            self.stats.blocks_stored += blocks
        elif was == "storing":
            self.stats.stores_failed += 1

    def _fire_deadlines(self) -> None:
        """Loads and stores the worker never reported: the spec released them; vLLM still waits for the loads."""
        for key, _event, _state in self.loads.poll():
            rid = cast(str, key)
            self.stats.expired += 1
            self._give_up_load(rid, self._awaited.pop(rid, []))  # no blocks if the request already ended
        self.stats.expired += len(self.stores.poll())

    # -- the end of a request ----------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (called once, before vLLM frees its blocks): end its load, plan its store.

        Returns ``(False, None)``: the store holds its own references on the
        GPU blocks, so vLLM may free the request's at once.
        """
        rid = request.request_id
        state = self.loads.state(rid)
        if state in LOAD_LIVE:
            self.loads.fire(rid, "abort" if request.status == RequestStatus.FINISHED_ABORTED else "finish")
            if state == "load_pending":  # vLLM waits for a load that will never be sent
                self._give_up_load(rid, [])
            self._awaited.pop(rid, None)  # from here on the request's blocks are not ours to report
        self._first_block.pop(rid, None)
        self._plan_store(request, block_ids)
        return False, None

    def _plan_store(self, request: Request, block_ids: Sequence[int]) -> None:
        """Take the request's computed full blocks that the CPU cache lacks, as many as there is room for."""
        rid = request.request_id
        if self.stores.state(rid) in ("planned", "storing", "abandoned"):
            self.stats.duplicate_finishes += 1  # request_finished twice for one request (vLLM #33377)
            return
        full = min(request.num_computed_tokens // self.block_size, len(block_ids), len(request.block_hashes))
        pool = self.offload.cpu_pool
        todo = [
            (b, h)
            for b, h in zip(block_ids[:full], request.block_hashes[:full], strict=True)
            if pool.cached_block(h) is None
        ]
        if len(todo) > pool.num_free:
            self.stats.stores_without_room += 1
            todo = todo[: pool.num_free]
        if not todo:
            return
        try:
            self.stores.begin(rid, gpu_blocks=[b for b, _ in todo], hashes=[h for _, h in todo])
        except ActionError:
            self.stats.action_errors += 1  # nothing is held: the tracker undid the acquires
            return
        self._stores_to_send.append(rid)

    # -- housekeeping --------------------------------------------------------------

    def _retire(self) -> None:
        """Drain finished instances (their job ids stop naming them) and count outcomes."""
        out = self.stats.outcomes
        for machine, tracker in (("load", self.loads), ("store", self.stores)):
            for _rid, final in tracker.finished():
                name = f"{machine}.{final}"
                out[name] = out.get(name, 0) + 1

    def live(self) -> int:
        """Load and store instances not yet in a final state."""
        return self.loads.live() + self.stores.live()

    def anomalies(self) -> dict[str, int]:
        """Events dropped because they named no live instance (late, duplicate or unknown job ids)."""
        return {
            kind: self.loads.counts[kind] + self.stores.counts[kind]
            for kind in ("unknown", "stale", "ignored", "forced")
        }

    def shutdown(self) -> None:
        """Abort everything and release all references (a copy still running is abandoned to its fate)."""
        self.loads.close()
        self.stores.close()
        self._retire()


class CpuOffloadWorker:
    """The worker-side half: runs the copies the metadata names and reports them by job id."""

    def __init__(self, offload: CpuOffload, copier: Copier | None = None) -> None:
        self.gpu_cache = offload.gpu_cache
        self.cpu_cache = offload.cpu_cache
        self.copier: Copier = copier if copier is not None else BlockCopier()
        self._meta: CpuOffloadMetadata | None = None
        self._jobs: dict[int, tuple[str, TransferJob]] = {}
        self._report = CpuOffloadWorkerMeta()
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, CpuOffloadMetadata):
            raise TypeError(f"expected CpuOffloadMetadata, got {type(connector_metadata).__name__}")
        self._meta = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, forward_context: object, **kwargs: Any) -> None:
        """Start this step's loads. They are async: vLLM keeps each request waiting until it is reported."""
        for job in self._meta.failed_loads if self._meta else ():
            self._recving.add(job.request_id)  # vLLM waits for it: over, and failed on these blocks
            self._report.loads_failed.append(job.job_id)
            self._load_errors.update(job.dst_blocks)
        for job in self._meta.loads if self._meta else ():
            self._jobs[job.job_id] = ("load", job)
            self.copier.submit(Copy(job.job_id, self.cpu_cache, job.src_blocks, self.gpu_cache, job.dst_blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only after its whole load is reported."""

    def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object, **kwargs: Any) -> None:
        """Nothing per layer: stores copy whole blocks of finished requests in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Start this step's stores (blocks of requests that finished, which no forward writes any more)."""
        for job in self._meta.stores if self._meta else ():
            self._jobs[job.job_id] = ("store", job)
            self.copier.submit(Copy(job.job_id, self.gpu_cache, job.src_blocks, self.cpu_cache, job.dst_blocks))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)``: stores never delay a free, so sending is always None."""
        for job_id, error in self.copier.poll():
            kind, job = self._jobs.pop(job_id)
            if kind == "load":
                self._recving.add(job.request_id)  # reported even when it failed, as vLLM requires
                if error is None:
                    self._report.loads_done.append(job_id)
                else:
                    self._report.loads_failed.append(job_id)
                    self._load_errors.update(job.dst_blocks)
            else:
                (self._report.stores_done if error is None else self._report.stores_failed).append(job_id)
        recving, self._recving = self._recving, set()
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks whose load failed since the last call; vLLM recomputes them."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> CpuOffloadWorkerMeta | None:
        """The job ids that ended this step, for ``update_connector_output`` on the scheduler side."""
        report, self._report = self._report, CpuOffloadWorkerMeta()
        return (
            report if (report.loads_done or report.loads_failed or report.stores_done or report.stores_failed) else None
        )
