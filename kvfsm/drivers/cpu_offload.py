"""The CPU-offload driver: the actions of ``specs/cpu_offload_load.yaml`` and ``specs/cpu_offload_store.yaml``.

Each action is a handful of holder operations on real block pools
(:class:`~kvfsm.drivers.block_pool.BlockPool`); the bytes move between two
:class:`~kvfsm.drivers.kv_cache.KVCache` tensors, copied by the worker. The
drivers only do what a transition tells them: *when* a pin is released is
the spec's business, so no driver method decides it. Each key holds blocks
in the pools as ``(resource, key)``, so ``observe(key)`` reads the pools.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from ..spec.bundled import SPECS
from .block_pool import BlockHash, BlockPool, BlockPoolError
from .kv_cache import KVCache, KVLayout
from .report import Report

LOAD_SPEC = SPECS / "cpu_offload_load.yaml"
STORE_SPEC = SPECS / "cpu_offload_store.yaml"


class LoadPlanError(BlockPoolError):
    """Phase B asked to load more blocks than phase A pinned, or none at all."""


def _observe(key: Hashable, pools: dict[str, BlockPool]) -> set[str]:
    """The resources whose holder ``(resource, key)`` really holds blocks in its pool."""
    return {resource for resource, pool in pools.items() if pool.held_by((resource, key))}


class LoadDriver:
    """Pins a CPU prefix hit, owes vLLM the load's report, holds the GPU blocks a load writes, and lets go.

    ``_hit[key]`` lists the pinned CPU blocks in prefix order, ``_first[key]``
    where they start in the request (both the ``cpu_hit`` record, gone with
    it), and ``_dst[key]`` the GPU blocks in the same order (the copy pairs
    them up); ``_owed[key]``
    lists the GPU blocks vLLM must recompute unless the copy completes
    (``complete`` releases the report with ``report_loaded``).
    Releases record the report in :attr:`report`.
    """

    def __init__(self, cpu_pool: BlockPool, gpu_pool: BlockPool, report: Report | None = None) -> None:
        self.cpu_pool = cpu_pool
        self.gpu_pool = gpu_pool
        self.report = report if report is not None else Report()
        """Where ``report_recv`` records each load vLLM waits for, for the next finished_recving."""
        self._pools = {"cpu_hit": cpu_pool, "gpu_dst": gpu_pool}
        self._hit: dict[Hashable, list[int]] = {}
        self._first: dict[Hashable, int] = {}
        self._dst: dict[Hashable, list[int]] = {}
        self._owed: dict[Hashable, list[int]] = {}

    # -- cpu_hit -------------------------------------------------------------------

    def pin_cpu_hit(self, key: Hashable, /, hashes: Sequence[BlockHash], first: int = 0) -> None:
        """Phase A: pin the longest cached prefix of ``hashes``, which starts at the request's block ``first``.
        Lookup and pin are one step."""
        blocks = self.cpu_pool.lookup(hashes)
        if not blocks:
            raise LoadPlanError(f"{key!r}: no block of the prefix is cached; begin a load only for a hit")
        self.cpu_pool.pin(("cpu_hit", key), blocks)
        self._hit[key] = blocks
        self._first[key] = first

    def unpin_cpu_hit(self, key: Hashable, /) -> None:
        self._hit.pop(key, None)
        self._first.pop(key, None)
        self.cpu_pool.release(("cpu_hit", key))

    def first_block(self, key: Hashable) -> int | None:
        """Where the pinned hit starts in the request (phase A's ``num_computed_tokens // block_size``), while pinned."""
        return self._first.get(key)

    # -- recv_report ---------------------------------------------------------------

    def owe_recv_report(self, key: Hashable, /, gpu_blocks: Sequence[int]) -> None:
        """Phase B: vLLM parks the request until it hears of the load; its GPU blocks are unverified."""
        self._owed[key] = list(gpu_blocks)

    def report_recv(self, key: Hashable, /) -> None:
        """Record the request for the next finished_recving, every GPU block to recompute (no copy completed)."""
        self.report.recv(key, self._owed.pop(key))

    def report_loaded(self, key: Hashable, /) -> None:
        """``complete``'s own release of the report: the copy filled every GPU block, nothing to recompute."""
        del self._owed[key]
        self.report.recv(key, [])

    # -- gpu_dst ---------------------------------------------------------------------

    def hold_gpu_dst(self, key: Hashable, /, gpu_blocks: Sequence[int]) -> None:
        """Phase B: hold ``gpu_blocks`` and keep only as many pinned CPU blocks; the rest are unpinned."""
        hit = self._hit[key]
        if not 0 < len(gpu_blocks) <= len(hit):
            raise LoadPlanError(
                f"{key!r}: phase B asks to load {len(gpu_blocks)} blocks but phase A pinned {len(hit)} "
                "(no tokens to load is the event 'skip')"
            )
        self.gpu_pool.pin(("gpu_dst", key), gpu_blocks)
        self._dst[key] = list(gpu_blocks)
        unused = hit[len(gpu_blocks) :]
        if unused:
            self.cpu_pool.release(("cpu_hit", key), unused)
            del hit[len(gpu_blocks) :]

    def free_gpu_dst(self, key: Hashable, /) -> None:
        self._dst.pop(key, None)
        self.gpu_pool.release(("gpu_dst", key))

    # -- queries -----------------------------------------------------------------

    def pinned(self, key: Hashable) -> list[int]:
        """The CPU blocks key pins now, in prefix order (a copy)."""
        return list(self._hit.get(key, ()))

    def transfer(self, key: Hashable) -> tuple[list[int], list[int]]:
        """The planned load: (CPU source blocks, GPU destination blocks)."""
        return list(self._hit[key]), list(self._dst[key])

    def observe(self, key: Hashable) -> set[str]:
        """What key really holds: blocks in the pools, and a report not yet recorded."""
        held = _observe(key, self._pools)
        if key in self._owed:
            held.add("recv_report")
        return held


class StoreDriver:
    """Holds a finished request's GPU blocks, takes CPU blocks for the copy, and publishes them once it is over.

    ``_src[key]`` lists the GPU blocks key holds in request order, ``_dst[key]``
    the CPU blocks it took and ``_hashes[key]`` the prefix hash each CPU block
    is published under.
    """

    def __init__(self, cpu_pool: BlockPool, gpu_pool: BlockPool) -> None:
        self.cpu_pool = cpu_pool
        self.gpu_pool = gpu_pool
        self._pools = {"gpu_src": gpu_pool, "cpu_dst": cpu_pool}
        self._src: dict[Hashable, list[int]] = {}
        self._dst: dict[Hashable, list[int]] = {}
        self._hashes: dict[Hashable, list[BlockHash]] = {}
        self.duplicates = 0
        """Blocks not published because another block was published under the same hash first."""

    def hold_gpu_src(self, key: Hashable, /, gpu_blocks: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Hold the finished request's blocks so they outlive the scheduler's free until the copy has read them."""
        if not gpu_blocks or len(gpu_blocks) != len(hashes):
            raise ValueError(
                f"{key!r}: {len(gpu_blocks)} GPU blocks to store and {len(hashes)} hashes; "
                "a store takes at least one block, one hash per block"
            )
        self.gpu_pool.pin(("gpu_src", key), gpu_blocks)
        self._src[key] = list(gpu_blocks)

    def alloc_cpu_dst(self, key: Hashable, /, gpu_blocks: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        """Take one CPU block per GPU block from the LRU end (raises NoFreeBlocks when too few are free)."""
        self._dst[key] = self.cpu_pool.allocate(("cpu_dst", key), len(gpu_blocks))
        self._hashes[key] = list(hashes)

    def publish(self, key: Hashable, /) -> None:
        """The copy is over: make the CPU blocks findable under their prefix hashes."""
        for block, block_hash in zip(self._dst[key], self._hashes[key], strict=True):
            if not self.cpu_pool.cache(block, block_hash):
                self.duplicates += 1

    def free_gpu_src(self, key: Hashable, /) -> None:
        self._src.pop(key, None)
        self.gpu_pool.release(("gpu_src", key))

    def free_cpu_dst(self, key: Hashable, /) -> None:
        """Let the CPU blocks go: published ones stay cached (evictable), unpublished ones are plain free."""
        self._dst.pop(key, None)
        self._hashes.pop(key, None)
        self.cpu_pool.release(("cpu_dst", key))

    def transfer(self, key: Hashable) -> tuple[list[int], list[int]]:
        """The planned store: (GPU source blocks, CPU destination blocks)."""
        return list(self._src[key]), list(self._dst[key])

    def observe(self, key: Hashable) -> set[str]:
        return _observe(key, self._pools)


class CpuOffload:
    """One engine's CPU offload: the GPU and CPU KV caches, the CPU pool, and the drivers of both machines.

    The GPU side is on CUDA when it is available (the CPU cache then in pinned
    host memory, so copies are DMA), on the CPU otherwise; ``device="meta"``
    allocates no bytes at all, for a scheduler process that only keeps books. ``gpu_pool`` is the
    scheduler's own GPU block pool when there is one (vLLM's
    ``bind_gpu_block_pool``); the drivers hold its blocks next to the
    scheduler's requests.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        *,
        gpu_pool: BlockPool | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        if gpu_pool is not None and gpu_pool.num_blocks != num_gpu_blocks:
            raise ValueError(f"gpu_pool has {gpu_pool.num_blocks} blocks, the GPU cache {num_gpu_blocks}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.layout = layout
        self.gpu_cache = KVCache(layout, num_gpu_blocks, device)
        # A scheduler-side instance keeps only the bookkeeping: on torch's "meta" device no bytes exist.
        cpu_device = "meta" if self.gpu_cache.device.type == "meta" else "cpu"
        self.cpu_cache = KVCache(layout, num_cpu_blocks, cpu_device, pin_memory=self.gpu_cache.device.type == "cuda")
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self.gpu_pool = gpu_pool if gpu_pool is not None else BlockPool(num_gpu_blocks)
        self.load = LoadDriver(self.cpu_pool, self.gpu_pool)
        self.store = StoreDriver(self.cpu_pool, self.gpu_pool)

    def check(self) -> None:
        """Raise :class:`BlockPoolError` if either pool's invariants are broken."""
        self.cpu_pool.check()
        self.gpu_pool.check()

    def driver_holdings(self) -> dict[Hashable, tuple[int, ...]]:
        """What the drivers hold in either pool, by ``(resource, key)`` holder: nothing once every key is over."""
        resources = {"cpu_hit", "gpu_dst", "gpu_src", "cpu_dst"}
        return {
            h: blocks
            for pool in (self.cpu_pool, self.gpu_pool)
            for h, blocks in pool.holdings().items()
            if isinstance(h, tuple) and len(h) == 2 and h[0] in resources
        }
