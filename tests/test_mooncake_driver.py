"""The Mooncake store worker end to end, on the real master and the embedded store: stores, loads, faults.

After every scenario the same things must hold: every request was reported
(``finished_sending`` once), nothing is live past its deadline, every pin and
queue task was given back exactly once, and the pool holds only what the
requests themselves still hold.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from mooncake_fixtures import (  # noqa: F401
    Backend,
    PreFixSender,
    assert_everything_released,
    backend_fixture,
    mooncake_master_fixture,
    new_request,
    real_store_fixture,
    settle,
    unique,
)

from kvfsm.drivers.mooncake import (
    BlockBuffer,
    EmbeddedMaster,
    MooncakeStoreWorker,
    StoreError,
    block_key,
    codes,
    connect_embedded,
)
from kvfsm.harness.mooncake import STORE_FAULTS, FaultyStore, InjectedStoreFault, raising, returning, store_plan
from kvfsm.harness.mooncake.faults import FAILED_CODES, FAULTABLE, call_faults, call_keys
from kvfsm.testing import VirtualClock

BLOCKS = 64
BLOCK_BYTES = 4096


@pytest.fixture
def buffer() -> BlockBuffer:
    return BlockBuffer(BLOCKS, BLOCK_BYTES)


@pytest.fixture
def faulty(backend: Backend) -> FaultyStore:
    return FaultyStore(backend.store)


@pytest.fixture
def worker(faulty: FaultyStore, buffer: BlockBuffer) -> Iterator[MooncakeStoreWorker]:
    w = MooncakeStoreWorker(faulty, buffer, prefix=unique("kv"))
    yield w
    w.close()


def sent(reports: list) -> list:
    return [r for f in reports for r in sorted(f.sending)]


def stored_contents(backend: Backend, keys: list[str], n_bytes: int) -> list[torch.Tensor]:
    out = torch.zeros((len(keys), n_bytes), dtype=torch.uint8)
    got = backend.store.batch_get_into(keys, [out[i].data_ptr() for i in range(len(keys))], [n_bytes] * len(keys))
    assert got == [n_bytes] * len(keys), got
    return list(out)


def test_a_finished_request_is_stored_byte_exact_and_reported_once(
    backend: Backend, worker: MooncakeStoreWorker, buffer: BlockBuffer
) -> None:
    blocks, hashes = new_request(buffer, "r1", 4, seed=1)
    worker.save("r1", blocks, hashes)
    assert worker.request_finished("r1"), "a store job is live, so the blocks must be kept (delay_free)"
    expected = [buffer.kv[b].clone() for b in blocks]
    buffer.pool.release("r1")  # the scheduler lets go; the job's pin keeps the blocks until the put is done
    reports = settle(worker)
    assert sent(reports) == ["r1"]
    assert worker.outcomes == {"send:stored": 1, "request:sent": 1}
    keys = [block_key(worker.sender.prefix, h) for h in hashes]
    assert all(torch.equal(a, b) for a, b in zip(stored_contents(backend, keys, BLOCK_BYTES), expected, strict=True))
    assert_everything_released(worker, buffer)


def test_blocks_already_in_the_store_are_not_put_again(worker: MooncakeStoreWorker, buffer: BlockBuffer) -> None:
    blocks, hashes = new_request(buffer, "r1", 3, seed=2)
    worker.save("r1", blocks, hashes)
    settle(worker)
    worker.save("r1", blocks, hashes)
    worker.request_finished("r1")
    settle(worker)
    assert worker.sender.stats == {"blocks_put": 3, "blocks_deduped": 3}
    assert worker.outcomes == {"send:stored": 2, "request:sent": 1}
    buffer.pool.release("r1")
    assert_everything_released(worker, buffer)


def test_a_request_with_no_store_jobs_is_not_delayed(worker: MooncakeStoreWorker) -> None:
    assert not worker.request_finished("idle")
    assert worker.get_finished().sending == {"idle"}
    assert worker.get_finished().sending == set()


def test_a_lookup_hit_is_loaded_into_the_allocated_blocks(worker: MooncakeStoreWorker, buffer: BlockBuffer) -> None:
    blocks, hashes = new_request(buffer, "writer", 4, seed=3)
    worker.save("writer", blocks, hashes)
    worker.request_finished("writer")
    settle(worker)
    assert worker.lookup("reader", [*hashes, b"absent"]) == 4
    dst = buffer.pool.allocate("reader", 4)
    worker.start_load("reader", dst)
    reports = settle(worker)
    assert {r for f in reports for r in f.recving} == {"reader"}
    assert not any(f.invalid_blocks for f in reports)
    assert all(torch.equal(buffer.kv[a], buffer.kv[b]) for a, b in zip(blocks, dst, strict=True))
    assert worker.outcomes["load:loaded"] == 1
    buffer.pool.release("writer")
    buffer.pool.release("reader")
    assert_everything_released(worker, buffer)


def test_a_lookup_that_finds_nothing_is_a_miss(worker: MooncakeStoreWorker, buffer: BlockBuffer) -> None:
    assert worker.lookup("r", [b"never-stored"]) == 0
    settle(worker)
    assert worker.outcomes == {"load:missed": 1}
    assert_everything_released(worker, buffer)


@pytest.mark.parametrize("cause", ["evicted", "lookup raises", "hit"])
def test_a_load_the_scheduler_ordered_is_reported_once_whatever_the_worker_finds(
    worker: MooncakeStoreWorker, faulty: FaultyStore, buffer: BlockBuffer, cause: str
) -> None:
    """vLLM's scheduler looked the prefix up in its own process and waits from the order on: the worker's
    lookup finding less (an eviction since) or raising still reports the request once, every block invalid."""
    blocks, hashes = new_request(buffer, "writer", 3, seed=21)
    worker.save("writer", blocks, hashes)
    worker.request_finished("writer")
    settle(worker)
    if cause == "evicted":
        hashes = [b"evicted-since", *hashes[1:]]
    elif cause == "lookup raises":
        faulty.fail_next("batch_is_exist", raising("mooncake down"))
    dst = buffer.pool.allocate("reader", 3)
    worker.load_order("reader", hashes, dst)
    reports = settle(worker)
    assert [r for f in reports for r in f.recving] == ["reader"], "finished_recving exactly once"
    invalid = {b for f in reports for b in f.invalid_blocks}
    if cause == "hit":
        assert not invalid and all(torch.equal(buffer.kv[a], buffer.kv[b]) for a, b in zip(blocks, dst, strict=True))
        assert worker.outcomes["load:loaded"] == 1
    else:
        assert invalid == set(dst), "every block the scheduler allocated is recomputed"
        assert worker.outcomes["load:failed"] == 1
    buffer.pool.release("writer")
    buffer.pool.release("reader")
    assert_everything_released(worker, buffer)


# -- faults -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "fault", "action"),
    [
        ("batch_is_exist", raising("mooncake down"), "check_exists"),  # seed 000
        ("batch_is_exist", returning(codes.RPC_FAIL), "check_exists"),
        ("batch_put_from", raising("rdma error"), "put_blocks"),
        ("batch_put_from", returning(codes.NO_AVAILABLE_HANDLE, keys=1), "put_blocks"),
        ("batch_put_from", returning(codes.RPC_FAIL), "put_blocks"),
    ],
    ids=["exist-raises", "exist-rpc-fail", "put-raises", "put-one-key-no-handle", "put-rpc-fail"],
)
def test_a_failed_store_call_fails_the_job_and_still_releases_the_request(
    backend: Backend,
    faulty: FaultyStore,
    worker: MooncakeStoreWorker,
    buffer: BlockBuffer,
    call: str,
    fault: object,
    action: str,
) -> None:
    faulty.fail_next(call, fault)  # type: ignore[arg-type]
    blocks, hashes = new_request(buffer, "r1", 3, seed=4)
    worker.save("r1", blocks, hashes)
    assert worker.request_finished("r1")
    buffer.pool.release("r1")
    reports = settle(worker)
    assert sent(reports) == ["r1"], "the request must be reported even though its store failed"
    assert worker.outcomes == {"send:failed": 1, "request:sent": 1}
    (failure,) = worker.failures
    assert failure.action == action and failure.state == "failed"
    assert isinstance(failure.error, InjectedStoreFault | StoreError)
    if isinstance(failure.error, StoreError):  # a negative code is a failure, never a success
        assert set(failure.error.failed.values()) == {fault.code}  # type: ignore[attr-defined]
    assert_everything_released(worker, buffer)


@pytest.mark.parametrize(
    "fault", [raising("get failed"), returning(codes.OBJECT_NOT_FOUND, keys=1)], ids=["raises", "one-key-missing"]
)
def test_a_failed_load_reports_the_unfilled_blocks_invalid(
    faulty: FaultyStore, worker: MooncakeStoreWorker, buffer: BlockBuffer, fault: object
) -> None:
    blocks, hashes = new_request(buffer, "writer", 3, seed=5)
    worker.save("writer", blocks, hashes)
    worker.request_finished("writer")
    settle(worker)
    assert worker.lookup("reader", hashes) == 3
    dst = buffer.pool.allocate("reader", 3)
    faulty.fail_next("batch_get_into", fault)  # type: ignore[arg-type]
    worker.start_load("reader", dst)
    reports = settle(worker)
    invalid = {b for f in reports for b in f.invalid_blocks}
    assert {r for f in reports for r in f.recving} == {"reader"}
    assert invalid == (set(dst) if fault.error is not None else {dst[0]})  # type: ignore[attr-defined]
    assert worker.outcomes["load:failed"] == 1
    buffer.pool.release("writer")
    buffer.pool.release("reader")
    assert_everything_released(worker, buffer)


@pytest.mark.parametrize("end", ["abort", "preempt"])
def test_a_request_ended_while_its_jobs_are_queued_releases_each_once(
    backend: Backend, faulty: FaultyStore, buffer: BlockBuffer, end: str
) -> None:
    worker = MooncakeStoreWorker(faulty, buffer, prefix=unique("kv"), start=False)
    try:
        blocks, hashes = new_request(buffer, "r1", 4, seed=6)
        for i in range(3):  # three steps' saves, all waiting for a sending thread
            worker.save("r1", blocks[: i + 2], hashes[: i + 2])
        assert worker.sender.queue.unfinished_tasks == 3
        assert worker.request_finished("r1")
        getattr(worker, end)("r1")
        buffer.pool.release("r1")
        assert sent(settle(worker)) == ["r1"]
        assert worker.outcomes == {
            f"send:{'aborted' if end == 'abort' else 'preempted'}": 3,
            "request:sent": 1,
        }
        worker.start()  # the thread now takes the three stale entries off the queue
        deadline = time.monotonic() + 5
        while worker.send.counts["late"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.send.counts["late"] == 3  # each drained job's check: dropped and reported as late, nothing run
        assert worker.sender.queue.qsize() == 0
        assert not worker.bugs and not worker.failures
        assert backend.store.batch_is_exist([block_key(worker.sender.prefix, h) for h in hashes]) == [0] * 4
        assert_everything_released(worker, buffer)
    finally:
        worker.close()


def test_jobs_expire_when_the_sending_thread_never_runs_them(faulty: FaultyStore, buffer: BlockBuffer) -> None:
    clock = VirtualClock()  # the deadline fires on the poll after 0.2 s, and not before, however busy the machine
    worker = MooncakeStoreWorker(
        faulty, buffer, prefix=unique("kv"), start=False, params={"store_timeout": 0.2}, clock=clock
    )
    try:
        blocks, hashes = new_request(buffer, "r1", 2, seed=7)
        worker.save("r1", blocks, hashes)
        worker.request_finished("r1")
        buffer.pool.release("r1")
        clock.advance(0.19)
        assert sent([worker.get_finished()]) == [] and worker.live() == 1
        clock.advance(0.02)
        assert sent([worker.get_finished()]) == ["r1"]
        assert worker.outcomes == {"send:expired": 1, "request:sent": 1}
        assert_everything_released(worker, buffer)
    finally:
        worker.close()


def test_duplicate_and_late_completions_change_nothing(worker: MooncakeStoreWorker, buffer: BlockBuffer) -> None:
    blocks, hashes = new_request(buffer, "r1", 2, seed=8)
    job = worker.save("r1", blocks, hashes)
    deadline = time.monotonic() + 10
    while worker.send.state(job) != "stored" and time.monotonic() < deadline:
        time.sleep(0.002)
    assert worker.send.fire(job, "put") == "stored"  # a duplicate completion: ignored
    assert worker.send.fire(job, "fail") == "stored"  # a late failure report: ignored
    assert worker.send.counts["ignored"] == 2
    worker.request_finished("r1")
    buffer.pool.release("r1")
    settle(worker)
    assert worker.send.fire(job, "put") is None  # after the drain the id names nothing: reported, not applied
    # a drained job's id: "unknown", or "late" where the tracker remembers retired ids
    assert [(a.kind in ("unknown", "late"), a.event) for a in worker.send.anomalies()] == [(True, "put")]
    # a load's completion arriving after the request was aborted and looked up again
    assert worker.lookup("r2", hashes) == 2
    worker.abort("r2")
    settle(worker)
    assert worker.load.fire_by("request_id", "r2", "load") is None
    assert [(a.kind in ("unknown", "late"), a.space) for a in worker.load.anomalies()] == [(True, "request_id")]
    assert worker.sender.stats["blocks_put"] == 2
    assert_everything_released(worker, buffer)


def test_the_master_killed_mid_run_and_restarted(backend: Backend, faulty: FaultyStore, buffer: BlockBuffer) -> None:
    """Jobs during the outage fail (-900, or -200 while the client remounts) and are released; later ones store."""
    worker = MooncakeStoreWorker(faulty, buffer, prefix=unique("kv"), load_threads=1, params={"store_timeout": 15})
    try:

        def request(i: int) -> None:
            rid = f"r{i}"
            blocks, hashes = new_request(buffer, rid, 2, seed=100 + i)
            worker.save(rid, blocks, hashes)
            worker.request_finished(rid)
            buffer.pool.release(rid)

        for i in range(4):
            request(i)
        assert sorted(sent(settle(worker))) == [f"r{i}" for i in range(4)]
        backend.kill()
        for i in range(4, 6):  # a call against a dead master can take ~4 s to fail: keep the outage short
            request(i)
        assert sorted(sent(settle(worker, timeout=60))) == ["r4", "r5"]
        backend.restart()
        for i in range(6, 10):
            request(i)
        reports = settle(worker, timeout=30)
        assert worker.outcomes == {"send:stored": 8, "send:failed": 2, "request:sent": 10}
        assert {(f.action, f.state) for f in worker.failures} <= {("check_exists", "failed"), ("put_blocks", "failed")}
        assert sorted(sent(reports)) == [f"r{i}" for i in range(6, 10)]  # r0-r5 were reported by earlier settles
        assert_everything_released(worker, buffer)
    finally:
        worker.close()


def test_a_request_with_three_jobs_two_failing_is_reported_once_after_its_last_job(
    backend: Backend, faulty: FaultyStore, buffer: BlockBuffer
) -> None:
    """Seed 000's two paths in one request: one job's ``batch_is_exist`` raises, another's ``batch_put_from``.

    The driver keeps no count of a request's jobs (the request spec owns them): finished_sending comes
    exactly once, and only once none of the three is live, whatever order they end in.
    """
    worker = MooncakeStoreWorker(faulty, buffer, prefix=unique("kv"), start=False)
    try:
        blocks, hashes = new_request(buffer, "r1", 4, seed=12)
        jobs = [worker.save("r1", blocks[: n + 2], hashes[: n + 2]) for n in range(3)]  # three steps' saves
        assert worker.requests.owned("r1") == set(jobs)
        faulty.fail_next("batch_is_exist", raising("mooncake down"))  # the first job's check
        faulty.fail_next("batch_put_from", raising("rdma error"))  # the second job's put (the first never puts)
        assert worker.request_finished("r1"), "three jobs pin its blocks: vLLM must keep them (delay_free)"
        buffer.pool.release("r1")
        worker.start()
        reports: list[set[object]] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (worker.live() or not any("r1" in r for r in reports)):
            live_before = worker.requests.owned("r1")
            sending = worker.get_finished().sending
            reports.append(sending)
            if "r1" in sending:
                assert not worker.requests.owned("r1"), f"reported while {sorted(live_before)} still pinned"
            time.sleep(0.002)
        assert sum("r1" in r for r in reports) == 1, "finished_sending exactly once"
        assert worker.outcomes == {"send:failed": 2, "send:stored": 1, "request:sent": 1}
        assert sorted(f.action for f in worker.failures) == ["check_exists", "put_blocks"]
        assert_everything_released(worker, buffer)
    finally:
        worker.close()


def test_the_pre_fix_sender_leaks_the_pin_when_batch_is_exist_raises(faulty: FaultyStore, buffer: BlockBuffer) -> None:
    """Seed 000 on the driver: with releases only on the success path, the job's pin and queue task leak.

    The request is still reported: which of its jobs are live is the engine's to know (the request spec owns
    them), so there is no counter for the exception path to forget. What leaks shows in the pool and in
    ``observe()``, which ``kvfsm test`` compares with the spec (``test_mooncake_model.py``).
    """
    worker = MooncakeStoreWorker(faulty, buffer, sender=PreFixSender(faulty, buffer, prefix=unique("kv")))
    try:
        faulty.fail_next("batch_is_exist", raising("mooncake down"))
        blocks, hashes = new_request(buffer, "r1", 2, seed=9)
        worker.save("r1", blocks, hashes)
        assert worker.request_finished("r1")
        buffer.pool.release("r1")
        reported: set[object] = set()
        deadline = time.monotonic() + 20
        while "r1" not in reported and time.monotonic() < deadline:  # settle() would wait for the leaked task
            reported |= worker.get_finished().sending
            time.sleep(0.002)
        assert worker.outcomes == {"send:failed": 1, "request:sent": 1}, (
            "the spec says the job failed and released everything"
        )
        assert reported == {"r1"}, "the request's last job ended: reported, with no counter to forget"
        assert buffer.pool.num_free == BLOCKS - 2, "but the job's pin leaked: its GPU blocks stay pinned"
        assert worker.sender.queue.unfinished_tasks == 1, "and queue.join() would hang"
        assert worker.sender.observe(("r1", 1)) == {"block_pin", "queue_task"}
    finally:
        worker.close()


def test_a_load_whose_blocks_cannot_be_pinned_is_still_reported_with_every_block_invalid(
    worker: MooncakeStoreWorker, buffer: BlockBuffer
) -> None:
    blocks, hashes = new_request(buffer, "writer", 2, seed=10)
    worker.save("writer", blocks, hashes)
    worker.request_finished("writer")
    settle(worker)
    assert worker.lookup("reader", hashes) == 2
    free = [b for b in range(BLOCKS) if buffer.pool.refcount(b) == 0][:2]  # not allocated: the pool refuses to pin them
    worker.start_load("reader", free)
    reports = settle(worker)
    assert {r for f in reports for r in f.recving} == {"reader"}
    assert {b for f in reports for b in f.invalid_blocks} == set(free)
    assert [f.action for f in worker.failures] == ["pin_load_blocks"]
    buffer.pool.release("writer")
    assert_everything_released(worker, buffer)


def plan_driven_calls(seed: int, calls: int = 80) -> tuple[list[tuple[str, object]], FaultyStore]:
    """``calls`` rounds of put, exists and get on a fresh embedded store failing at 30%: each call's answer or error."""
    master = EmbeddedMaster()
    store = connect_embedded(master)
    faulty = FaultyStore(store, store_plan(0.3, seed))
    data = torch.arange(2 * BLOCK_BYTES, dtype=torch.int32).to(torch.uint8).reshape(2, BLOCK_BYTES)
    out = torch.zeros_like(data)
    assert faulty.register_buffer(data.data_ptr(), data.numel()) >= 0
    assert faulty.register_buffer(out.data_ptr(), out.numel()) >= 0
    seen: list[tuple[str, object]] = []
    put, get = [data[0].data_ptr(), data[1].data_ptr()], [out[0].data_ptr(), out[1].data_ptr()]
    try:
        for i in range(calls):
            keys = [f"k{i}.0", f"k{i}.1"]
            for op, args in (
                ("batch_put_from", (keys, put, [BLOCK_BYTES] * 2)),
                ("batch_is_exist", (keys,)),
                ("batch_get_into", (keys, get, [BLOCK_BYTES] * 2)),
            ):
                try:
                    seen.append((op, getattr(faulty, op)(*args)))
                except InjectedStoreFault as exc:
                    seen.append((op, str(exc)))
    finally:
        store.close()
        master.stop()
    return seen, faulty


