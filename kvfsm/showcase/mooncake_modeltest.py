"""The Mooncake store drivers set up for kvfsm's generated model-based tests (``kvfsm.testing``).

A generated test begins keys and fires events without payloads, and asks the
driver to make its next action raise. :class:`ModelSender` and
:class:`ModelLoader` are the real drivers plus exactly that: they plan a job
(or a load) they were begun without, over fresh blocks and fresh hashes, and
they inject a fault by making the store call behind the action fail (raise, or
return negative codes: each in turn), through a :class:`~.faults.FaultyStore`
in front of the real store. Everything else is the production code path.

From the command line, against the embedded store or a running master::

    kvfsm test specs/mooncake_store_send.yaml --driver kvfsm.showcase.mooncake_modeltest:embedded_sender
    KVFSM_MOONCAKE_MASTER=127.0.0.1:50051 \\
        kvfsm test specs/mooncake_store_send.yaml --driver kvfsm.showcase.mooncake_modeltest:real_sender
"""

from __future__ import annotations

import itertools
import os
import uuid
import weakref
from collections.abc import Callable, Collection, Hashable, Sequence

import torch

from ..drivers.mooncake import codes as C
from ..drivers.mooncake.buffer import BlockBuffer
from ..drivers.mooncake.driver import BlockHash, StoreLoader, StoreRequests, StoreSender
from ..drivers.mooncake.embedded import EmbeddedMaster, connect_embedded
from ..drivers.mooncake.store import KVStore, connect
from ..drivers.report import Report
from ..harness.mooncake.faults import Fault, FaultyStore, raising, returning

NUM_BLOCKS = 32
BLOCK_BYTES = 4096
BLOCKS_PER_JOB = 2


class _Faults:
    """Which store call each faultable action makes, and the faults used in turn on it."""

    def __init__(self, store: KVStore, calls: dict[str, str]) -> None:
        self.store = FaultyStore(store)
        self.calls = calls
        self.direct: set[str] = set()
        self._turn = itertools.count()

    def inject(self, action: str) -> None:
        call = self.calls.get(action)
        if call is None:
            self.direct.add(action)  # an action that calls no store: it raises itself
            return
        kinds: tuple[Fault, ...] = (
            raising(f"injected fault in {call}"),
            returning(C.RPC_FAIL),
            returning(C.NO_AVAILABLE_HANDLE, keys=1),
        )
        self.store.fail_next(call, kinds[next(self._turn) % len(kinds)])

    def trip(self, action: str) -> None:
        if action in self.direct:
            self.direct.discard(action)
            raise RuntimeError(f"injected fault in {action}")


class ModelSender(StoreSender):
    """:class:`StoreSender` that plans unplanned jobs and injects faults into the store calls."""

    def __init__(self, store: KVStore, kv: torch.Tensor | None = None, *, prefix: str | None = None) -> None:
        self.faults = _Faults(store, {"check_exists": "batch_is_exist", "put_blocks": "batch_put_from"})
        buffer = BlockBuffer(NUM_BLOCKS, BLOCK_BYTES, kv=kv)
        super().__init__(self.faults.store, buffer, prefix=prefix or f"model-{uuid.uuid4().hex[:12]}")
        self._plans = itertools.count(1)

    def inject_fault(self, action: str) -> bool:
        self.faults.inject(action)
        return True

    def pin_blocks(
        self,
        job: Hashable,
        /,
        request_id: Hashable = None,
        block_ids: Sequence[int] | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
    ) -> None:
        """Pin the given blocks, or (begun without a plan) a request's fresh blocks with fresh hashes."""
        self.faults.trip("pin_blocks")
        if block_ids is not None and block_hashes is not None:
            return super().pin_blocks(job, request_id, block_ids, block_hashes)
        n = next(self._plans)
        request = ("request", job, n)
        blocks = self.pool.allocate(request, BLOCKS_PER_JOB)
        for i, b in enumerate(blocks):
            self.buffer.kv[b].fill_((n * BLOCKS_PER_JOB + i) % 251)
        try:
            super().pin_blocks(
                job, request_id=request, block_ids=blocks, block_hashes=[f"{n}.{i}" for i in range(len(blocks))]
            )
        finally:
            self.pool.release(request, blocks)  # the request is done; the job's pin keeps its blocks

    def enqueue_job(self, job: Hashable, /) -> None:
        self.faults.trip("enqueue_job")
        super().enqueue_job(job)


