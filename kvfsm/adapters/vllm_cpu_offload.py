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
   parks in ``WAITING_FOR_REMOTE_KVS`` is owed a ``finished_recving``. The
   load spec declares that debt as the resource ``recv_report``, so every way
   out of the load (loaded, failed, refused in phase B, cancelled before it
   was sent, aborted, expired) records the request exactly once in the load
   driver's :class:`~kvfsm.drivers.report.Report`, with the GPU blocks the
   copy did not fill. This file only drains it: the blocks to recompute go to
   the worker in the metadata (vLLM reads ``invalid_block_ids`` *before* it
   calls ``update_connector_output``), and ``update_connector_output`` writes
   the requests into ``finished_recving`` once their blocks are out.

Nothing here names a state of the specs: what may happen next is asked of
the Tracker (``accepts``), what is still under way of the spec (``live``).

The two sides talk only through :class:`CpuOffloadMetadata` (scheduler to
worker) and :class:`CpuOffloadWorkerMeta` (worker to scheduler, inside
``KVConnectorOutput.kv_connector_worker_meta``), as they would across vLLM's
process boundary. Single KV-cache group, one worker (tensor parallel size 1).

This module imports no vLLM. Inside vLLM the two halves run as one
``KVConnectorBase_V1``, ``CpuOffloadConnector`` in
:mod:`kvfsm.adapters.vllm_connector`, which vLLM finds through
``kv_connector_module_path="kvfsm.adapters.vllm"``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from ..drivers.cpu_offload import LOAD_SPEC, STORE_SPEC, CpuOffload
from ..drivers.kv_cache import BlockCopier, Copier, Copy, KVCache
from ..engine import Tracker
from ..errors import ActionError, AnomalyKind
from ..observe import drain_outcomes
from .vllm_api import (
    KVCacheBlocks,
    KVConnectorMetadata,
    KVConnectorOutput,
    Request,
    RequestStatus,
    SchedulerOutput,
)


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

    ``load_errors`` are GPU blocks of loads that ended without filling them
    (failed, refused, cancelled, expired): the worker hands them to vLLM as
    ``invalid_block_ids`` in this step, before vLLM reads ``finished_recving``.
    """

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    load_errors: set[int] = field(default_factory=set)


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
    """Phase B the spec refused (more tokens than pinned, unusable blocks): reported as load errors, recomputed."""
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


def _to_dispatch(tracker: Tracker) -> list[Any]:
    """What this step's metadata carries: every instance the spec lets take ``dispatch`` now (a load after phase
    B, a store planned at request_finished), in the order they began. The tracker is the list, so a request
    that ended since it was planned is simply not in it."""
    return [key for key, _state in tracker.snapshot() if tracker.accepts(key, "dispatch")]


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
        self.report = offload.load.report
        """What the load spec's ``recv_report`` releases recorded for vLLM; drained each step."""
        self.stats = ConnectorStats()
        self._job_ids = itertools.count(1)

    @staticmethod
    def _live(tracker: Tracker, rid: Hashable) -> bool:
        """Whether ``rid`` has an instance in a non-final state: the spec's ``live``, not names copied from it."""
        return tracker.state(rid) in tracker.spec.live

    # -- phase A ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` the CPU cache supplies, and whether the load is async.

        vLLM's docstring asks for no side effects here. The one this call must
        have is the pin: a hit that is only remembered can be evicted before
        phase B. Every way out of the pinned state releases it (see the spec).
        """
        rid = request.request_id
        if self.loads.accepts(rid, "retry"):
            # Phase A again with no phase B in between: allocate_slots failed
            # last time (vLLM says nothing then). The old pin goes first.
            self.loads.fire(rid, "retry")
            self.stats.retries += 1
        elif self._live(self.loads, rid):
            return None, False  # a load for this request is still under way: ask again in a later step
        self.stats.lookups += 1
        first = num_computed_tokens // self.block_size
        # The model must compute at least the last token, so the hit stops before it.
        last = (request.num_tokens - 1) // self.block_size
        hashes = list(request.block_hashes[first:last])
        if not self.offload.cpu_pool.lookup(hashes):
            return 0, False
        # Lookup and pin happen in one action, so nothing can evict in between.
        self.loads.begin(rid, hashes=hashes, first=first)
        pinned = len(self.offload.load.pinned(rid))
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
        first = self.offload.load.first_block(rid)  # where phase A's pinned hit starts, kept with the pin
        if first is None:
            first = request.num_computed_tokens // self.block_size
        n = -(-num_external_tokens // self.block_size)
        gpu_blocks = list(blocks.get_block_ids()[0][first : first + n])
        if num_external_tokens == 0:
            if self.loads.accepts(rid, "skip"):
                self.loads.fire(rid, "skip")
            return
        if not self.loads.accepts(rid, "allocated"):
            # vLLM waits for tokens phase A never offered (it broke the
            # two-phase contract): no load exists to owe the report, so this
            # is the one report made by hand. Skipping it quietly (vLLM's
            # first fix for #39702) would let the model read stale blocks.
            self.stats.loads_refused += 1
            self.report.recv(rid, gpu_blocks)
            return
        try:
            self.loads.fire(rid, "allocated", gpu_blocks=gpu_blocks)
        except ActionError:
            # hold_gpu_dst refused (more tokens than were pinned, unusable
            # blocks): the spec's on_error path released the pin, and undoing
            # recv_report reported the load with every block to recompute.
            self.stats.action_errors += 1
            self.stats.loads_refused += 1

    # -- once per step ------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> CpuOffloadMetadata:
        """Apply preemptions and deadlines, send every load and store planned this step, and the blocks to recompute."""
        for rid in scheduler_output.preempted_req_ids or ():
            # Preemption is never a connector call; this set is how we learn of it.
            if self.loads.accepts(rid, "preempt"):
                self.loads.fire(rid, "preempt")
        self.stats.expired += len(self.loads.poll()) + len(self.stores.poll())
        meta = CpuOffloadMetadata()
        for rid in _to_dispatch(self.loads):
            meta.loads.append(self._dispatch(self.loads, "load_job", rid, self.offload.load.transfer))
        for rid in _to_dispatch(self.stores):
            meta.stores.append(self._dispatch(self.stores, "store_job", rid, self.offload.store.transfer))
        meta.load_errors = self.report.take_invalid()
        self.stats.loads_sent += len(meta.loads)
        self.stats.stores_sent += len(meta.stores)
        self._retire()
        return meta

    def _dispatch(
        self, tracker: Tracker, space: str, rid: str, transfer: Callable[[str], tuple[list[int], list[int]]]
    ) -> TransferJob:
        """Name the copy by a fresh job id (the worker reports job ids) and send it."""
        job = next(self._job_ids)
        tracker.link(rid, space, job)
        tracker.fire(rid, "dispatch")
        src, dst = transfer(rid)
        return TransferJob(job, rid, src, dst)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Apply the worker's reports by job id, then write ``finished_recving`` from the report.

        vLLM calls this before it reads ``finished_recving``. The set comes
        from the load driver's report, never from the worker's output, so a
        late or duplicate report from the worker cannot wake a newer load of
        the same request id (the ABA of vLLM #51637 and #51786): its job id
        names no live instance and is counted by the tracker, not applied.
        """
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, CpuOffloadWorkerMeta):
            stats, load, store = self.stats, self.offload.load, self.offload.store
            ok, blocks, failed = self._tally(
                self.loads, "load_job", load.transfer, meta.loads_done, meta.loads_failed, "load_error"
            )
            stats.loads_done += ok
            stats.blocks_loaded += blocks
            stats.loads_failed += failed
            ok, blocks, failed = self._tally(
                self.stores, "store_job", store.transfer, meta.stores_done, meta.stores_failed, "store_error"
            )
            stats.stores_done += ok
            stats.blocks_stored += blocks
            stats.stores_failed += failed
        _sending, recving = self.report.take_finished()
        connector_output.finished_recving = set(map(str, recving)) or None

    def _tally(
        self,
        tracker: Tracker,
        space: str,
        transfer: Callable[[Hashable], tuple[list[int], list[int]]],
        done: Iterable[int],
        failed: Iterable[int],
        failure: str,
    ) -> tuple[int, int, int]:
        """Apply one direction's reports (jobs done fire ``complete``, jobs failed fire ``failure``):
        returns (copies that succeeded, blocks they copied, copies the worker reported failed)."""
        ok = blocks = bad = 0
        for jobs, event in ((done, "complete"), (failed, failure)):
            for success, count in self._copies_over(tracker, space, transfer, jobs, event):
                if success:
                    ok += 1
                    blocks += count
                elif event == failure:
                    bad += 1
        return ok, blocks, bad

    def _copies_over(
        self,
        tracker: Tracker,
        space: str,
        transfer: Callable[[Hashable], tuple[list[int], list[int]]],
        jobs: Iterable[int],
        event: str,
    ) -> list[tuple[bool, int]]:
        """Apply one of the worker's per-step sets of copy ``jobs`` as one batch: (ended in success?, blocks) for
        each job that named a live copy.

        The set is fired with :meth:`~kvfsm.Tracker.fire_many_by` (one lock,
        batch actions called once). An unknown or late job id is counted by
        the tracker, not applied. An action that raises (``publish``) ends
        its copy the way the spec's ``on_error`` says, and counts as a failure.
        """
        jobs = list(jobs)
        if not jobs:
            return []
        live: dict[Hashable, int] = {}
        for job in jobs:
            rid = tracker.route(space, job)
            if rid is not None and self._live(tracker, rid):
                live[rid] = len(transfer(rid)[1])
        failed: set[Hashable] = set()
        try:
            tracker.fire_many_by(space, event, jobs)
        except ActionError as exc:
            failed = {f.key for f in exc.failures}
            self.stats.action_errors += len(failed)
        out = []
        for rid, blocks in live.items():
            state = tracker.state(rid)
            if rid in failed or state is None:
                out.append((False, 0))
            else:
                out.append((tracker.spec.states[state].final == "success", blocks))
        return out

    # -- the end of a request ----------------------------------------------------

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (called once, before vLLM frees its blocks): end its load, plan its store.

        Returns ``(False, None)``: the store holds its own blocks on the GPU
        side, so vLLM may free the request's at once. A load vLLM still waits
        for reports itself, through ``recv_report``, whichever way it ends.
        """
        rid = request.request_id
        event = "abort" if request.status == RequestStatus.FINISHED_ABORTED else "finish"
        if self.loads.accepts(rid, event):
            self.loads.fire(rid, event)
        self._plan_store(request, block_ids)
        return False, None

    def _plan_store(self, request: Request, block_ids: Sequence[int]) -> None:
        """Take the request's computed full blocks that the CPU cache lacks, as many as there is room for."""
        rid = request.request_id
        if self._live(self.stores, rid):
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

    # -- housekeeping --------------------------------------------------------------

    def _retire(self) -> None:
        """Drain finished instances (their job ids stop naming them) and count outcomes."""
        drain_outcomes(self.loads, self.stats.outcomes, prefix="load.")
        drain_outcomes(self.stores, self.stats.outcomes, prefix="store.")

    def live(self) -> int:
        """Load and store instances not yet in a final state, and reports not yet handed to vLLM."""
        return self.loads.live() + self.stores.live() + self.report.owed()

    def anomalies(self) -> dict[str, int]:
        """The trackers' anomalies by kind (every kind ``kvfsm.Anomaly`` has: late, duplicate or unknown job ids,
        forced releases, …); an event the spec ignores is not one."""
        kinds = get_args(AnomalyKind)
        return {kind: self.loads.counts.get(kind, 0) + self.stores.counts.get(kind, 0) for kind in kinds}

    def shutdown(self) -> None:
        """Abort everything and release all blocks (a copy still running is abandoned to its fate)."""
        self.loads.close()
        self.stores.close()
        self._retire()


