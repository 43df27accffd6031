"""Fault injection in front of any store: make chosen calls raise or return negative codes.

It wraps the real client or the embedded one alike, so the driver under test
runs its real code against a real store and meets the failures seen in
production: ``batch_is_exist`` raising (seed 000), ``batch_put_from``
returning -200 or -900 for some keys, ``batch_get_into`` failing mid-load.
Faults are armed one by one (:meth:`FaultyStore.fail_next`) or drawn at a
fixed rate from a seeded generator (soak tests).
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ...drivers.mooncake import codes as C
from ...drivers.mooncake.store import KVStore

FAULTABLE = ("batch_is_exist", "batch_put_from", "batch_get_into")
"""The calls a store job or a load makes; faults go there."""


class InjectedStoreFault(RuntimeError):
    """What an injected raise raises; distinct from every error the store itself raises."""


@dataclass(frozen=True)
class Fault:
    """One injected failure: raise ``error``, or answer ``code`` for every key (``keys=None``: the call never
    reaches the store) or for the first ``keys`` keys of an answer the store did give."""

    error: BaseException | None = None
    code: int = C.RPC_FAIL
    keys: int | None = None

    def answer(self, n: int, call: Callable[[], list[int]]) -> list[int]:
        """The faulted answer for an ``n``-key call; ``call`` asks the store (partial faults only)."""
        if self.error is not None:
            raise self.error
        if self.keys is None:
            return [self.code] * n  # the store was never reached
        bad = min(self.keys, n)
        return [self.code] * bad + list(call())[bad:]


def raising(message: str = "injected fault") -> Fault:
    return Fault(error=InjectedStoreFault(message))


def returning(code: int, keys: int | None = None) -> Fault:
    return Fault(code=code, keys=keys)


class FaultyStore:
    """``store`` with faults injected into :data:`FAULTABLE` calls; other calls pass through.

    A code fault for every key replaces the call: a put that "returned -900"
    wrote nothing, as with a master that did not answer.
    """

    def __init__(self, store: KVStore, *, rate: float = 0.0, seed: int = 0) -> None:
        self.store = store
        self.rate = rate
        self._rng = random.Random(seed)
        self._armed: list[tuple[str, Fault]] = []
        self._lock = threading.Lock()
        self.injected: Counter[str] = Counter()
        """Faults injected so far, per call name."""

    def fail_next(self, op: str, fault: Fault | None = None) -> None:
        """Make the next ``op`` call fail with ``fault`` (default: raise :class:`InjectedStoreFault`)."""
        if op not in FAULTABLE:
            raise ValueError(f"{op!r} cannot be faulted; choose one of {', '.join(FAULTABLE)}")
        with self._lock:
            self._armed.append((op, fault or raising(f"injected fault in {op}")))

    def pending(self) -> int:
        with self._lock:
            return len(self._armed)

    def clear(self) -> None:
        with self._lock:
            self._armed.clear()

    def _fault_for(self, op: str) -> Fault | None:
        with self._lock:
            for i, (armed_op, fault) in enumerate(self._armed):
                if armed_op == op:
                    del self._armed[i]
                    self.injected[op] += 1
                    return fault
            if self.rate and self._rng.random() < self.rate:
                self.injected[op] += 1
                if self._rng.random() < 0.5:
                    return raising(f"injected random fault in {op}")
                return returning(self._rng.choice((C.RPC_FAIL, C.NO_AVAILABLE_HANDLE, C.TRANSFER_FAIL)), keys=1)
            return None

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        fault = self._fault_for("batch_is_exist")
        if fault is None:
            return self.store.batch_is_exist(keys)
        return fault.answer(len(keys), lambda: self.store.batch_is_exist(keys))

    def batch_put_from(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        fault = self._fault_for("batch_put_from")
        if fault is None:
            return self.store.batch_put_from(keys, buffer_ptrs, sizes)
        return fault.answer(len(keys), lambda: self.store.batch_put_from(keys, buffer_ptrs, sizes))

    def batch_get_into(self, keys: list[str], buffer_ptrs: list[int], sizes: list[int]) -> list[int]:
        fault = self._fault_for("batch_get_into")
        if fault is None:
            return self.store.batch_get_into(keys, buffer_ptrs, sizes)
        return fault.answer(len(keys), lambda: self.store.batch_get_into(keys, buffer_ptrs, sizes))

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        return self.store.register_buffer(buffer_ptr, size)

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return self.store.unregister_buffer(buffer_ptr)
