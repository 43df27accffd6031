"""The store interface kvfsm's Mooncake drivers use, and the real client behind a bounded, guarded connect.

:class:`KVStore` is the part a connector needs (existence check, zero-copy
batch put and get, buffer registration); :class:`ObjectStore` adds the rest of
the object API the embedded store mirrors. :func:`connect` sets up the real
``mooncake.store.MooncakeDistributedStore`` without the two traps measured on
it: ``setup`` against a master that is not running blocks the whole
interpreter for about 90 s (so the master is probed first, see :func:`probe`),
and a call after ``close()`` crashes the process (so :class:`MooncakeStore`
refuses it with :class:`StoreClosed`).
"""

from __future__ import annotations

import importlib
import socket
import threading
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from .codes import StoreClosed, StoreUnavailable


@runtime_checkable
class KVStore(Protocol):
    """What the store drivers call. Every method reports failure as negative codes, or raises."""

    def batch_is_exist(self, keys: list[str]) -> list[int]: ...
    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]: ...
    def register_buffer(self, buffer_ptr: int, size: int) -> int: ...
    def unregister_buffer(self, buffer_ptr: int) -> int: ...


@runtime_checkable
class ObjectStore(KVStore, Protocol):
    """The object API with the semantics the embedded store reproduces (see ``embedded.py``)."""

    def put(self, key: str, value: bytes) -> int: ...
    def get(self, key: str) -> bytes: ...
    def get_size(self, key: str) -> int: ...
    def is_exist(self, key: str) -> int: ...
    def put_from(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def get_into(self, key: str, buffer_ptr: int, size: int) -> int: ...
    def remove(self, key: str, force: bool = False) -> int: ...
    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]: ...
    def remove_all(self, force: bool = False) -> int: ...
    def health_check(self) -> int: ...
    def close(self) -> int: ...


def import_store_module() -> Any:
    """``mooncake.store``, or :class:`StoreUnavailable` saying why it cannot be imported."""
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as exc:
        if "libibverbs" in str(exc):
            fix = "install the system library: apt-get install -y --no-install-recommends libibverbs1"
        else:
            fix = "pip install 'kvfsm[mooncake]'"
        raise StoreUnavailable(f"the Mooncake wheel cannot be imported ({exc}); {fix}") from exc


def probe(address: str, timeout: float = 1.0) -> None:
    """Raise :class:`StoreUnavailable` unless a serving Mooncake master answers at ``host:port``.

    ``setup`` cannot be bounded from Python: it holds the interpreter lock
    while it retries (about 90 s), so a thread with a timeout never gets to
    time out. So the master is asked first, cheaply: it must accept a TCP
    connection and, sent a malformed request header, close it at once, as its
    RPC server does. Nothing listening (a dead master) fails in
    milliseconds; a stopped or hung master, or another service on the port,
    fails after ``timeout``.
    """
    host, _, port = address.rpartition(":")
    hint = f"start one first, e.g. mooncake_master --rpc_address={host or '127.0.0.1'} --rpc_port={port or 50051}"
    try:
        conn = socket.create_connection((host, int(port)), timeout)
    except (OSError, ValueError) as exc:
        raise StoreUnavailable(f"no Mooncake master answers at {address} ({exc}); {hint}") from exc
    with conn:
        try:
            conn.settimeout(timeout)
            conn.sendall(b"\0" * 32)  # not a valid RPC header: a serving master hangs up
            answer = conn.recv(64)
        except TimeoutError:
            answer = None
        except OSError:
            answer = b""  # reset by the peer: hung up, as a master does
    if answer is None:
        raise StoreUnavailable(
            f"{address} accepted a connection but did not answer within {timeout:g}s: a stopped or hung "
            f"mooncake_master, or another service; MooncakeDistributedStore.setup would block for ~90 s. {hint}"
        )
    if answer:
        raise StoreUnavailable(f"{address} answered {answer[:16]!r}: not a Mooncake master. {hint}")


class MooncakeStore:
    """The real client, refusing calls once closed; ``close()`` waits for calls in flight.

    Thread-safe as the client itself is; the guard adds one lock round trip per call.
    """

    def __init__(self, raw: Any, master_address: str) -> None:
        self.raw = raw
        self.master_address = master_address
        self._cv = threading.Condition()
        self._inflight = 0
        self._closed = False

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._cv:
            if self._closed:
                raise StoreClosed(f"store for master {self.master_address} is closed; {fn.__name__} refused")
            self._inflight += 1
        try:
            return fn(*args)
        finally:
            with self._cv:
                self._inflight -= 1
                if not self._inflight:
                    self._cv.notify_all()

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return list(self._call(self.raw.batch_is_exist, keys))

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return list(self._call(self.raw.batch_put_from, keys, buffer_ptrs, sizes))

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        return list(self._call(self.raw.batch_get_into, keys, buffer_ptrs, sizes))

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        return int(self._call(self.raw.register_buffer, buffer_ptr, size))

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return int(self._call(self.raw.unregister_buffer, buffer_ptr))

    def put(self, key: str, value: bytes) -> int:
        return int(self._call(self.raw.put, key, value))

    def get(self, key: str) -> bytes:
        return bytes(self._call(self.raw.get, key))

    def get_size(self, key: str) -> int:
        return int(self._call(self.raw.get_size, key))

    def is_exist(self, key: str) -> int:
        return int(self._call(self.raw.is_exist, key))

    def put_from(self, key: str, buffer_ptr: int, size: int) -> int:
        return int(self._call(self.raw.put_from, key, buffer_ptr, size))

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        return int(self._call(self.raw.get_into, key, buffer_ptr, size))

    def remove(self, key: str, force: bool = False) -> int:
        return int(self._call(self.raw.remove, key, force))

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        return list(self._call(self.raw.batch_remove, keys, force))

    def remove_all(self, force: bool = False) -> int:
        return int(self._call(self.raw.remove_all, force))

    def health_check(self) -> int:
        with self._cv:
            if self._closed:
                return 1  # the real client's answer for "closed"
        return int(self._call(self.raw.health_check))

    def close(self) -> int:
        """Refuse new calls, wait for those in flight, then close the client (about 1 s). Idempotent."""
        with self._cv:
            if self._closed:
                return 0
            self._closed = True
            while self._inflight:
                self._cv.wait()
        rc: int = self.raw.close()
        return rc


def connect(
    master_address: str,
    *,
    local_hostname: str = "127.0.0.1",
    metadata_server: str = "P2PHANDSHAKE",
    protocol: str = "tcp",
    global_segment_size: int = 64 << 20,
    local_buffer_size: int = 32 << 20,
    probe_timeout: float = 1.0,
) -> MooncakeStore:
    """A set-up client of the master at ``host:port``, or :class:`StoreUnavailable` within ``probe_timeout``.

    The master is probed first (:func:`probe`), so a master that is down or
    not answering fails fast instead of ``setup``'s 90 s of retries. What
    remains unbounded is a master that stops answering between the probe and
    ``setup`` (a few milliseconds).
    """
    module = import_store_module()
    probe(master_address, probe_timeout)
    raw = module.MooncakeDistributedStore()
    try:
        rc = raw.setup(
            local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol, "", master_address
        )
    except Exception as exc:
        raise StoreUnavailable(f"MooncakeDistributedStore.setup against {master_address} raised {exc!r}") from exc
    if rc != 0:
        raise StoreUnavailable(f"MooncakeDistributedStore.setup against {master_address} returned {rc}")
    return MooncakeStore(raw, master_address)
