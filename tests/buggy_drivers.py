"""Drivers for model-based tests: correct ones, and ones with the bugs of the seed reports.

Each driver really holds things: blocks of a ref-counted :class:`BlockPool`
that knows which owner holds each reference, a bounded transfer queue, a
store that keeps copies of block contents. ``observe(key)`` reads those, never
a log of calls, so a test of it is a test of what the driver left behind.

The buggy drivers differ from the correct ones by one method each, the way
the real bugs did:

- :class:`SkipsDecOnPutError` (seed 000, vLLM Mooncake store connector): the
  in-flight-store counter is decremented after ``batch_put`` instead of in a
  ``finally``; when the put raises, delay-free waits forever and the GPU
  blocks stay pinned.
- :class:`TaskDoneFreesBlocks` (double release): ``task_done`` hands the job's
  GPU blocks back too, so the spec-derived ``free_gpu_blocks`` frees them a
  second time.
- :class:`UnpinsOnlyLoadedHits` (seed 003, vLLM SimpleCPUOffloadScheduler):
  the pin taken in phase A is released only from the phase-B table, so a
  request cancelled between the phases keeps its CPU blocks pinned.
- :class:`FreesOnlyOnAck` (seed 002, the reverted deferred release): decode
  moves the free of its KV pages to an ABORT_ACK handler that, as merged,
  only logs, so aborted rooms keep their pages.
- :class:`NeverTakesPages`: decode sends its page indices but never makes
  the pages the room's, so nothing says they are held.
- :class:`ClosesWriteTwice` (a bug on the success edge alone): the producer
  closes its write task when the write completes, and the spec-derived
  ``close_write`` closes it again.

Usable as ``kvfsm test SPEC --driver buggy_drivers:FACTORY`` from ``tests/``.
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from collections.abc import Hashable
from pathlib import Path
from typing import Any, ClassVar

import kvfsm
from kvfsm.drivers.pd_loopback import DecodeDriver, PDLoopback

ROOT = Path(__file__).resolve().parent.parent
KV_REQUEST = ROOT / "specs" / "kv_request.yaml"

CPU_HIT_SPEC = """\
# Loading a CPU-cache hit into GPU blocks across the scheduler's two phases
# (vLLM's get_num_new_matched_tokens, then update_state_after_alloc).
kvfsm: 1
machine: cpu_hit_load
doc: A CPU-cache hit pinned in phase A, loaded into GPU blocks in phase B.
key: request_id
params:
  load_timeout: 10.0
