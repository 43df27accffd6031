"""Fixtures for the Mooncake tests: one real ``mooncake_master`` on loopback, its client, and the embedded twin.

Import the fixtures a test module needs (``from mooncake_fixtures import
backend_fixture``); pytest finds fixtures imported into a test module, under
their ``name`` (``backend``), so test arguments do not shadow the import.

- ``mooncake_master`` (session): ``mooncake_master`` on free 127.0.0.1 ports
  (RPC and metrics), read leases of ``LEASE_MS``; killed by pid at the end no
  matter what. Skips, with the import error as the reason, only where the
  wheel cannot be imported.
- ``real_store`` (session): one client of it (setting a client up takes ~0.1 s,
  closing one ~2 s, so tests share it and use unique keys).
- ``backend`` (per test, parametrised ``embedded`` / ``real``): a store plus the
  means to kill and restart its master. A test that kills the real master gets
  it restarted and the client serving again before the next test.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

from kvfsm.drivers.mooncake import (
    BlockBuffer,
    EmbeddedMaster,
    Finished,
    MooncakeStore,
    MooncakeStoreWorker,
    ObjectStore,
    StoreUnavailable,
    connect,
    connect_embedded,
)
from kvfsm.drivers.mooncake.store import import_store_module
from kvfsm.harness.mooncake import MasterProcess
from kvfsm.showcase.mooncake_modeltest import ModelSender
from kvfsm.showcase.prefix_sender import PreFixSender

LEASE_MS = 300
"""Read-lease TTL of the test masters: long enough to observe, short enough to wait out."""
BLOCK_BYTES = 4096


def require_wheel() -> None:
    """Skip (saying why) where the Mooncake wheel cannot be imported; anything else is a failure."""
    try:
        import_store_module()
    except StoreUnavailable as exc:
        pytest.skip(f"Mooncake store unavailable: {exc}")


@pytest.fixture(scope="session", name="mooncake_master")
def mooncake_master_fixture() -> Iterator[MasterProcess]:
    require_wheel()
    master = MasterProcess(lease_ttl_ms=LEASE_MS)
    try:
        master.start()
        yield master
    finally:
        master.kill()
        master.stop()


@pytest.fixture(scope="session", name="real_store")
def real_store_fixture(mooncake_master: MasterProcess) -> Iterator[MooncakeStore]:
    store = connect(mooncake_master.address)
    try:
        yield store
    finally:
        if not mooncake_master.running():
            mooncake_master.start()
        store.close()


@dataclass
class Backend:
    """A store under test and its master's life: ``kill()`` it, ``restart()`` it (returns once puts work)."""

    name: str
    store: ObjectStore
    lease_ttl: float
    kill: Callable[[], None]
    restart: Callable[[], None]


def wait_until_serving(store: ObjectStore, timeout: float = 15.0) -> float:
    """Put probe objects until one is accepted (a client remounts its segment after a master restart)."""
    start = time.monotonic()
    while True:
        rc = store.put(f"probe-{uuid.uuid4().hex}", b"probe")
        if rc == 0:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"the store did not serve again within {timeout}s (last put: {rc})")
        time.sleep(0.05)


def _embedded_backend() -> Backend:
    master = EmbeddedMaster(lease_ttl=LEASE_MS / 1000, remount_after=0.5)
    store = connect_embedded(master)

    def restart() -> None:
        master.restart()
        wait_until_serving(store)

    return Backend("embedded", store, master.lease_ttl, master.kill, restart)


@pytest.fixture(name="backend", params=["embedded", pytest.param("real", marks=pytest.mark.mooncake)])
def backend_fixture(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "embedded":
        yield _embedded_backend()
        return
    master: MasterProcess = request.getfixturevalue("mooncake_master")
    store: MooncakeStore = request.getfixturevalue("real_store")

    def restart() -> None:
        master.restart()
        wait_until_serving(store)

    yield Backend("real", store, LEASE_MS / 1000, master.kill, restart)
    if not master.running():  # a test that killed it and stopped early: serve the next test
        restart()


def unique(prefix: str = "t") -> str:
    """A key prefix no other test (or earlier run against the same master) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


# -- requests over a block pool ----------------------------------------------------


def chain_hashes(buffer: BlockBuffer, blocks: Sequence[int], parent: bytes = b"") -> list[bytes]:
    """vLLM-style block hashes: each covers its block's bytes and every block before it."""
    out = []
    for b in blocks:
        parent = hashlib.sha256(parent + buffer.kv[b].numpy().tobytes()).digest()[:16]
        out.append(parent)
    return out


def new_request(buffer: BlockBuffer, request_id: str, n: int, seed: int) -> tuple[list[int], list[bytes]]:
    """Allocate ``n`` blocks for ``request_id``, fill them with seeded random bytes, hash them."""
    blocks = buffer.pool.allocate(request_id, n)
    gen = torch.Generator().manual_seed(seed)
    for b in blocks:
        buffer.kv[b].copy_(torch.randint(0, 256, (buffer.block_bytes,), dtype=torch.uint8, generator=gen))
    return blocks, chain_hashes(buffer, blocks)


def settle(worker: MooncakeStoreWorker, timeout: float = 20.0, step: float = 0.002) -> list[Finished]:
    """Step the worker (``get_finished``) until nothing is live or queued; returns every report.

    Fails, saying what is still live, if that takes longer than ``timeout``:
    the tests' "no request hangs past its deadline".
    """
    reports = []
    deadline = time.monotonic() + timeout
    while True:
        reports.append(worker.get_finished())
        if not worker.live() and not worker.unfinished_tasks():
            reports.append(worker.get_finished())
            return reports
        if time.monotonic() > deadline:
            raise AssertionError(
                f"still live after {timeout}s: send {worker.send.census()}, load {worker.load.census()}, "
                f"unfinished tasks {worker.unfinished_tasks()}"
            )
        time.sleep(step)


def assert_everything_released(worker: MooncakeStoreWorker, buffer: BlockBuffer, *, held_by_requests: int = 0) -> None:
    """Every pin and queue task given back exactly once; only ``held_by_requests`` blocks still allocated."""
    assert buffer.pool.refused_releases == 0, "a holder released blocks it did not hold (a double release)"
    assert worker.unfinished_tasks() == 0, "a queue task was never marked done"
    assert worker.sender.outstanding_tasks() == 0 and worker.loader.outstanding_tasks() == 0
    assert worker.sender.pinned() == 0, "a store job still pins its request's blocks"
    assert not any(worker.requests.owned(r) for r, _ in worker.requests.snapshot()), "a request still owns live jobs"
    pins = [
        h
        for b in range(buffer.pool.num_blocks)
        for h in buffer.pool.holders(b)
        if isinstance(h, tuple) and h[0] in ("store", "load")
    ]
    assert not pins, f"pins left in the pool: {pins[:5]}"
    assert buffer.pool.num_blocks - buffer.pool.num_free == held_by_requests


class PreFixModelSender(PreFixSender, ModelSender):
    """The pre-fix sender (seed 000) with the model-based tests' planning and fault injection."""