class CpuOffloadWorker:
    """The worker-side half: runs the copies the metadata names and reports them by job id.

    It decides nothing about requests: which loads are over and which blocks
    vLLM must recompute is the scheduler half's report, shipped in the
    metadata (``load_errors``) and written into ``finished_recving`` by
    :meth:`CpuOffloadScheduler.update_connector_output`.
    """

    def __init__(self, offload: CpuOffload, copier: Copier | None = None) -> None:
        self.gpu_cache = offload.gpu_cache
        self.cpu_cache = offload.cpu_cache
        self.num_cpu_blocks = offload.cpu_pool.num_blocks
        self.copier: Copier = copier if copier is not None else BlockCopier()
        self._meta: CpuOffloadMetadata | None = None
        self._jobs: dict[int, str] = {}
        """Copies submitted and not yet over: job id -> 'load' or 'store'."""
        self._report = CpuOffloadWorkerMeta()

    def attach(self, gpu_cache: KVCache) -> None:
        """Copy to and from ``gpu_cache``, the engine's own KV cache, with a CPU tier of the same per-block shape."""
        self.gpu_cache = gpu_cache
        pinned = gpu_cache.device.type == "cuda"
        self.cpu_cache = KVCache.like(gpu_cache, self.num_cpu_blocks, "cpu", pin_memory=pinned)

    def _caches(self) -> tuple[KVCache, KVCache]:
        if self.gpu_cache.device.type == "meta":
            raise RuntimeError(
                "the worker has no KV cache to copy: the engine must register its cache first "
                "(vLLM calls register_kv_caches before the first step)"
            )
        return self.gpu_cache, self.cpu_cache

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, CpuOffloadMetadata):
            raise TypeError(f"expected CpuOffloadMetadata, got {type(connector_metadata).__name__}")
        self._meta = connector_metadata

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, forward_context: object, **kwargs: Any) -> None:
        """Start this step's loads. They are async: vLLM keeps each request waiting until it is reported."""
        for job in self._meta.loads if self._meta else ():
            gpu, cpu = self._caches()
            self._jobs[job.job_id] = "load"
            self.copier.submit(Copy(job.job_id, cpu, job.src_blocks, gpu, job.dst_blocks))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request runs only after its whole load is reported."""

    def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object, **kwargs: Any) -> None:
        """Nothing per layer: stores copy whole blocks of finished requests in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        """Start this step's stores (blocks of requests that finished, which no forward writes any more)."""
        for job in self._meta.stores if self._meta else ():
            gpu, cpu = self._caches()
            self._jobs[job.job_id] = "store"
            self.copier.submit(Copy(job.job_id, gpu, job.src_blocks, cpu, job.dst_blocks))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Collect the copies that are over (by job id, for the scheduler half); ``(None, None)`` to vLLM.

        Stores never delay a free, so nothing is ever finished sending; what
        finished receiving is written by the scheduler half from its report.
        """
        for job_id, error in self.copier.poll():
            kind = self._jobs.pop(job_id)
            if kind == "load":
                (self._report.loads_done if error is None else self._report.loads_failed).append(job_id)
            else:
                (self._report.stores_done if error is None else self._report.stores_failed).append(job_id)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of loads that ended without filling them; vLLM recomputes them."""
        return set(self._meta.load_errors) if self._meta else set()

    def build_connector_worker_meta(self) -> CpuOffloadWorkerMeta | None:
        """The job ids that ended this step, for ``update_connector_output`` on the scheduler side."""
        report, self._report = self._report, CpuOffloadWorkerMeta()
        return (
            report if (report.loads_done or report.loads_failed or report.stores_done or report.stores_failed) else None
        )
