"""Fault injection in front of any store: make chosen calls raise or return negative codes.

It wraps the real client or the embedded one alike, so the driver under test
runs its real code against a real store and meets the failures seen in
production: ``batch_is_exist`` raising (seed 000), ``batch_put_from``
returning -200 or -900 for some keys, ``batch_get_into`` failing mid-load.
Faults are armed one by one (:meth:`FaultyStore.fail_next`) or come from the
project's one fault plan (:class:`~kvfsm.harness.faults.FaultPlan`, soak
tests): the n-th call of ``op`` is the opportunity ``op#n``, so the same
plan fails the same calls in every run and process, and what it injects is
known in advance. The faults are :data:`STORE_FAULTS`: ``raising_<call>``
(the call raises :class:`InjectedStoreFault`) and ``failed_<call>`` (the
first key answers a negative code, the rest what the store answered).
"""

from __future__ import annotations

import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ...drivers.mooncake import codes as C
from ...drivers.mooncake.store import KVStore
from ..faults import FaultPlan

FAULTABLE = ("batch_is_exist", "batch_put_from", "batch_get_into")
"""The calls a store job or a load makes; faults go there."""


def call_faults(op: str) -> tuple[str, str]:
    """The faults that can strike a call of ``op``: it raises, or it fails with a negative code."""
    return f"raising_{op}", f"failed_{op}"


STORE_FAULTS = tuple(fault for op in FAULTABLE for fault in call_faults(op))
"""Every fault a plan may name for a store: each of :data:`FAULTABLE` raising, or failing with a negative code."""

FAILED_CODES = (C.RPC_FAIL, C.NO_AVAILABLE_HANDLE, C.TRANSFER_FAIL)
"""What a ``failed_`` fault answers, one chosen by the call's key: the codes a master that did not answer gives."""


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

    def name(self, op: str) -> str:
        """This fault's name in a plan when it strikes ``op``: ``raising_<op>`` or ``failed_<op>``."""
        return f"{'raising' if self.error is not None else 'failed'}_{op}"


def raising(message: str = "injected fault") -> Fault:
    return Fault(error=InjectedStoreFault(message))


def returning(code: int, keys: int | None = None) -> Fault:
    return Fault(code=code, keys=keys)


def store_plan(rate: float, seed: int = 0, kinds: Sequence[str] = STORE_FAULTS) -> FaultPlan:
    """A plan that fails a fraction ``rate`` of a store's calls with ``kinds`` (:data:`STORE_FAULTS` by default)."""
    return FaultPlan(rate, kinds, seed, known=STORE_FAULTS)


def call_key(op: str, n: int) -> str:
    """The opportunity the ``n``-th call of ``op`` (from 0) is: what a plan decides its fault on."""
    return f"{op}#{n}"


def call_keys(op: str, calls: int) -> Iterable[str]:
    """The opportunities of the first ``calls`` calls of ``op``."""
    return (call_key(op, n) for n in range(calls))


class FaultyStore:
    """``store`` with faults injected into :data:`FAULTABLE` calls; other calls pass through.

    A call takes an armed fault (:meth:`fail_next`) first; otherwise ``plan``
    decides it, among that call's faults (:func:`call_faults`): a fraction
    ``plan.rate`` of each call's opportunities is hit, whatever other calls
    the plan names.

    A code fault for every key replaces the call: a put that "returned -900"
    wrote nothing, as with a master that did not answer.
    """

    def __init__(self, store: KVStore, plan: FaultPlan | None = None) -> None:
        self.store = store
        self.plan = plan if plan is not None else store_plan(0.0)
        self._armed: list[tuple[str, Fault]] = []
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        """Calls made so far, per call name: the ``n`` of the next call's :func:`call_key`."""
        self.injected: Counter[str] = Counter()
        """Faults injected so far, per fault name (``raising_batch_put_from``), armed ones included."""

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

    def planned(self) -> Counter[str]:
        """What the plan decides for the calls made so far (:meth:`FaultPlan.count` per call): ``injected``, unless a
        fault was armed."""
        with self._lock:
            calls = dict(self.calls)
        return sum((self.plan.count(call_keys(op, n), call_faults(op)) for op, n in calls.items()), Counter())

    def _fault_for(self, op: str) -> Fault | None:
        with self._lock:
            key = call_key(op, self.calls[op])
            self.calls[op] += 1
            for i, (armed_op, fault) in enumerate(self._armed):
                if armed_op == op:
                    del self._armed[i]
                    self.injected[fault.name(op)] += 1
                    return fault
            name = self.plan.fault(key, call_faults(op))
            if name is None:
                return None
            self.injected[name] += 1
        if name.startswith("raising_"):
            return raising(f"injected {name} ({key})")
        return returning(FAILED_CODES[zlib.crc32(key.encode()) % len(FAILED_CODES)], keys=1)

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
