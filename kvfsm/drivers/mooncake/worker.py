"""A Mooncake store connector worker shaped like vLLM's: a sending thread, load threads, one step call.

The scheduler side calls :meth:`MooncakeStoreWorker.save` for blocks to
store, :meth:`lookup` / :meth:`start_load` for a prefix to load (or
:meth:`load_order` when the scheduler looked it up in its own process), and
:meth:`get_finished` once per step, which fires due deadlines and reports
``finished_sending``, ``finished_recving`` and invalid block ids (vLLM's
``get_finished`` and ``get_block_ids_with_load_errors``). The threads only
fire events; every pin, queue task and store call happens in the drivers'
actions, under the Trackers, so a store call that raises or returns a
negative code ends its job in ``failed`` with everything released.

What vLLM is owed is declared in the specs and recorded by the drivers'
releases in one :class:`~kvfsm.drivers.report.Report`: a load's
``recv_report`` reports it (with the blocks it did not fill) on every way
out, and a request's ``send_report`` reports it ``finished_sending`` once
:meth:`request_finished` was called and the engine saw its last store job
end (vLLM's ``stored_requests`` counter: the request spec owns its jobs).
``get_finished`` only drains it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence

from ...engine import Tracker
from ...errors import ActionError, Failure, IllegalTransition
from ...observe import drain_outcomes
from ...spec import Spec, load
from ...spec.bundled import SPECS
from ...spec.model import split_params
from ..report import Finished, Report
from .buffer import BlockBuffer
from .driver import BlockHash, StoreLoader, StoreRequests, StoreSender
from .store import KVStore

log = logging.getLogger(__name__)

REQUEST_SPEC = "mooncake_store_request.yaml"
SEND_SPEC = "mooncake_store_send.yaml"
LOAD_SPEC = "mooncake_store_load.yaml"
_STOP = object()


@functools.cache
def bundled_spec(name: str) -> Spec:
    """A spec shipped with kvfsm (see :mod:`kvfsm.spec.bundled`), loaded once."""
    return load(SPECS / name)


class MooncakeStoreWorker:
    """Three Trackers (requests owning their store jobs, store jobs, loads) over one store and one registered
    block buffer, with vLLM's threads.

    ``sender``/``loader`` default to the drivers in this package; tests pass
    others (for example a copy with a known bug) to show what the specs catch.
    Either way both record into the worker's one :attr:`report`.
    ``start=False`` leaves the threads stopped until :meth:`start` (jobs queue
    up meanwhile). Call :meth:`close` to stop the threads and release
    everything still held.
    """

    def __init__(
        self,
        store: KVStore,
        buffer: BlockBuffer,
        *,
        prefix: str = "kv",
        load_threads: int = 2,
        params: Mapping[str, float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sender: StoreSender | None = None,
        loader: StoreLoader | None = None,
        register: bool = True,
        start: bool = True,
    ) -> None:
        self.store = store
        self.buffer = buffer
        self.pool = buffer.pool
        self.report = Report()
        """What the drivers' releases recorded for vLLM; :meth:`get_finished` drains it."""
        self.sender = sender or StoreSender(store, buffer, prefix=prefix)
        self.loader = loader or StoreLoader(store, buffer, prefix=prefix)
        self.loader.report = self.report
        send_spec, load_spec = bundled_spec(SEND_SPEC), bundled_spec(LOAD_SPEC)
        send_params, load_params = split_params(params, send_spec, load_spec)
        self.requests = Tracker(bundled_spec(REQUEST_SPEC), StoreRequests(self.report), clock=clock)
        """One instance per request that saved, owning its store jobs: reports finished_sending after the last."""
        self.send = Tracker(send_spec, self.sender, clock=clock, params=send_params, parent=self.requests)
        self.load = Tracker(load_spec, self.loader, clock=clock, params=load_params, spaces=["request_id"])
        self.failures: list[Failure] = []
        """Every action failure the trackers reported (store errors, injected faults), oldest first."""
        self.bugs: list[BaseException] = []
        """Errors that mean a bug rather than a failed store call (an illegal event from a thread)."""
        self.outcomes: Counter[str] = Counter()
        """Final states of drained store jobs and loads, as ``send:stored``, ``load:failed``, ..."""
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self._closed = False
        self._registered = False
        if register:
            rc = store.register_buffer(buffer.kv.data_ptr(), buffer.nbytes)
            if rc < 0:
                raise RuntimeError(f"register_buffer of the KV buffer ({buffer.nbytes} bytes) returned {rc}")
            self._registered = True
        self._threads = [threading.Thread(target=self._send_loop, name="mooncake-store-send", daemon=True)]
        self._threads += [
            threading.Thread(target=self._load_loop, name=f"mooncake-store-load-{i}", daemon=True)
            for i in range(load_threads)
        ]
        if start:
            self.start()

    def start(self) -> None:
        """Start the sending and load threads (done by the constructor unless ``start=False``)."""
        for t in self._threads:
            if not t.is_alive():
                t.start()

    # -- the scheduler's side --------------------------------------------------

    def save(self, request_id: Hashable, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]) -> Hashable:
        """Store ``block_ids`` under keys from ``block_hashes``: a new store job, pinned and queued.

        The request must hold the blocks (the pool refuses to pin free ones).
        Returns the job id; a job whose pin or enqueue failed is already final.
        """
        job = (request_id, next(self._seq))
        try:
            if self.requests.state(request_id) is None:  # its first save (scheduler thread only: no race)
                self.requests.begin(request_id)
            self.send.begin(job, request_id=request_id, block_ids=list(block_ids), block_hashes=list(block_hashes))
            self.send.fire(job, "enqueue")
        except ActionError as exc:
            self._failed(exc)
        return job

    def request_finished(self, request_id: Hashable) -> bool:
        """The request is done on the scheduler; True if store jobs still pin its blocks (vLLM's delay_free).

        Either way it is reported in ``Finished.sending`` once no job pins its blocks.
        """
        try:
            if self.requests.state(request_id) is None:  # it never saved: nothing pins its blocks
                self.requests.begin(request_id)
            return self.requests.fire(request_id, "finish") not in ("sent", "aborted")
        except ActionError as exc:
            self._failed(exc)
            return self.requests.state(request_id) not in (None, "sent", "aborted")

    def lookup(self, request_id: Hashable, block_hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of the request the store holds (0 on a lookup error).

        A miss is finished here. A hit stays open until :meth:`start_load`
        (with the allocated blocks, or ``[]`` to give it up), :meth:`abort`,
        or the request's next lookup, which replaces it.
        """
        try:
            load_id = self._new_load(request_id)
            self.load.fire(load_id, "lookup", request_id=request_id, block_hashes=list(block_hashes))
        except ActionError as exc:
            self._failed(exc)
            return 0
        hits = self.loader.hits(load_id)
        if not hits:
            self.load.fire(load_id, "miss")
        return hits

    def load_order(self, request_id: Hashable, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Fill ``block_ids`` with the prefix a scheduler in another process found and allocated blocks for.

        vLLM waits for this load from the call on (the spec's ``order`` owes
        the report first). The worker looks the prefix up again, taking read
        leases, and loads on a load thread; whatever happens, ``Finished.recving``
        reports the request once, with every block not filled invalid: a
        lookup that fails, or a hit evicted since the scheduler's, reports
        them all.
        """
        try:
            load_id = self._new_load(request_id)
            self.load.fire(load_id, "order", request_id=request_id, block_ids=list(block_ids))
            self.load.fire(load_id, "lookup", request_id=request_id, block_hashes=list(block_hashes))
            self.load.fire(load_id, "allocate", block_ids=list(block_ids))
        except ActionError as exc:
            self._failed(exc)

    def _new_load(self, request_id: Hashable) -> Hashable:
        """Begin a load of ``request_id``, linked by its id; the request's earlier load, if any, is aborted."""
        load_id = (request_id, "load", next(self._seq))
        earlier = self.load.route("request_id", request_id)
        if earlier is not None:  # vLLM asks again each step a request waits: the new lookup replaces it
            self.load.fire(earlier, "abort")
        self.load.begin(load_id)
        self.load.link(load_id, "request_id", request_id)
        return load_id

    def start_load(self, request_id: Hashable, block_ids: Sequence[int]) -> None:
        """Fill ``block_ids`` (allocated by the scheduler for the hit) from the store, on a load thread.

        An empty ``block_ids`` gives the hit up. Otherwise, whatever happens,
        the spec's ``recv_report`` reports the request in ``Finished.recving``
        once, with the blocks not filled in ``Finished.invalid_blocks`` (all of
        them when pinning or queueing failed).
        """
        try:
            if block_ids:
                self.load.fire_by("request_id", request_id, "allocate", block_ids=list(block_ids))
            else:
                self.load.fire_by("request_id", request_id, "miss")
        except ActionError as exc:
            self._failed(exc)

    def abort(self, request_id: Hashable) -> None:
        """Drop the request's pending stores and its load; their pins and queue tasks are released."""
        self._end_request(request_id, "abort")

    def preempt(self, request_id: Hashable) -> None:
        """Like :meth:`abort` (vLLM drops a preempted request's pending stores); jobs end ``preempted``."""
        self._end_request(request_id, "preempt")

    def get_finished(self) -> Finished:
        """One scheduler step: fire due deadlines, drain finished jobs and loads, report what vLLM is owed."""
        for tracker in (self.send, self.load):
            try:
                tracker.poll()
            except ActionError as exc:
                self._failed(exc)
        drain_outcomes(self.requests, self.outcomes, prefix="request:")
        drain_outcomes(self.send, self.outcomes, prefix="send:")
        drain_outcomes(self.load, self.outcomes, prefix="load:")
        return self.report.take()

    # -- shutdown ------------------------------------------------------------------

    def close(self, timeout: float = 10.0) -> None:
        """Stop the threads (after their current job), abort everything live, unregister the pool's buffer."""
        if self._closed:
            return
        self._closed = True
        running = [t for t in self._threads if t.is_alive()]
        for t in running:  # one stop marker per running thread, on its own queue
            (self.sender.queue if t is self._threads[0] else self.loader.queue).put(_STOP)
        for t in running:
            t.join(timeout)
        for tracker in (self.send, self.requests, self.load):  # jobs first: their requests then report
            try:
                tracker.close()
            except ActionError as exc:
                self._failed(exc)
        if self._registered:
            self.store.unregister_buffer(self.buffer.kv.data_ptr())

    def __enter__(self) -> MooncakeStoreWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading back ------------------------------------------------------------

    def live(self) -> int:
        """Store jobs and loads not yet final."""
        return self.send.live() + self.load.live()

    def unfinished_tasks(self) -> int:
        """Queue tasks not yet done, both queues (``queue.Queue.unfinished_tasks``)."""
        return self.sender.queue.unfinished_tasks + self.loader.queue.unfinished_tasks

    def stats(self) -> dict[str, int]:
        """What the worker did, a snapshot: store jobs and loads by how they ended, the blocks and bytes moved.

        Final states count whether or not :meth:`get_finished` drained them
        yet; ``live`` is what is not final, ``owed`` the reports not yet taken.
        """
        ended = Counter(self.outcomes)
        for name, tracker in (("send", self.send), ("load", self.load)):
            for state, n in tracker.census().items():
                if n and tracker.spec.states[state].is_final:
                    ended[f"{name}:{state}"] += n
        return {
            "stores_done": ended["send:stored"],
            "stores_failed": ended["send:failed"] + ended["send:expired"],
            "stores_dropped": ended["send:aborted"] + ended["send:preempted"],
            "blocks_stored": self.sender.stats["blocks_put"],
            "blocks_deduped": self.sender.stats["blocks_deduped"],
            "bytes_gathered": self.sender.stats["bytes_gathered"],
            "loads_done": ended["load:loaded"],
            "loads_failed": ended["load:failed"] + ended["load:expired"],
            "loads_aborted": ended["load:aborted"],
            "blocks_loaded": self.loader.stats["blocks_loaded"],
            "bytes_scattered": self.loader.stats["bytes_scattered"],
            "action_errors": len(self.failures),
            "bugs": len(self.bugs),
            "live": self.live(),
            "owed": self.report.owed(),
        }

    # -- internals -------------------------------------------------------------------

    def _end_request(self, request_id: Hashable, event: str) -> None:
        if self.requests.state(request_id) is not None:  # its store jobs hear of it from the request (owns: forward)
            try:
                self.requests.fire(request_id, event)
            except ActionError as exc:
                self._failed(exc)
        load_id = self.load.route("request_id", request_id)
        if load_id is None:
            return
        try:
            self.load.fire(load_id, "abort")
        except ActionError as exc:
            self._failed(exc)

    def _failed(self, exc: ActionError) -> None:
        with self._lock:
            self.failures.extend(exc.failures)
        for f in exc.failures:
            log.debug("%s", f)

    def _send_loop(self) -> None:
        self._run(self.sender.queue, ("check", "put"), self.send)

    def _load_loop(self) -> None:
        self._run(self.loader.queue, ("load",), self.load)

    def _run(self, q: queue.Queue[Hashable], events: tuple[str, ...], tracker: Tracker) -> None:
        """Take keys off ``q`` and fire ``events`` in order, stopping at a final state.

        A key that finished meanwhile (aborted, expired) ignores them; once
        :meth:`close` has begun, keys are skipped (close aborts them).
        """
        while True:
            key = q.get()
            if key is _STOP:
                q.task_done()  # the stop marker's own task, never a job's
                return
            if self._closed:
                continue
            for event in events:
                try:
                    state = tracker.fire(key, event)
                except ActionError as exc:
                    self._failed(exc)
                    break
                except IllegalTransition as exc:  # pragma: no cover - a bug in the worker or the spec
                    with self._lock:
                        self.bugs.append(exc)
                    break
                if state is None or tracker.spec.states[state].is_final:
                    break
