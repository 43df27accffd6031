"""An in-process Mooncake master and store client with the real one's semantics, for fast tests and demos.

What it reproduces (each pinned by the shared suite in tests/test_mooncake_store.py,
which runs against this and the real ``mooncake_master`` alike):

- objects are immutable: ``put`` on an existing key returns 0 and keeps the first value;
- ``get``, ``get_into``, ``get_size`` and ``is_exist`` grant a read lease
  (``lease_ttl``); ``remove`` inside it returns -706 unless ``force``, and
  ``remove_all`` skips leased objects;
- missing keys: ``get`` returns ``b""``, the others -704, ``is_exist`` 0;
  an empty value and a read into a buffer too small give -600; a put beyond the
  mounted segments gives -200, and a ``put`` of bytes beyond the client's local
  buffer gives -600;
- a killed master makes calls return -900 (``get``: ``b""``); a restarted one
  has lost every object, and puts return -200 until the clients have remounted
  their segments (``remount_after`` seconds);
- calls after ``close()`` raise :class:`StoreClosed`, as :class:`MooncakeStore` does.

What it does not: replication, eviction, RDMA, and the real client's delays
(about 4 s per call against a dead master, 90 s for ``setup``).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from . import codes as C
from .codes import StoreClosed, StoreUnavailable


@dataclass
class _Object:
    data: bytes
    lease_until: float = 0.0


class EmbeddedMaster:
    """The master's state: objects, leases, mounted segments, and whether it is up.

    Clients find it by :attr:`address` (``embedded:N``), as real clients find a
    master by ``host:port``.
    """

    _registry: ClassVar[dict[str, EmbeddedMaster]] = {}
    _serial: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(
        self, *, lease_ttl: float = 10.0, remount_after: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lease_ttl = lease_ttl
        self.remount_after = remount_after
        self.clock = clock
        self.address = f"embedded:{next(self._serial)}"
        self.lock = threading.RLock()
        self.objects: dict[str, _Object] = {}
        self.used = 0
        """Bytes of all objects: kept with ``objects`` by :meth:`add` and :meth:`drop` (and cleared with it)."""
        self.segments: dict[int, int] = {}
        """Client id → bytes it contributes once mounted."""
        self.alive = True
        self.mounted_at = clock()
        """When the clients' segments are (or will be) mounted: a restart pushes it ``remount_after`` ahead."""
        self._registry[self.address] = self

    @classmethod
    def lookup(cls, address: str) -> EmbeddedMaster | None:
        return cls._registry.get(address)

    def kill(self) -> None:
        """Like SIGKILL: every call fails with -900 until :meth:`restart`; the objects are lost."""
        with self.lock:
            self.alive = False
            self.objects.clear()
            self.used = 0

    def restart(self) -> None:
        """Up again, empty; puts return -200 until the clients remount (``remount_after`` seconds)."""
        with self.lock:
            self.alive = True
            self.objects.clear()
            self.used = 0
            self.mounted_at = self.clock() + self.remount_after

    def stop(self) -> None:
        """Kill and forget the address: new clients cannot set up against it."""
        self.kill()
        self._registry.pop(self.address, None)

    # -- used by clients, under ``lock`` --------------------------------------

    def capacity(self) -> int:
        return sum(self.segments.values()) if self.clock() >= self.mounted_at else 0

    def add(self, key: str, data: bytes) -> None:
        self.objects[key] = _Object(data)
        self.used += len(data)

    def drop(self, key: str) -> None:
        self.used -= len(self.objects.pop(key).data)

    def lease(self, obj: _Object) -> None:
        obj.lease_until = max(obj.lease_until, self.clock() + self.lease_ttl)

    def leased(self, obj: _Object) -> bool:
        return self.clock() < obj.lease_until


