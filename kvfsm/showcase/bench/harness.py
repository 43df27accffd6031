"""Timing, clocks and drivers shared by every benchmark, so all variants are measured alike.

Timing is timeit-style: each repeat builds its subject untimed, collects
garbage, then times one call of the workload with the collector disabled (as
``timeit`` does) and re-enables it. Variants of one comparison run interleaved,
repeat by repeat, in a rotating order, so drift on a shared machine hits all of
them alike; the figure kept is the median.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any

from ...engine import batch
from ...testing.clock import VirtualClock as VirtualClock  # one manual clock for benchmarks and tests

Workload = Callable[[], object]
"""A prepared, timed callable; what it returns is handed to the variant's check."""


class NullBatchDriver:
    """kv_request's actions as batch actions (one call per group of keys), doing nothing: for ``fire_many``."""

    __slots__ = ()

    @batch
    def enqueue_job(self, keys: list[Hashable]) -> None:
        pass

    @batch
    def start_transfer(self, keys: list[Hashable]) -> None:
        pass

    @batch
    def free_gpu_blocks(self, keys: list[Hashable]) -> None:
        pass

    @batch
    def task_done(self, keys: list[Hashable]) -> None:
        pass


class NullDriver:
    """Every action the bench specs name, doing nothing: the engine is measured, not the driver."""

    __slots__ = ()

    def enqueue_job(self, key: Hashable, **payload: Any) -> None:
        pass

    def start_transfer(self, key: Hashable, **payload: Any) -> None:
        pass

    def free_gpu_blocks(self, key: Hashable, **payload: Any) -> None:
        pass

    def task_done(self, key: Hashable, **payload: Any) -> None:
        pass

    def take_slot(self, key: Hashable, **payload: Any) -> None:
        pass

    def give_slot(self, key: Hashable, **payload: Any) -> None:
        pass


class RecordingDriver:
    """Records every action call, so the variants can be shown to do the same driver work."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Hashable]] = []

    def enqueue_job(self, key: Hashable, **payload: Any) -> None:
        self.calls.append(("enqueue_job", key))

    def start_transfer(self, key: Hashable, **payload: Any) -> None:
        self.calls.append(("start_transfer", key))

    def free_gpu_blocks(self, key: Hashable, **payload: Any) -> None:
        self.calls.append(("free_gpu_blocks", key))

    def task_done(self, key: Hashable, **payload: Any) -> None:
        self.calls.append(("task_done", key))

    def take_slot(self, key: Hashable, **payload: Any) -> None:
        self.calls.append(("take_slot", key))

    def give_slot(self, key: Hashable, **payload: Any) -> None:
        self.calls.append(("give_slot", key))


def time_once(workload: Workload) -> tuple[float, object]:
    """Seconds one call of ``workload`` takes with the collector off (after a full collection)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        result = workload()
        elapsed = time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed, result


def interleaved(
    setups: Mapping[str, Callable[[], Workload]],
    repeats: int,
    check: Callable[[str, object], None] | None = None,
) -> dict[str, float]:
    """Median seconds per variant over ``repeats`` rounds; each round runs every variant once.

    ``setups[name]()`` builds a fresh subject (untimed) and returns its workload.
    ``check(name, result)`` runs after each timed call, untimed, so a variant
    that silently did nothing fails loudly instead of looking fast.
    """
    names = list(setups)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            workload = setups[name]()
            elapsed, result = time_once(workload)
            del workload
            if check is not None:
                check(name, result)
            times[name].append(elapsed)
    return {n: statistics.median(ts) for n, ts in times.items()}
