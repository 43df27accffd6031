"""The drivers of the Mooncake store specs: the actions that really pin blocks, queue jobs and call the store.

:class:`StoreSender` drives ``specs/mooncake_store_send.yaml`` (one instance
per store job), :class:`StoreRequests` drives ``specs/mooncake_store_request.yaml``
(one instance per request, owning its store jobs) and :class:`StoreLoader`
drives ``specs/mooncake_store_load.yaml`` (one instance per load). Every
resource the specs name is held somewhere real: a pin is a holder of blocks in the :class:`~kvfsm.drivers.block_pool.BlockPool`
of a :class:`~.buffer.BlockBuffer`, a queue task is an unfinished task of a
:class:`queue.Queue`, a report owed to vLLM is an entry not yet recorded in
the :class:`~kvfsm.drivers.report.Report`. ``observe(key)`` reads those back,
so a model-based test compares the spec's ledger with reality.

Actions raise on any failure, including negative store codes; the Tracker
then fires the spec's ``on_error`` event and the derived releases run. No
action releases anything by hand, and no action counts jobs: which store jobs
of a request are live is the engine's to know (the request spec ``owns:``
them). Each release takes the key alone: what it needs (a load's blocks) is
kept here by key.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from ..report import Report
from . import codes as C
from .buffer import BlockBuffer
from .codes import StoreError, check_codes
from .store import KVStore

BlockHash = bytes | int | str


def block_key(prefix: str, block_hash: BlockHash) -> str:
    """The store key of a block: ``prefix@hash``, the hash in hex (vLLM keys blocks by their chained hash).

    ``prefix`` names what makes equal hashes different KV (model, TP rank, dtype).
    """
    if isinstance(block_hash, bytes):
        text = block_hash.hex()
    elif isinstance(block_hash, int):
        text = f"{block_hash:x}" if block_hash >= 0 else f"n{-block_hash:x}"
    else:
        text = block_hash
    return f"{prefix}@{text}"


class NotHeld(RuntimeError):
    """A release for something the driver does not hold: the engine released twice, or a driver bug."""


class JobQueue(queue.Queue[Hashable]):
    """A worker thread's queue whose unfinished tasks are held per key: the ``queue_task``/``load_task`` resources.

    :meth:`hold` puts a key (one task per key at a time), :meth:`done` marks
    its task done; ``key in q`` says whether it holds one. Plain ``put`` and
    ``task_done`` stay for markers that are no key's (the worker's stop marker).
    """

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self._held: set[Hashable] = set()
        self._guard = threading.Lock()

    def hold(self, key: Hashable) -> None:
        with self._guard:
            if key in self._held:
                raise RuntimeError(f"{self.what} {key!r} is already queued")
            self._held.add(key)
        self.put(key)

    def done(self, key: Hashable) -> None:
        with self._guard:
            if key not in self._held:
                raise NotHeld(f"{self.what} {key!r} has no queue task")
            self._held.discard(key)
        self.task_done()

    def __contains__(self, key: object) -> bool:
        with self._guard:
            return key in self._held

    def held(self) -> int:
        """Tasks held by keys; equal to ``unfinished_tasks`` but for a stop marker not yet taken."""
        with self._guard:
            return len(self._held)


def _exists_codes(keys: list[str], answer: Sequence[int]) -> list[int]:
    """``batch_is_exist``'s answer, checked: 1 or 0 per key, anything else raises."""
    codes = check_codes("batch_is_exist", keys, answer)
    odd = [c for c in codes if c not in (0, 1)]
    if odd:
        raise StoreError(
            "batch_is_exist",
            keys,
            [c if c in (0, 1) else C.INTERNAL_ERROR for c in codes],
            f"answers {odd} are neither 0 nor 1",
        )
    return codes


@dataclass
class SaveJob:
    """What a store job stores: its request, the blocks it pinned and their keys."""

    request_id: Hashable
    blocks: tuple[int, ...]
    keys: tuple[str, ...]
    missing: tuple[int, ...] | None = None
    """Indexes of the keys the existence check found missing; None until it ran."""


class StoreRequests:
    """Actions of ``mooncake_store_request``: report a request in finished_sending once its last job let go."""

    def __init__(self, report: Report | None = None) -> None:
        self.report = report if report is not None else Report()

    def report_sent(self, request_id: Hashable, /) -> None:
        self.report.send(request_id)