class EmbeddedStore:
    """A client of an :class:`EmbeddedMaster`, with MooncakeDistributedStore's method names and return codes."""

    _ids: ClassVar[itertools.count[int]] = itertools.count(1)

    def __init__(self) -> None:
        self.master: EmbeddedMaster | None = None
        self.local_buffer_size = 0
        self._id = next(self._ids)
        self._buffers: dict[int, int] = {}
        self._closed = False

    def setup(
        self,
        local_hostname: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        master_server_addr: str,
    ) -> int:
        """0, or -1 when no master answers at ``master_server_addr`` (the real client takes ~90 s to say so)."""
        master = EmbeddedMaster.lookup(master_server_addr)
        if master is None or not master.alive or global_segment_size <= 0:
            return C.INTERNAL_ERROR
        with master.lock:
            master.segments[self._id] = global_segment_size
        self.master = master
        self.local_buffer_size = local_buffer_size
        return C.OK

    # -- plumbing ----------------------------------------------------------------

    def _live(self) -> EmbeddedMaster:
        if self._closed or self.master is None:
            what = "closed" if self._closed else "not set up"
            raise StoreClosed(f"embedded store client {self._id} is {what}")
        return self.master

    @staticmethod
    def _read(ptr: int, size: int) -> bytes:
        return ctypes.string_at(ptr, size)

    def _put(self, m: EmbeddedMaster, key: str, data: bytes) -> int:
        if not data:
            return C.INVALID_PARAMS
        if key in m.objects:
            return C.OK  # immutable: the first value stays
        if m.used + len(data) > m.capacity():
            return C.NO_AVAILABLE_HANDLE
        m.add(key, data)
        return C.OK

    def _get_into(self, m: EmbeddedMaster, key: str, ptr: int, size: int) -> int:
        obj = m.objects.get(key)
        if obj is None:
            return C.OBJECT_NOT_FOUND
        m.lease(obj)
        if size < len(obj.data):
            return C.INVALID_PARAMS
        ctypes.memmove(ptr, obj.data, len(obj.data))
        return len(obj.data)

    def _exists(self, m: EmbeddedMaster, key: str) -> int:
        obj = m.objects.get(key)
        if obj is None:
            return 0
        m.lease(obj)
        return 1

    def _remove(self, m: EmbeddedMaster, key: str, force: bool) -> int:
        obj = m.objects.get(key)
        if obj is None:
            return C.OBJECT_NOT_FOUND
        if m.leased(obj) and not force:
            return C.OBJECT_HAS_LEASE
        m.drop(key)
        return C.OK

    # -- the API -------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> int:
        m = self._live()
        with m.lock:
            if not m.alive:
                return C.RPC_FAIL
            if len(value) > self.local_buffer_size:
                return C.INVALID_PARAMS
            return self._put(m, key, bytes(value))

    def put_from(self, key: str, buffer_ptr: int, size: int) -> int:
        m = self._live()
        with m.lock:
            if not m.alive:
                return C.RPC_FAIL
            return self._put(m, key, self._read(buffer_ptr, size) if size > 0 else b"")

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        m = self._live()
        with m.lock:
            if not m.alive:
                return [C.RPC_FAIL] * len(keys)
            return [
                self._put(m, k, self._read(p, n) if n > 0 else b"")
                for k, p, n in zip(keys, buffer_ptrs, sizes, strict=True)
            ]

    def get(self, key: str) -> bytes:
        m = self._live()
        with m.lock:
            obj = m.objects.get(key) if m.alive else None
            if obj is None:
                return b""
            m.lease(obj)
            return obj.data

    def get_size(self, key: str) -> int:
        m = self._live()
        with m.lock:
            if not m.alive:
                return C.RPC_FAIL
            obj = m.objects.get(key)
            if obj is None:
                return C.OBJECT_NOT_FOUND
            m.lease(obj)
            return len(obj.data)

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        m = self._live()
        with m.lock:
            return self._get_into(m, key, buffer_ptr, size) if m.alive else C.RPC_FAIL

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        m = self._live()
        with m.lock:
            if not m.alive:
                return [C.RPC_FAIL] * len(keys)
            return [self._get_into(m, k, p, n) for k, p, n in zip(keys, buffer_ptrs, sizes, strict=True)]

    def is_exist(self, key: str) -> int:
        m = self._live()
        with m.lock:
            return self._exists(m, key) if m.alive else C.RPC_FAIL

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        m = self._live()
        with m.lock:
            if not m.alive:
                return [C.RPC_FAIL] * len(keys)
            return [self._exists(m, k) for k in keys]

    def remove(self, key: str, force: bool = False) -> int:
        m = self._live()
        with m.lock:
            return self._remove(m, key, force) if m.alive else C.RPC_FAIL

    def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
        m = self._live()
        with m.lock:
            if not m.alive:
                return [C.RPC_FAIL] * len(keys)
            return [self._remove(m, k, force) for k in keys]

    def remove_all(self, force: bool = False) -> int:
        """How many objects were removed (leased ones stay unless ``force``)."""
        m = self._live()
        with m.lock:
            if not m.alive:
                return C.RPC_FAIL
            return sum(self._remove(m, k, force) == C.OK for k in list(m.objects))

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        self._live()
        end = buffer_ptr + size
        if size <= 0 or any(p < end and buffer_ptr < p + n for p, n in self._buffers.items()):
            return C.INVALID_PARAMS  # the real engine refuses overlapping regions
        self._buffers[buffer_ptr] = size
        return C.OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        self._live()
        return C.OK if self._buffers.pop(buffer_ptr, None) is not None else C.INVALID_PARAMS

    def health_check(self) -> int:
        """0 healthy, 1 closed or not set up, 2 master unreachable (or still remounting after a restart)."""
        if self._closed or self.master is None:
            return 1
        m = self.master
        with m.lock:
            return 0 if m.alive and m.clock() >= m.mounted_at else 2

    def close(self) -> int:
        if not self._closed and self.master is not None:
            with self.master.lock:
                self.master.segments.pop(self._id, None)
        self._closed = True
        return C.OK


def connect_embedded(
    master: EmbeddedMaster, *, global_segment_size: int = 64 << 20, local_buffer_size: int = 32 << 20
) -> EmbeddedStore:
    """A set-up client of ``master`` (the embedded counterpart of :func:`~.store.connect`)."""
    store = EmbeddedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", global_segment_size, local_buffer_size, "tcp", "", master.address)
    if rc != C.OK:
        raise StoreUnavailable(f"no embedded master answers at {master.address} (setup returned {rc})")
    return store