class ModelRequests(StoreRequests):
    """:class:`StoreRequests` with what the model tests read: ``observe`` asks vLLM's side of the report.

    ``send_report`` is held from the moment vLLM finished the request and kept its blocks (``request_finished``
    returned delay_free, the ``finish`` edge's :meth:`before_fire`) until the request is in the report vLLM
    drains for finished_sending.
    """

    def __init__(self) -> None:
        super().__init__(Report())
        self.kept: set[Hashable] = set()
        """Requests vLLM finished and keeps the blocks of, waiting for finished_sending."""

    def before_fire(self, request_id: Hashable, event: str, resources: Collection[str], /) -> None:
        if "send_report" in resources:
            self.kept.add(request_id)

    def observe(self, request_id: Hashable) -> set[str]:
        return {"send_report"} if request_id in self.kept and not self.report.owes(request_id) else set()


class ModelLoader(StoreLoader):
    """:class:`StoreLoader` over a store seeded with a cached prefix, planning unplanned lookups and loads."""

    HIT = 2

    def __init__(self, store: KVStore, kv: torch.Tensor | None = None, *, prefix: str | None = None) -> None:
        self.faults = _Faults(store, {"lookup_keys": "batch_is_exist", "load_into_blocks": "batch_get_into"})
        buffer = BlockBuffer(NUM_BLOCKS, BLOCK_BYTES, kv=kv)
        super().__init__(self.faults.store, buffer, prefix=prefix or f"model-{uuid.uuid4().hex[:12]}")
        self._plans = itertools.count(1)
        self.cached = [f"cached.{i}" for i in range(self.HIT)]
        self._allocated: dict[Hashable, list[int]] = {}
        self._requests: dict[Hashable, Hashable] = {}
        self._seed_store(store)

    def _seed_store(self, store: KVStore) -> None:
        """Put the cached prefix in the store (through the real store, never faulted)."""
        seeder = StoreSender(store, self.buffer, prefix=self.prefix)
        blocks = self.pool.allocate("seed", self.HIT)
        for i, b in enumerate(blocks):
            self.buffer.kv[b].fill_(100 + i)
        seeder.pin_blocks("seed", request_id="seed", block_ids=blocks, block_hashes=self.cached)
        seeder.check_exists("seed")
        seeder.put_blocks("seed")
        seeder.unpin_blocks("seed")
        self.pool.release("seed", blocks)

    def inject_fault(self, action: str) -> bool:
        self.faults.inject(action)
        return True

    def lookup_keys(
        self, load: Hashable, /, request_id: Hashable = None, block_hashes: Sequence[BlockHash] | None = None
    ) -> None:
        """Look the given hashes up, or (fired without them) the cached prefix followed by a block the store lacks."""
        if block_hashes is None:
            request_id, block_hashes = ("request", load, next(self._plans)), [*self.cached, "absent"]
        super().lookup_keys(load, request_id, block_hashes)

    def owe_recv_report(
        self, load: Hashable, /, block_ids: Sequence[int] | None = None, request_id: Hashable = None
    ) -> None:
        """Owe the report for the given blocks, or (fired without them) for blocks allocated for the hit: the
        lookup's, or on ``order`` (no lookup yet) the cached prefix's, as a scheduler in another process found it."""
        self.faults.trip("owe_recv_report")
        if block_ids is None:
            request = ("request", load, next(self._plans))
            block_ids = self._allocated[load] = self.pool.allocate(request, self.hits(load) or self.HIT)
            self._requests[load] = request
            if not self.hits(load):
                request_id = request
        super().owe_recv_report(load, block_ids, request_id)

    def scheduler_holder(self, load: Hashable) -> Hashable:
        """The request that holds the blocks allocated for ``load`` until a pin takes them over (None if none)."""
        return self._requests.get(load)

    def report_recv(self, load: Hashable, /) -> None:
        """Report; a request whose blocks no pin took over (its load ended before ``allocate``) lets them go."""
        super().report_recv(load)
        self._allocated.pop(load, None)
        request = self._requests.pop(load, None)
        if request is not None:
            self.pool.release(request)

    def pin_load_blocks(self, load: Hashable, /, block_ids: Sequence[int] | None = None) -> None:
        """Pin the given blocks, or the ones :meth:`owe_recv_report` allocated, which their request then hands over."""
        request = self._requests.pop(load, None)
        try:
            self.faults.trip("pin_load_blocks")
            super().pin_load_blocks(load, self._allocated.pop(load, []) if block_ids is None else block_ids)
        finally:
            if request is not None:
                self.pool.release(request)

    def enqueue_load(self, load: Hashable, /, block_ids: Sequence[int] | None = None) -> None:
        self.faults.trip("enqueue_load")
        super().enqueue_load(load, block_ids or [])


