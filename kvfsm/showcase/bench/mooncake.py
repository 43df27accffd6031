"""Soak and overhead of the Mooncake store worker against a real ``mooncake_master``.

- :func:`soak`: thousands of requests (stores, dedup hits, loads, aborts)
  through :class:`~kvfsm.drivers.mooncake.MooncakeStoreWorker`, in the
  closed loop every soak runs (:func:`~kvfsm.harness.load.closed_loop`),
  with a fraction of the store calls failing as a fault plan says (raising,
  or negative codes: :func:`~kvfsm.harness.mooncake.store_plan`); at the end
  every request must have been reported exactly once, nothing may be live,
  and the pool must hold nothing: leaked blocks and hung requests are counted.
- :func:`throughput`: the same send-only workload through the kvfsm worker and
  through :class:`HandSendWorker`, vLLM's fixed sending thread (a counter per
  request, ``try/finally``), in one run: requests per second, and their ratio.
- :func:`per_job`: one thread, no waiting: a store job (pin, queue, check,
  put, release) done by the hand-written code against the same job through
  the kvfsm worker's Trackers, in µs: what kvfsm adds per job.

``python benchmarks/mooncake_soak.py`` runs all three (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import random
import statistics
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...drivers.mooncake import BlockBuffer, KVStore, MooncakeStoreWorker, StoreSender, block_key, connect
from ...drivers.mooncake.codes import check_codes
from ...errors import ActionError
from ...harness.load import closed_loop
from ...harness.mooncake import FaultyStore, MasterProcess, store_plan

BLOCK_BYTES = 16 << 10

STORE_TIMEOUT = 30.0
"""The soak's store-job deadline (``store_timeout``), and so the time a request may take before it counts late."""


@dataclass
class SoakResult:
    requests: int
    loads: int
    seconds: float
    requests_per_s: float
    fault_rate: float
    faults_injected: dict[str, int]
    outcomes: dict[str, int]
    leaked_blocks: int
    leaked_holders: int
    hung_requests: int
    hung_loads: int
    reported_twice: int
    unfinished_tasks: int
    over_releases: int
    corrupt_loads: int
    failures: int
    late: int = 0
    """Requests reported sent after :data:`STORE_TIMEOUT`, the store jobs' own deadline (not a leak)."""
    latency_ms: dict[str, float] = field(default_factory=dict)
    """p50, p99 and max of a request's time from opening to its report (:meth:`~kvfsm.harness.load.Loop.ms`)."""

    @property
    def clean(self) -> bool:
        return not (
            self.leaked_blocks or self.leaked_holders or self.hung_requests or self.hung_loads or self.reported_twice
            or self.unfinished_tasks or self.over_releases or self.corrupt_loads
        )  # fmt: skip


def _fill(buffer: BlockBuffer, blocks: Sequence[int], content: int) -> list[str]:
    """Write block contents derived from ``content`` and return their hashes (same content ⇔ same hash)."""
    for i, b in enumerate(blocks):
        buffer.kv[b].fill_((content * 31 + i) % 251)
    return [f"{content:x}.{i}" for i in range(len(blocks))]


