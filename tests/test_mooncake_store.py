"""The store semantics kvfsm's drivers rely on, pinned on the real master and the embedded store alike.

Every test runs against both backends (``backend`` is parametrised), so the
embedded store cannot drift from the real one: a difference fails here.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from mooncake_fixtures import (  # noqa: F401
    Backend,
    backend_fixture,
    mooncake_master_fixture,
    real_store_fixture,
    require_wheel,
    unique,
)

from kvfsm.drivers.mooncake import EmbeddedMaster, StoreClosed, StoreUnavailable, codes, connect, connect_embedded
from kvfsm.drivers.mooncake.store import probe
from kvfsm.harness.mooncake import MasterProcess
from kvfsm.harness.mooncake.master import free_port


def test_put_on_an_existing_key_keeps_the_first_value(backend: Backend) -> None:
    s, k = backend.store, unique()
    assert s.put(k, b"first") == 0
    assert s.put(k, b"second") == 0  # accepted, but objects are immutable
    assert s.get(k) == b"first"


def test_zero_copy_round_trip_through_registered_tensors(backend: Backend) -> None:
    s, k = backend.store, unique()
    src = torch.randint(0, 256, (4, 1024), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    assert s.register_buffer(src.data_ptr(), src.numel()) == 0
    assert s.register_buffer(dst.data_ptr(), dst.numel()) == 0
    try:
        keys = [f"{k}/{i}" for i in range(4)]
        assert s.batch_put_from(keys, [src[i].data_ptr() for i in range(4)], [1024] * 4) == [0] * 4
        assert s.batch_get_into(keys, [dst[i].data_ptr() for i in range(4)], [1024] * 4) == [1024] * 4
        assert torch.equal(src, dst)
        other = torch.full((1024,), 7, dtype=torch.uint8)
        assert s.batch_put_from(keys[:1], [other.data_ptr()], [1024]) == [0]  # not overwritten either
        assert s.get_into(keys[0], dst[1].data_ptr(), 1024) == 1024
        assert torch.equal(dst[1], src[0])
    finally:
        assert s.unregister_buffer(src.data_ptr()) == 0
        assert s.unregister_buffer(dst.data_ptr()) == 0


def test_missing_keys_answer_empty_zero_or_object_not_found(backend: Backend) -> None:
    s, k = backend.store, unique()
    buf = torch.zeros(64, dtype=torch.uint8)
    assert s.get(k) == b""
    assert s.is_exist(k) == 0
    assert s.batch_is_exist([k, k + "x"]) == [0, 0]
    assert s.get_size(k) == codes.OBJECT_NOT_FOUND
    assert s.remove(k) == codes.OBJECT_NOT_FOUND
    assert s.get_into(k, buf.data_ptr(), 64) == codes.OBJECT_NOT_FOUND
    assert s.batch_get_into([k], [buf.data_ptr()], [64]) == [codes.OBJECT_NOT_FOUND]


def test_empty_values_and_short_buffers_are_invalid_params(backend: Backend) -> None:
    s, k = backend.store, unique()
    assert s.put(k, b"") == codes.INVALID_PARAMS
    assert s.put(k, b"x" * 100) == 0
    small = torch.zeros(50, dtype=torch.uint8)
    assert s.get_into(k, small.data_ptr(), 50) == codes.INVALID_PARAMS
    big = torch.zeros(200, dtype=torch.uint8)
    assert s.get_into(k, big.data_ptr(), 200) == 100  # the object's size, into a larger buffer


@pytest.mark.parametrize("read", ["get", "get_size", "is_exist", "batch_is_exist", "get_into"])
def test_a_read_takes_a_lease_that_blocks_remove_until_it_expires(backend: Backend, read: str) -> None:
    s, k = backend.store, unique()
    assert s.put(k, b"v" * 10) == 0
    buf = torch.zeros(10, dtype=torch.uint8)
    {
        "get": lambda: s.get(k),
        "get_size": lambda: s.get_size(k),
        "is_exist": lambda: s.is_exist(k),
        "batch_is_exist": lambda: s.batch_is_exist([k]),
        "get_into": lambda: s.get_into(k, buf.data_ptr(), 10),
    }[read]()
    assert s.remove(k) == codes.OBJECT_HAS_LEASE
    time.sleep(backend.lease_ttl + 0.2)
    assert s.remove(k) == 0
    assert s.is_exist(k) == 0


def test_force_removes_a_leased_object(backend: Backend) -> None:
    s, k = backend.store, unique()
    assert s.put(k, b"v") == 0
    assert s.get(k) == b"v"
    assert s.remove(k) == codes.OBJECT_HAS_LEASE
    assert s.remove(k, True) == 0
    assert s.batch_remove([k], True) == [codes.OBJECT_NOT_FOUND]


def test_a_put_does_not_take_a_lease(backend: Backend) -> None:
    s, k = backend.store, unique()
    assert s.put(k, b"v") == 0
    assert s.remove(k) == 0


def test_remove_all_skips_leased_objects_unless_forced(backend: Backend) -> None:
    s, k = backend.store, unique()
    time.sleep(backend.lease_ttl + 0.2)  # earlier tests' leases run out
    s.remove_all(True)
    assert s.put(k + "a", b"a") == 0 and s.put(k + "b", b"b") == 0
    assert s.get(k + "a") == b"a"  # leased now
    assert s.remove_all() == 1
    assert s.batch_is_exist([k + "a", k + "b"]) == [1, 0]
    assert s.remove_all(True) == 1


def test_registering_an_overlapping_buffer_or_unregistering_twice_is_refused(backend: Backend) -> None:
    s = backend.store
    t = torch.zeros(4096, dtype=torch.uint8)
    assert s.register_buffer(t.data_ptr(), 4096) == 0
    assert s.register_buffer(t.data_ptr(), 4096) == codes.INVALID_PARAMS
    assert s.unregister_buffer(t.data_ptr()) == 0
    assert s.unregister_buffer(t.data_ptr()) == codes.INVALID_PARAMS


def test_a_killed_master_fails_calls_with_rpc_fail_and_a_restarted_one_is_empty(backend: Backend) -> None:
    s, k = backend.store, unique()
    assert s.put(k, b"before") == 0
    backend.kill()
    assert s.batch_is_exist([k]) == [codes.RPC_FAIL]
    assert s.put(k + "new", b"x") == codes.RPC_FAIL
    assert s.get(k) == b""
    backend.restart()
    assert s.is_exist(k) == 0, "a restarted master has lost every object"
    assert s.put(k, b"after") == 0
    assert s.get(k) == b"after"


def test_embedded_store_refuses_puts_beyond_its_segment() -> None:
    """A client with a 16 MiB segment, alone on its master: the fifth 4 MiB object does not fit."""
    s = connect_embedded(EmbeddedMaster(), global_segment_size=16 << 20)
    blob = torch.zeros(4 << 20, dtype=torch.uint8)
    answers = s.batch_put_from([f"big{i}" for i in range(5)], [blob.data_ptr()] * 5, [blob.numel()] * 5)
    assert answers == [0, 0, 0, 0, codes.NO_AVAILABLE_HANDLE]


@pytest.mark.mooncake
def test_real_store_refuses_puts_beyond_its_segment_and_calls_after_close() -> None:
    """As above, on a real master of its own; then the client is closed and refuses calls instead of crashing."""
    require_wheel()
    with MasterProcess() as master:
        s = connect(master.address, global_segment_size=16 << 20, local_buffer_size=16 << 20)
        blob = torch.zeros(4 << 20, dtype=torch.uint8)
        answers = s.batch_put_from([f"big{i}" for i in range(5)], [blob.data_ptr()] * 5, [blob.numel()] * 5)
        assert answers == [0, 0, 0, 0, codes.NO_AVAILABLE_HANDLE]
        assert s.close() == 0
        with pytest.raises(StoreClosed):
            s.batch_is_exist(["big0"])
        assert s.health_check() == 1


def test_an_embedded_client_refuses_calls_after_close() -> None:
    s = connect_embedded(EmbeddedMaster())
    assert s.close() == 0
    with pytest.raises(StoreClosed):
        s.batch_is_exist(["k"])
    assert s.health_check() == 1


# -- connecting without setup's 90-second stall ---------------------------------------


@pytest.mark.mooncake
def test_connect_fails_fast_when_no_master_listens() -> None:
    require_wheel()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="no Mooncake master answers"):
        connect(f"127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 2


@pytest.mark.mooncake
def test_connect_fails_fast_when_the_port_is_not_a_serving_master() -> None:
    """A silent listener stands in for a hung master: setup would block the interpreter, so it is never called."""
    require_wheel()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="did not answer"):
            connect(f"127.0.0.1:{listener.getsockname()[1]}", probe_timeout=0.5)
        assert time.monotonic() - started < 3


def wait_until_stopped(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP is delivered asynchronously: wait until every thread of ``pid`` is in the stopped state."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = [stat.read_text().rpartition(")")[2].split()[0] for stat in Path(f"/proc/{pid}/task").glob("*/stat")]
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    pytest.fail(f"mooncake_master {pid} did not stop within {timeout} s of SIGSTOP")


@pytest.mark.mooncake
def test_connect_refuses_a_stopped_master_and_accepts_it_once_resumed() -> None:
    require_wheel()
    with MasterProcess() as master:
        assert master.pid is not None
        os.kill(master.pid, signal.SIGSTOP)
        try:
            wait_until_stopped(master.pid)  # else its RPC thread may still hang up on the probe, and setup blocks 90 s
            with pytest.raises(StoreUnavailable, match="did not answer"):
                connect(master.address, probe_timeout=0.5)
        finally:
            os.kill(master.pid, signal.SIGCONT)
        probe(master.address)  # serving again: the probe passes