# -- factories -------------------------------------------------------------------

_registered: weakref.WeakKeyDictionary[KVStore, torch.Tensor] = weakref.WeakKeyDictionary()


def registered_kv(store: KVStore) -> torch.Tensor:
    """One KV tensor per store, registered once, reused by every example's fresh pool.

    Registering a new tensor per example would pile up registrations (and the
    store refuses an overlapping one when torch reuses an address).
    """
    kv = _registered.get(store)
    if kv is None:
        kv = torch.zeros((NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
        rc = store.register_buffer(kv.data_ptr(), kv.numel())
        if rc < 0:
            raise RuntimeError(f"register_buffer of the model tests' KV tensor returned {C.name(rc)}")
        _registered[store] = kv
    return kv


def sender_factory(store: KVStore) -> Callable[[], ModelSender]:
    """A factory of fresh :class:`ModelSender` s over ``store`` (one registered tensor for all)."""
    kv = registered_kv(store)
    return lambda: ModelSender(store, kv)


def loader_factory(store: KVStore) -> Callable[[], ModelLoader]:
    kv = registered_kv(store)
    return lambda: ModelLoader(store, kv)


_stores: dict[str, KVStore] = {}


def _embedded() -> KVStore:
    if "embedded" not in _stores:
        _stores["embedded"] = connect_embedded(EmbeddedMaster(lease_ttl=0.5))
    return _stores["embedded"]


def _real() -> KVStore:
    address = os.environ.get("KVFSM_MOONCAKE_MASTER")
    if not address:
        raise RuntimeError("set KVFSM_MOONCAKE_MASTER=host:port to the mooncake_master to test against")
    if address not in _stores:
        _stores[address] = connect(address)
    return _stores[address]


def embedded_sender() -> ModelSender:
    """``--driver`` factory: a :class:`ModelSender` over an in-process embedded store."""
    return ModelSender(_embedded(), registered_kv(_embedded()))


def embedded_requests() -> ModelRequests:
    """``--driver`` factory of ``mooncake_store_request``: its store jobs (``--driver jobs=…``) are
    :func:`embedded_job` or :func:`real_job`."""
    return ModelRequests()


def embedded_job(requests: ModelRequests) -> ModelSender:
    """``--driver jobs=`` factory: a store job's :class:`ModelSender` beside ``requests`` (embedded store)."""
    return embedded_sender()


real_requests = embedded_requests
"""The request's driver is the same over either store: only its jobs talk to one."""


def real_job(requests: ModelRequests) -> ModelSender:
    """``--driver jobs=`` factory: a store job's :class:`ModelSender` beside ``requests`` (``$KVFSM_MOONCAKE_MASTER``)."""
    return real_sender()


def embedded_loader() -> ModelLoader:
    return ModelLoader(_embedded(), registered_kv(_embedded()))


def real_sender() -> ModelSender:
    """``--driver`` factory: a :class:`ModelSender` over the master at ``$KVFSM_MOONCAKE_MASTER``."""
    return ModelSender(_real(), registered_kv(_real()))


def real_loader() -> ModelLoader:
    return ModelLoader(_real(), registered_kv(_real()))


__all__: Sequence[str] = [
    "ModelLoader",
    "ModelRequests",
    "ModelSender",
    "embedded_job",
    "embedded_loader",
    "embedded_requests",
    "embedded_sender",
    "loader_factory",
    "real_job",
    "real_loader",
    "real_requests",
    "real_sender",
    "registered_kv",
    "sender_factory",
]