def soak(
    store: KVStore,
    *,
    requests: int = 2000,
    fault_rate: float = 0.10,
    seed: int = 0,
    blocks: int = 512,
    inflight: int = 32,
    load_fraction: float = 0.3,
    abort_fraction: float = 0.05,
    timeout: float = 300.0,
    sender: type[StoreSender] = StoreSender,
) -> SoakResult:
    """Run ``requests`` requests through a worker over ``store`` with ``fault_rate`` of its calls failing.

    The requests run in the closed loop of every soak
    (:func:`~kvfsm.harness.load.closed_loop`), ``inflight`` at a time: each
    saves its blocks (sometimes twice, as over two steps), may be aborted or
    preempted, finishes, and is open until the worker reports it sent. After
    some, a load of an earlier request's prefix follows; loads are not the
    loop's requests, but the soak waits for them to end too. A request the
    loop opens waits for 16 free blocks before it begins.

    ``timeout`` bounds the whole soak: a sender that leaks stalls it (no room
    in the pool, too many requests never reported), and what it leaked by then
    is counted. ``sender``: the store-job driver to run, e.g. a copy with a known bug.
    """
    rng = random.Random(seed)
    faulty = FaultyStore(store, store_plan(fault_rate, seed))
    buffer = BlockBuffer(blocks, BLOCK_BYTES)
    pool = buffer.pool
    prefix = f"soak-{seed}-{time.time_ns():x}"
    worker = MooncakeStoreWorker(
        faulty,
        buffer,
        prefix=prefix,
        params={"store_timeout": STORE_TIMEOUT},
        sender=sender(faulty, buffer, prefix=prefix),
    )
    sent: Counter[Hashable] = Counter()
    recved: Counter[Hashable] = Counter()
    loading: dict[Hashable, tuple[list[int], int]] = {}
    contents: list[int] = []
    waiting: deque[str] = deque()  # opened by the loop, not begun: no room in the pool yet
    begun: set[Hashable] = set()
    corrupt = loads = 0

    def drain() -> list[Hashable]:
        """Take the worker's reports; returns the requests reported sent for the first time."""
        nonlocal corrupt
        done = worker.get_finished()
        ended: list[Hashable] = []
        for rid in done.sending:
            sent[rid] += 1
            if sent[rid] == 1 and rid in begun:
                ended.append(rid)
        for rid in done.recving:
            recved[rid] += 1
            if rid in loading:
                dst, content = loading.pop(rid)
                for i, b in enumerate(dst):
                    if b not in done.invalid_blocks and int(buffer.kv[b][0]) != (content * 31 + i) % 251:
                        corrupt += 1
                pool.release(rid, dst)
        return ended

    def begin(rid: str) -> None:
        """Save ``rid``'s blocks, maybe abort or preempt it, finish it, and maybe load an earlier prefix."""
        nonlocal loads
        begun.add(rid)
        n = rng.randint(1, 4)
        content = rng.choice(contents) if contents and rng.random() < 0.2 else len(begun)  # 20% repeat a prefix
        contents.append(content)
        held = pool.allocate(rid, n)
        hashes = _fill(buffer, held, content)
        if n > 1 and rng.random() < 0.5:
            worker.save(rid, held[: n // 2], hashes[: n // 2])  # an earlier step's save
        worker.save(rid, held, hashes)
        if rng.random() < abort_fraction:
            worker.abort(rid) if rng.random() < 0.5 else worker.preempt(rid)
        worker.request_finished(rid)
        pool.release(rid)
        if rng.random() < load_fraction and len(contents) > 1:
            lid, old = f"L{loads}", rng.choice(contents[:-1])
            loads += 1
            old_hashes = [f"{old:x}.{i}" for i in range(4)]
            hits = worker.lookup(lid, old_hashes)
            if hits and pool.num_free >= hits:
                dst = pool.allocate(lid, hits)
                loading[lid] = (dst, old)
                worker.start_load(lid, dst)
            elif hits:
                worker.start_load(lid, [])

    def start(indices: range) -> list[Hashable]:
        rids = [f"r{i}" for i in indices]
        waiting.extend(rids)
        return list[Hashable](rids)

    def step() -> list[Hashable]:
        while waiting and pool.num_free >= 16:
            begin(waiting.popleft())
        return drain()

    def idle() -> bool:
        return not (worker.live() or worker.unfinished_tasks() or loading)

    try:
        loop = closed_loop(
            requests, inflight, start=start, step=step, idle=idle, deadline=STORE_TIMEOUT, settle=timeout,
            give_up=timeout,
        )  # fmt: skip
        drain()
    finally:
        worker.close()
    for load_id, (dst, _content) in loading.items():  # hung loads: give their blocks back so the pool count is honest
        pool.release(load_id, dst)
    return SoakResult(
        requests=len(begun),
        loads=loads,
        seconds=loop.wall,
        requests_per_s=len(begun) / loop.wall,
        fault_rate=fault_rate,
        faults_injected=dict(faulty.injected),
        outcomes=dict(sorted(worker.outcomes.items())),
        leaked_blocks=pool.num_blocks - pool.num_free,
        leaked_holders=pool.holder_count(),
        hung_requests=len(begun - set(sent)),
        hung_loads=len(loading),
        reported_twice=sum(1 for c in [*sent.values(), *recved.values()] if c > 1),
        unfinished_tasks=worker.unfinished_tasks(),
        over_releases=pool.refused_releases,
        corrupt_loads=corrupt,
        failures=len(worker.failures),
        late=loop.late,
        latency_ms=loop.ms(),
    )


# -- the hand-written baseline ----------------------------------------------------------


class HandSendWorker:
    """vLLM's store-sending thread after PR #43742, written by hand: a counter per request, try/finally."""

    def __init__(self, store: KVStore, buffer: BlockBuffer, *, prefix: str, start: bool = True) -> None:
        self.store, self.buffer, self.pool, self.prefix = store, buffer, buffer.pool, prefix
        self.queue: queue.Queue[Any] = queue.Queue()
        self.stored_requests: Counter[Hashable] = Counter()
        self.finishing: set[Hashable] = set()
        self.jobs: dict[Hashable, tuple[Hashable, tuple[int, ...], list[str]]] = {}
        self.lock = threading.Lock()
        self.failed = 0
        self._seq = itertools.count()
        self._last = -1
        self.thread = threading.Thread(target=self._run, daemon=True)
        if start:
            self.thread.start()

    def save(self, rid: Hashable, blocks: Sequence[int], hashes: Sequence[str]) -> None:
        self._last = next(self._seq)
        job = (rid, self._last)
        self.pool.pin(("store", job), blocks)
        with self.lock:
            self.stored_requests[rid] += 1
            self.jobs[job] = (rid, tuple(blocks), [block_key(self.prefix, h) for h in hashes])
        self.queue.put(job)

    def request_finished(self, rid: Hashable) -> bool:
        with self.lock:
            self.finishing.add(rid)
            return self.stored_requests[rid] > 0

    def get_finished(self) -> set[Hashable]:
        with self.lock:
            done = {r for r in self.finishing if self.stored_requests[r] == 0}
            self.finishing -= done
            for r in done:
                del self.stored_requests[r]
        return done

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                self.queue.task_done()
                return
            self.run_job(job)

    def run_job(self, job: Hashable) -> None:
        """``_handle_request`` after the fix: check, put the missing blocks, and release in ``finally``."""
        with self.lock:
            rid, blocks, keys = self.jobs.pop(job)
        try:
            exists = check_codes("batch_is_exist", keys, self.store.batch_is_exist(keys))
            missing = [i for i, c in enumerate(exists) if c == 0]
            if missing:
                ks = [keys[i] for i in missing]
                ptrs = [self.buffer.ptr(blocks[i]) for i in missing]
                check_codes(
                    "batch_put_from", ks, self.store.batch_put_from(ks, ptrs, [self.buffer.block_bytes] * len(ks))
                )
        except Exception:
            self.failed += 1
        finally:
            self.pool.release(("store", job), blocks)
            with self.lock:
                self.stored_requests[rid] -= 1
            self.queue.task_done()

    def save_job(self, rid: Hashable, blocks: Sequence[int], hashes: Sequence[str]) -> Hashable:
        """:meth:`save`, returning the job id (for running it in this thread)."""
        self.save(rid, blocks, hashes)
        return (rid, self._last)

    def close(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join(10)


@dataclass
class ThroughputResult:
    requests: int
    fault_rate: float
    hand_requests_per_s: float
    kvfsm_requests_per_s: float
    ratio: float
    """kvfsm ÷ hand-written: 1.0 means no cost."""
    repeats: int
    all_reported: bool


def _send_workload(
    save: Callable[[str, list[int], list[str]], object],
    finished: Callable[[str], object],
    drain: Callable[[], set[Hashable]],
    buffer: BlockBuffer,
    requests: int,
    salt: int,
) -> tuple[float, int]:
    """Requests of 2 blocks, up to 32 in flight; returns (seconds, requests reported)."""
    pool = buffer.pool
    reported = 0
    issued = 0
    start = time.perf_counter()
    while reported < requests:
        reported += len(drain())
        while issued < requests and issued - reported < 32 and pool.num_free >= 2:
            rid = f"t{salt}-{issued}"
            held = pool.allocate(rid, 2)
            save(rid, held, _fill(buffer, held, salt * 1_000_000 + issued))
            finished(rid)
            pool.release(rid)
            issued += 1
        time.sleep(0.0002)
    return time.perf_counter() - start, reported


def _sending(worker: MooncakeStoreWorker) -> Callable[[], set[Hashable]]:
    return lambda: worker.get_finished().sending


def throughput(store: KVStore, *, requests: int = 1000, fault_rate: float = 0.10, repeats: int = 3) -> ThroughputResult:
    """Send-only requests/s through the kvfsm worker and the hand-written one, interleaved repeat by repeat."""
    hand, ours = [], []
    ok = True
    for r in range(-1, repeats):  # repeat -1 warms the master up and is not counted
        for variant in (0, 1) if r % 2 == 0 else (1, 0):
            buffer = BlockBuffer(256, BLOCK_BYTES)
            faulty = FaultyStore(store, store_plan(fault_rate, r + 1))
            salt = time.time_ns() % 1_000_000_007
            prefix = f"tp-{salt:x}"
            if variant == 0:
                assert faulty.register_buffer(buffer.kv.data_ptr(), buffer.nbytes) >= 0
                h = HandSendWorker(faulty, buffer, prefix=prefix)
                secs, n = _send_workload(h.save, h.request_finished, h.get_finished, buffer, requests, salt)
                h.close()
                faulty.unregister_buffer(buffer.kv.data_ptr())
                if r >= 0:
                    hand.append(requests / secs)
            else:
                w = MooncakeStoreWorker(faulty, buffer, prefix=prefix, load_threads=0)
                secs, n = _send_workload(w.save, w.request_finished, _sending(w), buffer, requests, salt)
                w.close()
                if r >= 0:
                    ours.append(requests / secs)
            ok = ok and n == requests and buffer.pool.num_free == buffer.num_blocks
    h_rate, k_rate = statistics.median(hand), statistics.median(ours)
    return ThroughputResult(requests, fault_rate, h_rate, k_rate, k_rate / h_rate, repeats, ok)


@dataclass
class PerJobResult:
    jobs: int
    blocks_per_job: int
    direct_us: float
    kvfsm_us: float
    overhead_us: float
    ratio: float
    store: str = field(default="")


def per_job(
    store: KVStore, *, jobs: int = 1000, blocks_per_job: int = 2, repeats: int = 5, label: str = ""
) -> PerJobResult:
    """µs per store job in one thread: :class:`HandSendWorker`'s code against the kvfsm worker's."""
    buffer = BlockBuffer(blocks_per_job * 2, BLOCK_BYTES)
    pool = buffer.pool
    assert store.register_buffer(buffer.kv.data_ptr(), buffer.nbytes) >= 0
    held = pool.allocate("req", blocks_per_job)
    salt = itertools.count()

    def direct() -> float:
        hand = HandSendWorker(store, buffer, prefix="pj", start=False)
        t0 = time.perf_counter()
        for j in range(jobs):
            job = hand.save_job("req", held, [f"{next(salt)}.{i}" for i in range(blocks_per_job)])
            hand.queue.get_nowait()  # what the sending thread does, in this thread
            hand.run_job(job)
            if j % 64 == 0:
                hand.get_finished()
        hand.get_finished()
        return time.perf_counter() - t0

    def tracked() -> float:
        w = MooncakeStoreWorker(store, buffer, prefix="pj", load_threads=0, start=False, register=False)
        try:
            t0 = time.perf_counter()
            for j in range(jobs):
                job = w.save("req", held, [f"{next(salt)}.{i}" for i in range(blocks_per_job)])
                w.sender.queue.get_nowait()  # what the sending thread does, in this thread
                try:
                    w.send.fire(job, "check")
                    w.send.fire(job, "put")
                except ActionError:
                    pass
                if j % 64 == 0:
                    w.get_finished()
            w.get_finished()
            return time.perf_counter() - t0
        finally:
            w.close()

    times: dict[str, list[float]] = {"direct": [], "kvfsm": []}
    try:
        direct()  # warm-up, untimed: the master's first allocations are several times slower
        tracked()
        for r in range(repeats):
            order = (("direct", direct), ("kvfsm", tracked))
            for name, fn in order if r % 2 == 0 else order[::-1]:
                times[name].append(fn() / jobs * 1e6)
    finally:
        pool.release("req")
        store.unregister_buffer(buffer.kv.data_ptr())
    d, k = statistics.median(times["direct"]), statistics.median(times["kvfsm"])
    return PerJobResult(jobs, blocks_per_job, d, k, k - d, k / d, label)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks/mooncake_soak.py", description=__doc__.splitlines()[0])
    parser.add_argument("--master", help="host:port of a running mooncake_master (default: start one on loopback)")
    parser.add_argument("--requests", type=int, default=5000, help="soak requests (default 5000)")
    parser.add_argument("--fault-rate", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run whose figures mean little")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    master = None if args.master else MasterProcess().start()
    address = args.master or (master.address if master else "")
    try:
        store = connect(address, global_segment_size=1 << 30, local_buffer_size=64 << 20)
        try:
            soaked = soak(store, requests=max(100, args.requests // scale), fault_rate=args.fault_rate, seed=args.seed)
            store.remove_all(True)  # each phase starts with an empty segment
            tp = throughput(store, requests=max(100, 1000 // scale), fault_rate=args.fault_rate, repeats=5)
            store.remove_all(True)
            real = per_job(store, jobs=max(100, 1000 // scale), label="real master")
        finally:
            store.close()
        from ...drivers.mooncake import EmbeddedMaster, connect_embedded

        emb = per_job(
            connect_embedded(EmbeddedMaster(), global_segment_size=4 << 30),
            jobs=max(200, 2000 // scale),
            label="embedded store",
        )
    finally:
        if master is not None:
            master.stop()
    report = {
        "soak": asdict(soaked) | {"clean": soaked.clean},
        "throughput": asdict(tp),
        "per_job": [asdict(real), asdict(emb)],
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        s = soaked
        print(
            f"soak: {s.requests} requests + {s.loads} loads, {s.fault_rate:.0%} of store calls faulted "
            f"({sum(s.faults_injected.values())} faults), {s.seconds:.1f} s, {s.requests_per_s:.0f} requests/s"
        )
        print(f"  outcomes {s.outcomes}")
        lat = s.latency_ms
        print(
            f"  request latency p50 {lat.get('p50_ms', 0.0)} ms, p99 {lat.get('p99_ms', 0.0)} ms, "
            f"max {lat.get('max_ms', 0.0)} ms; {s.late} past the {STORE_TIMEOUT:.0f} s store deadline"
        )
        print(
            f"  leaked blocks {s.leaked_blocks}, leaked holders {s.leaked_holders}, hung requests {s.hung_requests}, "
            f"hung loads {s.hung_loads}, reported twice {s.reported_twice}, unfinished queue tasks {s.unfinished_tasks}, "
            f"over-releases {s.over_releases}, corrupt loads {s.corrupt_loads}: {'CLEAN' if s.clean else 'NOT CLEAN'}"
        )
        print(
            f"throughput (send only, {tp.requests} requests, {tp.fault_rate:.0%} faults, median of {tp.repeats}): "
            f"hand-written {tp.hand_requests_per_s:.0f}/s, kvfsm {tp.kvfsm_requests_per_s:.0f}/s, ratio {tp.ratio:.2f}"
        )
        for pj in (real, emb):
            print(
                f"per store job ({pj.store}, {pj.blocks_per_job} blocks): direct {pj.direct_us:.1f} µs, "
                f"kvfsm {pj.kvfsm_us:.1f} µs, +{pj.overhead_us:.1f} µs ({pj.ratio:.2f}x)"
            )
    return 0 if soaked.clean and tp.all_reported else 1


if __name__ == "__main__":
    sys.exit(main())