def test_plan_driven_faults_are_the_same_in_every_run_and_the_ones_the_plan_counts() -> None:
    first, faulty = plan_driven_calls(seed=11)
    second, again = plan_driven_calls(seed=11)
    assert first == second and faulty.injected == again.injected
    assert set(faulty.injected) == set(STORE_FAULTS), "each call meets both of its faults at 30% of 80 calls"
    assert faulty.injected == faulty.planned()
    for op in FAULTABLE:  # the calls the one plan hits are the calls that failed, whichever fault it names
        hit = sum(faulty.plan.count(call_keys(op, faulty.calls[op])).values())
        assert faulty.injected[f"raising_{op}"] + faulty.injected[f"failed_{op}"] == hit
        answers = [a for o, a in first if o == op]
        for key, answer in zip(call_keys(op, faulty.calls[op]), answers, strict=True):
            fault = faulty.plan.fault(key, call_faults(op))  # what the n-th call met, read off the plan alone
            if fault is None or fault.startswith("failed_"):
                assert isinstance(answer, list)
                assert fault is None or answer[0] in FAILED_CODES, (key, answer)
            else:
                assert answer == f"injected {fault} ({key})"
    other, _ = plan_driven_calls(seed=12)
    assert other != first, "another seed fails other calls"
    faulty.fail_next("batch_is_exist")
    with pytest.raises(InjectedStoreFault):
        faulty.batch_is_exist(["k0.0"])
    assert faulty.injected["raising_batch_is_exist"] == again.injected["raising_batch_is_exist"] + 1, (
        "an armed fault is counted by its name too"
    )