resources:
  cpu_pin:    {acquire: pin_hit, release: unpin_hit, doc: "a reference on the hit's CPU blocks, so LRU cannot evict them"}
  gpu_blocks: {acquire: alloc_gpu, release: free_gpu, doc: the load's reference on its destination GPU blocks}
states:
  matching: {initial: true, waits: local, doc: "phase A looks the prompt up in the CPU cache"}
  pinned:   {holds: [cpu_pin], waits: local, doc: "between the phases, the scheduler allocates next"}
  loading:  {holds: [cpu_pin, gpu_blocks], timeout: {after: load_timeout, fire: expire}}
  loaded:   {final: success}
  missed:   {final: success}
  failed:   {final: failure}
  aborted:  {final: failure}
  expired:  {final: failure}
transitions:
  - {event: hit,      from: matching, to: pinned}
  - {event: miss,     from: matching, to: missed}
  - {event: allocate, from: pinned,   to: loading, do: start_load}
  - {event: done,     from: loading,  to: loaded}
  - {event: fail,     from: [matching, pinned, loading], to: failed}
  - {event: abort,    from: "*",      to: aborted}
  - {event: expire,   from: loading,  to: expired}
ignore:
  - {event: [abort, done, fail, expire], in: [loaded, missed, failed, aborted, expired]}
on_error: fail
"""


PRODUCER_SPEC = """\
# A producer saves a request's KV blocks, waits for the remote side, writes, and is done.
kvfsm: 1
machine: kv_producer
doc: One request's KV blocks saved, then written to a remote consumer once it is ready.
key: request_id
params:
  remote_timeout: 5.0
  write_timeout: 10.0
resources:
  kv_blocks:  {acquire: pin_blocks, release: unpin_blocks, doc: "the saved blocks, pinned until written"}
  write_task: {acquire: open_write, release: close_write, doc: the open write to the consumer}
states:
  new:     {initial: true, waits: local}
  saved:   {holds: [kv_blocks], timeout: {after: remote_timeout, fire: expire}}
  writing: {holds: [kv_blocks, write_task], timeout: {after: write_timeout, fire: expire}}
  sent:    {final: success}
  failed:  {final: failure}
  aborted: {final: failure}
transitions:
  - {event: save,         from: new,     to: saved}
  - {event: remote_ready, from: saved,   to: writing, do: start_write}
  - {event: write_done,   from: writing, to: sent,    do: finish_write}
  - {event: fail,         from: [new, saved, writing], to: failed}
  - {event: abort,        from: "*",     to: aborted}
  - {event: expire,       from: [saved, writing], to: failed}
ignore:
  - {event: [abort, fail, expire, write_done], in: [sent, failed, aborted]}
on_error: fail
"""


class PoolCorrupted(AssertionError):
    """A pool operation that would break the pool's invariant (a double free, a foreign free)."""


class InjectedFault(RuntimeError):
    """What an action raises when a test asked it to (``inject_fault``)."""


class BlockPool:
    """A fixed pool of ref-counted blocks that knows who holds each reference.

    Invariant: ``ref_cnt[b] == sum(holders[b].values())``, and
    ``ref_cnt[b] == 0`` ⇔ ``b`` is in the free queue.
    """

    def __init__(self, size: int, block_bytes: int = 16) -> None:
        self.ref_cnt = [0] * size
        self.holders: list[Counter[Hashable]] = [Counter() for _ in range(size)]
        self.free_queue: deque[int] = deque(range(size))
        self.data = [bytearray(block_bytes) for _ in range(size)]

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise MemoryError(f"pool exhausted: {n} blocks wanted, {len(self.free_queue)} free")
        blocks = list(self.free_queue)[:n]
        self.touch(owner, blocks)
        return blocks

    def touch(self, owner: Hashable, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self.free_queue.remove(b)
            self.ref_cnt[b] += 1
            self.holders[b][owner] += 1

    def free(self, owner: Hashable, blocks: list[int]) -> None:
        for b in blocks:
            if self.holders[b][owner] <= 0:
                raise PoolCorrupted(f"{owner} frees block {b}, which it does not hold (ref_cnt {self.ref_cnt[b]})")
        for b in blocks:
            self.holders[b][owner] -= 1
            if not self.holders[b][owner]:
                del self.holders[b][owner]
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue.append(b)

    def read(self, blocks: list[int]) -> bytes:
        return b"".join(bytes(self.data[b]) for b in blocks)

    def held_by(self, owner: Hashable) -> list[int]:
        return [b for b, h in enumerate(self.holders) if h[owner] > 0]

    def in_use(self) -> int:
        return sum(1 for c in self.ref_cnt if c)


class TransferQueue:
    """A bounded queue of transfer jobs; ``task_done`` retires one."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.jobs: dict[Hashable, int] = {}
        self.unfinished = 0

    def put(self, key: Hashable) -> None:
        if key in self.jobs:
            raise PoolCorrupted(f"{key} queued twice")
        if len(self.jobs) >= self.capacity:
            raise OverflowError("transfer queue full")
        self.jobs[key] = self.unfinished
        self.unfinished += 1

    def task_done(self, key: Hashable) -> None:
        if key not in self.jobs:
            raise PoolCorrupted(f"task_done for {key}, which has no job (task_done called too many times)")
        del self.jobs[key]
        self.unfinished -= 1


class Faults:
    """``inject_fault(action)`` (kvfsm.testing.FaultInjecting): the next call of ``action`` raises :class:`InjectedFault`."""

    def __init__(self) -> None:
        self.armed: set[str] = set()

    def inject_fault(self, action: str) -> bool:
        self.armed.add(action)
        return True

    def maybe_raise(self, action: str, key: Hashable) -> None:
        if action in self.armed:
            self.armed.discard(action)
            raise InjectedFault(f"{action}({key}) failed (injected)")


# -- kv_request: the Mooncake-store-shaped sender -------------------------------------


class StoreSender(Faults):
    """Sends a request's KV blocks to a store, for ``specs/kv_request.yaml``.

    The scheduler pins the request's GPU blocks before ``begin`` (delay-free);
    a store job holds a queue slot; ``batch_put`` copies block contents into
    the store. Blocks are freed only when no store reads them
    (``stores_in_flight[key] == 0``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.gpu = BlockPool(12)
        self.queue = TransferQueue(capacity=8)
        self.store: dict[Hashable, bytes] = {}
        self.blocks: dict[Hashable, list[int]] = {}
        self.stores_in_flight: Counter[Hashable] = Counter()

    def before_begin(self, key: Hashable, resources: frozenset[str]) -> None:
        """What the scheduler does before begin(): pin the request's blocks so the pool cannot reuse them."""
        self.blocks[key] = self.gpu.allocate(key, 2)

    def enqueue_job(self, key: Hashable) -> None:
        self.maybe_raise("enqueue_job", key)
        self.queue.put(key)

    def start_transfer(self, key: Hashable) -> None:
        self.stores_in_flight[key] += 1  # inc_stored_request
        try:
            self.batch_put(key)
        finally:
            self.stores_in_flight[key] -= 1  # dec_stored_request, on every path (the seed-000 fix)

    def batch_put(self, key: Hashable) -> None:
        self.maybe_raise("start_transfer", key)
        self.store[key] = self.gpu.read(self.blocks[key])

    def free_gpu_blocks(self, key: Hashable) -> None:
        if self.stores_in_flight[key]:
            return  # delay-free: a store still reads these blocks, so they wait for dec_stored_request
        self.gpu.free(key, self.blocks[key])

    def task_done(self, key: Hashable) -> None:
        self.queue.task_done(key)

    def observe(self, key: Hashable) -> set[str]:
        held = set()
        if self.gpu.held_by(key):
            held.add("gpu_blocks")
        if key in self.queue.jobs:
            held.add("queue_slot")
        return held


class SkipsDecOnPutError(StoreSender):
    """Seed 000: ``dec_stored_request`` sits after ``batch_put``, so a put that raises skips it."""

    def start_transfer(self, key: Hashable) -> None:
        self.stores_in_flight[key] += 1
        self.batch_put(key)
        self.stores_in_flight[key] -= 1


class TaskDoneFreesBlocks(StoreSender):
    """Double release: ``task_done`` also returns the job's blocks, then ``free_gpu_blocks`` does again."""

    def task_done(self, key: Hashable) -> None:
        self.queue.task_done(key)
        self.gpu.free(key, self.blocks[key])  # free_gpu_blocks frees them too


# -- cpu_hit_load: the SimpleCPUOffloadScheduler-shaped loader --------------------------


class CpuHitLoader(Faults):
    """Loads a CPU-cache hit into GPU blocks, for :data:`CPU_HIT_SPEC`.

    Phase A pins the hit's CPU blocks (``pending_hits``); phase B moves the hit to
    ``loading`` and takes GPU blocks. ``unpin_hit`` finds the pin wherever the
    request got to.
    """

    def __init__(self) -> None:
        super().__init__()
        self.cpu = BlockPool(16)
        self.gpu = BlockPool(12)
        self.cache = {f"prefix-{i}": [2 * i, 2 * i + 1] for i in range(4)}
        """Cached prompt prefixes → the CPU blocks that hold them (LRU-evictable while unpinned)."""
        self.cpu.touch("cache", [b for blocks in self.cache.values() for b in blocks])
        self.pending_hits: dict[Hashable, list[int]] = {}
        self.loading: dict[Hashable, list[int]] = {}
        self.gpu_blocks: dict[Hashable, list[int]] = {}

    def pin_hit(self, key: Hashable) -> None:
        self.maybe_raise("pin_hit", key)
        blocks = self.cache[f"prefix-{zlib.crc32(str(key).encode()) % len(self.cache)}"]
        self.cpu.touch(key, blocks)
        self.pending_hits[key] = blocks

    def start_load(self, key: Hashable) -> None:
        self.maybe_raise("start_load", key)
        self.loading[key] = self.pending_hits.pop(key)

    def alloc_gpu(self, key: Hashable) -> None:
        self.maybe_raise("alloc_gpu", key)
        self.gpu_blocks[key] = self.gpu.allocate(key, 2)

    def unpin_hit(self, key: Hashable) -> None:
        blocks = self.loading.pop(key, None) or self.pending_hits.pop(key)
        self.cpu.free(key, blocks)

    def free_gpu(self, key: Hashable) -> None:
        self.gpu.free(key, self.gpu_blocks.pop(key))

    def observe(self, key: Hashable) -> set[str]:
        held = set()
        if self.cpu.held_by(key):
            held.add("cpu_pin")
        if self.gpu.held_by(key):
            held.add("gpu_blocks")
        return held


class UnpinsOnlyLoadedHits(CpuHitLoader):
    """Seed 003: the pin is released from the phase-B table only; a hit cancelled between phases stays pinned."""

    def unpin_hit(self, key: Hashable) -> None:
        blocks = self.loading.pop(key, None)
        if blocks is not None:
            self.cpu.free(key, blocks)


# -- kv_producer: a six-state producer with a bug on its success edge --------------------------


class Producer(Faults):
    """Saves a request's blocks, opens a write to the consumer, and flushes it, for :data:`PRODUCER_SPEC`."""

    def __init__(self) -> None:
        super().__init__()
        self.gpu = BlockPool(12)
        self.writes: dict[Hashable, bytearray] = {}
        self.blocks: dict[Hashable, list[int]] = {}

    def pin_blocks(self, key: Hashable) -> None:
        self.maybe_raise("pin_blocks", key)
        self.blocks[key] = self.gpu.allocate(key, 2)

    def unpin_blocks(self, key: Hashable) -> None:
        self.gpu.free(key, self.blocks.pop(key))

    def open_write(self, key: Hashable) -> None:
        self.maybe_raise("open_write", key)
        self.writes[key] = bytearray()

    def start_write(self, key: Hashable) -> None:
        self.maybe_raise("start_write", key)

    def finish_write(self, key: Hashable) -> None:
        self.maybe_raise("finish_write", key)
        self.writes[key] += self.gpu.read(self.blocks[key])

    def close_write(self, key: Hashable) -> None:
        if key not in self.writes:
            raise PoolCorrupted(f"close_write({key}): no write task is open (closed twice?)")
        del self.writes[key]

    def observe(self, key: Hashable) -> set[str]:
        held = set()
        if self.gpu.held_by(key):
            held.add("kv_blocks")
        if key in self.writes:
            held.add("write_task")
        return held


class ClosesWriteTwice(Producer):
    """Closes the write task as soon as the write completes; the spec-derived ``close_write`` closes it again."""

    def finish_write(self, key: Hashable) -> None:
        super().finish_write(key)
        self.close_write(key)


PEER_SPEC = PRODUCER_SPEC.replace("machine: kv_producer", "machine: kv_producer_peer").replace(
    "do: start_write}", "do: start_write, payload: [peer]}"
)
"""The producer with ``remote_ready`` carrying the peer to write to."""


class NeedsPeer(Producer):
    """``start_write`` cannot run without the peer, so a test that fires ``remote_ready`` bare cannot take it."""

    def start_write(self, key: Hashable, peer: str) -> None:  # type: ignore[override]
        super().start_write(key)

    def open_write(self, key: Hashable, peer: str | None = None) -> None:
        super().open_write(key)


class GivesPeer(NeedsPeer):
    """Says what its scheduler passes with each event, so the test fires ``remote_ready`` as production does."""

    def before_fire(self, key: Hashable, event: str, resources: frozenset[str]) -> dict[str, str]:
        return {"peer": "decode-0"} if event == "remote_ready" else {}


# -- any spec: one pool per resource ------------------------------------------------------------


class PoolPerResource(Faults):
    """A correct driver for any spec whose resources all have acquire actions (or are held from begin).

    Each resource is a block pool; its acquire action takes a block for the
    key, its release action gives it back; ``observe`` reads the pools.
    """

    spec: ClassVar[kvfsm.Spec]

    def __init__(self) -> None:
        super().__init__()
        self.pools = {r: BlockPool(16) for r in self.spec.resources}
        self.taken: dict[tuple[Hashable, str], list[int]] = {}

    def before_begin(self, key: Hashable, resources: frozenset[str]) -> None:
        for r in sorted(resources):
            self._take(r, key)

    def _take(self, resource: str, key: Hashable) -> None:
        self.taken[key, resource] = self.pools[resource].allocate(key, 1)

    def _act(self, action: str, key: Hashable) -> None:
        self.maybe_raise(action, key)
        for r in self.spec.resources.values():
            if r.acquire == action:
                self._take(r.name, key)

    def _release(self, resource: str, key: Hashable) -> None:
        self.pools[resource].free(key, self.taken.pop((key, resource)))

    def observe(self, key: Hashable) -> set[str]:
        return {r for r, pool in self.pools.items() if pool.held_by(key)}


def pool_driver(spec: kvfsm.Spec) -> type[PoolPerResource]:
    """A :class:`PoolPerResource` class with one method per action of ``spec``."""
    releases = {r.release: r.name for r in spec.resources.values()}
    releases |= {action: r for t in spec.transitions for r, action in t.release}  # a transition's own release
    namespace: dict[str, Any] = {"spec": spec}
    for action in spec.actions():
        if action in releases:
            namespace[action] = lambda self, key, _r=releases[action], **_: self._release(_r, key)
        else:
            namespace[action] = lambda self, key, _a=action, **_: self._act(_a, key)
    return type(f"{spec.name.title().replace('_', '')}Pools", (PoolPerResource,), namespace)


class NoObserve:
    """Has every action of kv_request but cannot say what it holds."""

    def before_begin(self, key: Hashable, resources: frozenset[str]) -> None: ...
    def enqueue_job(self, key: Hashable) -> None: ...
    def start_transfer(self, key: Hashable) -> None: ...
    def free_gpu_blocks(self, key: Hashable) -> None: ...
    def task_done(self, key: Hashable) -> None: ...


class LacksTaskDone:
    """Forgets one of kv_request's actions."""

    def before_begin(self, key: Hashable, resources: frozenset[str]) -> None: ...
    def enqueue_job(self, key: Hashable) -> None: ...
    def start_transfer(self, key: Hashable) -> None: ...
    def free_gpu_blocks(self, key: Hashable) -> None: ...
    def observe(self, key: Hashable) -> set[str]:
        return set()


def write_cpu_hit_spec(folder: Path) -> Path:
    """The seed-003 spec as a file (``kvfsm test`` takes a path)."""
    path = folder / "cpu_hit_load.yaml"
    path.write_text(CPU_HIT_SPEC)
    return path


# -- the PD loopback's decode side (kvfsm.drivers.pd_loopback), one bug each --------------------


class FreesOnlyOnAck(DecodeDriver):
    """Frees the room's pages only on ABORT_ACK, whose handler (as merged) only logs: the free never happens."""

    def release_kv_cache(self, room: Hashable, /) -> None:
        pass  # moved to the ACK handler, which is never wired up


class NeverTakesPages(DecodeDriver):
    """Preallocates pages and sends their indices, but never records them as the room's."""

    def alloc_kv_pages(self, room: Hashable, /) -> None:
        pass


def frees_only_on_ack() -> FreesOnlyOnAck:
    return FreesOnlyOnAck(PDLoopback())


def never_takes_pages() -> NeverTakesPages:
    return NeverTakesPages(PDLoopback())


# -- id spaces: a prefill that holds blocks for the peer's message, a decode that sends it -----------------------------

from kvfsm.engine.outbox import Outbox  # noqa: E402 - kept with the drivers that use it

PREFILL_HOLD = """
kvfsm: 1
machine: prefill_hold
key: request_id
params: {expiry: 480.0}
spaces:
  remote_request_id: {linked_at: begin, doc: the id decode names in its notification}
events:
  read_done: {by: remote_request_id, remote: true}
begin: {payload: [remote_request_id]}
resources:
  blocks: {release: free_blocks}
states:
  held:    {initial: true, holds: [blocks], timeout: {after: expiry, fire: expire}}
  done:    {final: success}
  expired: {final: failure}
  aborted: {final: failure}
transitions:
  - {event: read_done, from: held, to: done}
  - {event: expire,    from: held, to: expired}
  - {event: abort,     from: "*",  to: aborted}
ignore:
  - {event: read_done, in: [done, expired, aborted]}
"""
"""Prefill holds a request's blocks until decode's message names it by the id decode was told (never decode's own)."""

DECODE_READ = """
kvfsm: 1
machine: decode_read
key: request_id
spaces:
  remote_request_id: {linked_at: begin}
begin: {payload: [remote_request_id]}
outgoing:
  read_done: {to: prefill_hold, carries: remote_request_id}
states:
  loading: {initial: true, waits: local}
  done:    {final: success}
  aborted: {final: failure}
transitions:
  - {event: finish, from: loading, to: done, do: notify}
  - {event: abort,  from: "*",     to: aborted}
on_error: abort
"""
"""Decode tells the prefill it is done, with the prefill's id: its ``outgoing:`` says which space that is."""


class HeldBlocks:
    """prefill_hold's driver: the blocks are held by the caller before begin, freed by the key."""

    def __init__(self) -> None:
        self.held: set[Hashable] = set()

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> None:
        self.held.add(key)

    def free_blocks(self, key: Hashable, /) -> None:
        self.held.discard(key)

    def observe(self, key: Hashable, /) -> set[str]:
        return {"blocks"} if key in self.held else set()


class Notifier:
    """decode_read's driver: chooses the peer's id for each instance and tells the peer with it."""

    def __init__(self) -> None:
        self.outbox = Outbox(kvfsm.parse(DECODE_READ, "decode_read.yaml"))
        self.remote: dict[Hashable, str] = {}
        self.serial = 0

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> dict[str, str]:
        self.serial += 1
        self.remote[key] = f"p-{self.serial}"
        return {"remote_request_id": self.remote[key]}

    def notify(self, key: Hashable, /) -> None:
        self.outbox.sent(key, "read_done", self.remote[key])

    def observe(self, key: Hashable, /) -> set[str]:
        return set()


# -- ids crossing spaces (seed 004's class of bug) ---------------------------------------------------------------------


class FreesByTheKey(HeldBlocks):
    """Holds the blocks under the peer's id (as a prefill's pool does) but frees them under the key: they stay held."""

    def __init__(self) -> None:
        super().__init__()
        self.serial = 0
        self.remote: dict[Hashable, str] = {}

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> dict[str, str]:
        self.serial += 1
        self.remote[key] = f"p-{self.serial}"
        self.held.add(self.remote[key])
        return {"remote_request_id": self.remote[key]}

    def free_blocks(self, key: Hashable, /) -> None:
        self.held.discard(key)  # the bug: the blocks are held under self.remote[key]

    def observe(self, key: Hashable, /) -> set[str]:
        return {"blocks"} if self.remote.get(key) in self.held else set()


class NotifiesWithTheKey(Notifier):
    """Seed 004's shape: tells the peer it is done using this side's own id, not the one the peer knows."""

    def notify(self, key: Hashable, /) -> None:
        self.outbox.sent(key, "read_done", key)


class NotifiesWithTheFirstId(Notifier):
    """Keeps the peer's id of a key's first instance: a key begun again sends an id from a retired generation."""

    def before_begin(self, key: Hashable, resources: frozenset[str], /) -> dict[str, str]:
        first = self.remote.get(key)
        payload = super().before_begin(key, resources)
        if first is not None:
            self.remote[key] = first  # the bug: the new instance's id is forgotten
        return payload


# -- counted and early messages: a NIXL-shaped prefill that holds blocks for K readers -----------------------------

READS_SPEC = """\
# One request's KV blocks on a prefill rank, held until each of its decode readers has said it has read them
# (the shape of kvfsm/specs/nixl_prefill.yaml): `read` is counted by the distinct readers that sent it, and a
# notification that comes before the request is begun is kept, then applied at begin.
kvfsm: 1
machine: read_hold
key: request_id
params:
  abort_timeout: 30.0
  early_within: 5.0
resources:
  kv_blocks: {acquire: hold_blocks, release: free_blocks, doc: the connector's hold on the request's blocks}
states:
  held:    {initial: true, holds: [kv_blocks], timeout: {after: abort_timeout, fire: expire}}
  read:    {final: success}
  expired: {final: failure}
  aborted: {final: failure}
transitions:
  - {event: read,   from: held, to: read, payload: [readers], count: readers}
  - {event: expire, from: held, to: expired}
  - {event: abort,  from: "*",  to: aborted}
events:
  read: {by: request_id, remote: true, early: {keep: 64, within: early_within}}
ignore:
  - {event: [read, expire, abort], in: [read, expired, aborted]}
"""


class ReadHolder(Faults):
    """The correct prefill driver of :data:`READS_SPEC`: a pool hold per request, freed by the spec's release.

    ``receive`` is its notification path (:class:`kvfsm.testing.ReceivesMessages`): it hands every notification
    to the Tracker, which counts the distinct readers and keeps one that comes before the request.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(16)
        self.blocks: dict[Hashable, list[int]] = {}

    def hold_blocks(self, key: Hashable) -> None:
        self.maybe_raise("hold_blocks", key)
        self.blocks[key] = self.pool.allocate(key, 2)

    def free_blocks(self, key: Hashable) -> None:
        self.pool.free(key, self.blocks.pop(key))

    def receive(self, event: str, ident: Hashable, payload: dict[str, Any]) -> bool:
        return True

    def observe(self, key: Hashable) -> set[str]:
        return {"kv_blocks"} if self.pool.held_by(key) else set()


class CountsRawReads(ReadHolder):
    """Counts every notification of a request in a table of its own and frees the blocks on the ``readers``-th:
    a reader that notifies twice completes the count while another reader's READ is still in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[Hashable] = Counter()

    def receive(self, event: str, ident: Hashable, payload: dict[str, Any]) -> bool:
        if event == "read" and ident in self.blocks:
            self.reads[ident] += 1  # the bug: not who sent it, just how many came
            if self.reads[ident] >= payload.get("readers", 1):
                super().free_blocks(ident)
        return True

    def free_blocks(self, key: Hashable) -> None:
        self.reads.pop(key, None)
        if key in self.blocks:  # freed already when the table's count completed
            super().free_blocks(key)


class FreesOnFirstRead(ReadHolder):
    """Frees the blocks on a request's first notification, as if every request had one reader."""

    def receive(self, event: str, ident: Hashable, payload: dict[str, Any]) -> bool:
        if event == "read" and ident in self.blocks:
            super().free_blocks(ident)  # the bug: the other readers may still be reading
        return True

    def free_blocks(self, key: Hashable) -> None:
        if key in self.blocks:
            super().free_blocks(key)


class DropsEarlyReads(ReadHolder):
    """Drops a notification for a request it holds no blocks for (yet), instead of handing it on: one that comes
    before the request is begun is lost, and the blocks wait for the expiry (what vLLM's table of requests to
    process fixed)."""

    def receive(self, event: str, ident: Hashable, payload: dict[str, Any]) -> bool:
        return ident in self.blocks  # the bug: an id not begun yet is dropped, not kept


def write_reads_spec(folder: Path) -> Path:
    """:data:`READS_SPEC` as a file (``kvfsm test`` takes a path)."""
    path = folder / "read_hold.yaml"
    path.write_text(READS_SPEC)
    return path