class StoreSender:
    """Actions of ``mooncake_store_send``: pin, queue, check, put, and their releases.

    Thread-safe: the scheduler thread begins jobs while the sending thread
    runs them; the bookkeeping below is guarded by one leaf lock (no call
    out while held).
    """

    def __init__(self, store: KVStore, buffer: BlockBuffer, *, prefix: str = "kv") -> None:
        self.store = store
        self.buffer = buffer
        self.pool = buffer.pool
        self.prefix = prefix
        self.queue = JobQueue("store job")
        """The sending thread's queue; one task per job holding ``queue_task``."""
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._jobs: dict[Hashable, SaveJob] = {}

    @staticmethod
    def holder(job: Hashable) -> tuple[str, Hashable]:
        """The pool holder of ``job``'s pin."""
        return ("store", job)

    # -- block_pin -----------------------------------------------------------

    def pin_blocks(
        self, job: Hashable, /, request_id: Hashable, block_ids: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> None:
        """Add ``job`` as a holder of the request's blocks (each must already be held by the request)."""
        if not block_ids or len(block_ids) != len(block_hashes):
            raise ValueError(
                f"store job {job!r}: {len(block_ids)} blocks and {len(block_hashes)} hashes; "
                "a job stores at least one block, one hash per block"
            )
        keys = tuple(block_key(self.prefix, h) for h in block_hashes)
        self.pool.pin(self.holder(job), block_ids)
        with self._lock:
            self._jobs[job] = SaveJob(request_id, tuple(block_ids), keys)

    def unpin_blocks(self, job: Hashable, /) -> None:
        """Drop the job's pin; a block is free again once it has no holder left."""
        with self._lock:
            if self._jobs.pop(job, None) is None:
                raise NotHeld(f"store job {job!r} holds no pin")
        self.pool.release(self.holder(job))

    # -- queue_task ------------------------------------------------------------

    def enqueue_job(self, job: Hashable, /) -> None:
        self.queue.hold(job)

    def task_done(self, job: Hashable, /) -> None:
        self.queue.done(job)

    # -- the work ----------------------------------------------------------------

    def check_exists(self, job: Hashable, /) -> None:
        """Dedup: ask the store which of the job's keys it already has (``batch_is_exist``)."""
        rec = self._job(job)
        keys = list(rec.keys)
        codes = _exists_codes(keys, self.store.batch_is_exist(keys)) if keys else []
        rec.missing = tuple(i for i, c in enumerate(codes) if c == 0)
        self.stats["blocks_deduped"] += len(keys) - len(rec.missing)

    def put_blocks(self, job: Hashable, /) -> None:
        """Put the missing blocks from the registered buffer (``batch_put_from``), the engine's bytes gathered
        into it first.

        A key another writer put meanwhile answers 0 and keeps that writer's
        value, which is the same KV: keys are content hashes.
        """
        rec = self._job(job)
        if rec.missing is None:
            raise RuntimeError(f"store job {job!r}: put before the existence check")
        if not rec.missing:
            return
        keys = [rec.keys[i] for i in rec.missing]
        blocks = [rec.blocks[i] for i in rec.missing]
        # The job's pin keeps the engine from reusing these blocks, and a finished request writes none of them.
        if self.buffer.engine is not None:
            self.stats["bytes_gathered"] += self.buffer.gather(blocks)
        ptrs = [self.buffer.ptr(b) for b in blocks]
        sizes = [self.buffer.block_bytes] * len(keys)
        check_codes("batch_put_from", keys, self.store.batch_put_from(keys, ptrs, sizes))
        self.stats["blocks_put"] += len(keys)

    # -- reading back ------------------------------------------------------------

    def _job(self, job: Hashable) -> SaveJob:
        with self._lock:
            rec = self._jobs.get(job)
        if rec is None:
            raise NotHeld(f"store job {job!r} holds no pin; it cannot be run")
        return rec

    def observe(self, job: Hashable) -> set[str]:
        """What ``job`` really holds: a pin in the block pool, a task of the queue."""
        held = set()
        if self.pool.held_by(self.holder(job)):
            held.add("block_pin")
        if job in self.queue:
            held.add("queue_task")
        return held

    def pinned(self) -> int:
        """Store jobs that hold a pin."""
        with self._lock:
            return len(self._jobs)

    def outstanding_tasks(self) -> int:
        """Queue tasks the driver holds; always equal to ``queue.unfinished_tasks``."""
        return self.queue.held()


@dataclass
class _Hit:
    request_id: Hashable
    keys: tuple[str, ...]
    hits: int


@dataclass
class _Owed:
    """A load vLLM waits for: its request, the blocks it was given, the ones a read has filled."""

    request_id: Hashable
    blocks: tuple[int, ...]
    filled: set[int] = field(default_factory=set)


class StoreLoader:
    """Actions of ``mooncake_store_load``: look up, owe the report, pin the allocated blocks, queue, fill them.

    The release of ``recv_report`` records the request in :attr:`report`
    with the blocks no read filled, so the scheduler recomputes them instead
    of reading garbage.
    """

    def __init__(
        self, store: KVStore, buffer: BlockBuffer, *, prefix: str = "kv", report: Report | None = None
    ) -> None:
        self.store = store
        self.buffer = buffer
        self.pool = buffer.pool
        self.prefix = prefix
        self.report = report if report is not None else Report()
        """Where the release of ``recv_report`` records each load for the next finished_recving."""
        self.queue = JobQueue("load")
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._hits: dict[Hashable, _Hit] = {}
        self._owed: dict[Hashable, _Owed] = {}

    @staticmethod
    def holder(load: Hashable) -> tuple[str, Hashable]:
        return ("load", load)

    # -- hit ----------------------------------------------------------------------

    def lookup_keys(self, load: Hashable, /, request_id: Hashable, block_hashes: Sequence[BlockHash]) -> None:
        """How many leading blocks of the request the store has (``batch_is_exist``; grants read leases)."""
        keys = [block_key(self.prefix, h) for h in block_hashes]
        codes = _exists_codes(keys, self.store.batch_is_exist(keys)) if keys else []
        hits = next((i for i, c in enumerate(codes) if c != 1), len(codes))
        with self._lock:
            self._hits[load] = _Hit(request_id, tuple(keys), hits)

    def forget_hit(self, load: Hashable, /) -> None:
        with self._lock:
            if self._hits.pop(load, None) is None:
                raise NotHeld(f"load {load!r} has no lookup result")

    def hits(self, load: Hashable) -> int:
        """The hit length the lookup found (0 if it has not run or was forgotten)."""
        with self._lock:
            hit = self._hits.get(load)
        return hit.hits if hit is not None else 0

    # -- recv_report ----------------------------------------------------------------

    def owe_recv_report(self, load: Hashable, /, block_ids: Sequence[int], request_id: Hashable = None) -> None:
        """The scheduler gave blocks for the hit: vLLM now waits for this load, its blocks unfilled.

        ``request_id`` comes with ``order`` (the worker has not looked up yet); on ``allocate`` it is the lookup's.
        """
        with self._lock:
            if request_id is None:
                hit = self._hits.get(load)
                if hit is None:
                    raise NotHeld(f"load {load!r} has no lookup result to allocate for")
                request_id = hit.request_id
            self._owed[load] = _Owed(request_id, tuple(block_ids))

    def report_recv(self, load: Hashable, /) -> None:
        """Record the request for the next finished_recving, with the blocks no read filled as invalid."""
        with self._lock:
            owed = self._owed.pop(load, None)
        if owed is None:
            raise NotHeld(f"load {load!r} owes no report")
        self.report.recv(owed.request_id, [b for b in owed.blocks if b not in owed.filled])

    # -- load_blocks ------------------------------------------------------------

    def pin_load_blocks(self, load: Hashable, /, block_ids: Sequence[int]) -> None:
        """Add the load as a holder of the blocks the scheduler allocated for the hit."""
        hits = self.hits(load)
        if not 0 < len(block_ids) <= hits:
            raise ValueError(f"load {load!r}: {len(block_ids)} blocks allocated for a hit of {hits}")
        self.pool.pin(self.holder(load), block_ids)

    def unpin_load_blocks(self, load: Hashable, /) -> None:
        self.pool.release(self.holder(load))

    # -- load_task ----------------------------------------------------------------

    def enqueue_load(self, load: Hashable, /, block_ids: Sequence[int]) -> None:
        """Queue the load for a load thread (``block_ids`` is ``allocate``'s payload; the pin took them)."""
        self.queue.hold(load)

    def load_task_done(self, load: Hashable, /) -> None:
        self.queue.done(load)

    # -- the work ----------------------------------------------------------------

    def load_into_blocks(self, load: Hashable, /) -> None:
        """Fill the allocated blocks from the store (``batch_get_into``); a short or failed read raises.

        A block counts as filled only once the engine's block holds the bytes:
        each complete read is scattered from the buffer into the engine's
        cache before it is recorded, so the report (``recv_report``'s release)
        can never run ahead of the copy.
        """
        with self._lock:
            hit, owed = self._hits.get(load), self._owed.get(load)
        if hit is None or owed is None:
            raise NotHeld(f"load {load!r} has no allocated blocks to load into")
        blocks = owed.blocks
        n = len(blocks)
        keys = list(hit.keys[:n])
        size = self.buffer.block_bytes
        answer = list(self.store.batch_get_into(keys, [self.buffer.ptr(b) for b in blocks], [size] * n))
        if len(answer) != n:
            raise StoreError("batch_get_into", keys, [C.INTERNAL_ERROR] * n, f"{len(answer)} answers for {n} keys")
        complete = [b for b, got in zip(blocks, answer, strict=True) if got == size]
        if self.buffer.engine is not None:
            self.stats["bytes_scattered"] += self.buffer.scatter(complete)
        with self._lock:
            owed.filled.update(complete)
            filled = len(owed.filled)
        self.stats["blocks_loaded"] += filled
        if filled < n:
            codes = [got if got < 0 else (C.OK if got == size else -701) for got in answer]
            raise StoreError("batch_get_into", keys, codes, "-701 marks a read of the wrong size")

    # -- reading back ------------------------------------------------------------

    def observe(self, load: Hashable) -> set[str]:
        """What ``load`` really holds: a pin in the pool, a queue task, a lookup result, an unreported load."""
        held = set()
        if self.pool.held_by(self.holder(load)):
            held.add("load_blocks")
        if load in self.queue:
            held.add("load_task")
        with self._lock:
            if load in self._hits:
                held.add("hit")
            if load in self._owed:
                held.add("recv_report")
        return held

    def outstanding_tasks(self) -> int:
        return self.queue.held()
