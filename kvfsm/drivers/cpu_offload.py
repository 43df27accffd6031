"""The CPU-offload driver: the actions of ``specs/cpu_offload_load.yaml`` and ``specs/cpu_offload_store.yaml``.

Each action is a handful of reference-count operations on real block pools
(:class:`~kvfsm.drivers.block_pool.BlockPool`); the bytes move between two
:class:`~kvfsm.drivers.kv_cache.KVCache` tensors, copied by the worker. The
drivers only do what a transition tells them: *when* a pin is released is
the spec's business, so no driver method decides it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

import torch

from ..spec.bundled import SPECS
from .block_pool import BlockHash, BlockPool, BlockPoolError
from .kv_cache import KVCache, KVLayout

LOAD_SPEC = SPECS / "cpu_offload_load.yaml"
STORE_SPEC = SPECS / "cpu_offload_store.yaml"


class LoadPlanError(BlockPoolError):
    """Phase B asked to load more blocks than phase A pinned."""


def _held(pool: BlockPool, blocks: Iterable[int], holders: Counter[int]) -> bool:
    """Whether the pool's ref counts really cover ``blocks``: each has at least as many references as holders."""
    ref = pool.ref_cnt
    return all(ref[b] >= holders[b] for b in blocks)


class LoadDriver:
    """Pins a CPU prefix hit, holds the GPU blocks a load writes, and lets both go.

    ``_hit[key]`` lists the CPU blocks key pins (one reference each) and
    ``_dst[key]`` the GPU blocks it holds; an entry exists exactly while the
    spec says key holds the resource.
    """

    def __init__(self, cpu_pool: BlockPool, gpu_pool: BlockPool) -> None:
        self.cpu_pool = cpu_pool
        self.gpu_pool = gpu_pool
        self._hit: dict[Hashable, list[int]] = {}
        self._dst: dict[Hashable, list[int]] = {}

    # -- actions (each called as method(key, **payload)) -----------------------

    def pin_cpu_hit(self, key: Hashable, /, hashes: Sequence[BlockHash] = (), **_: Any) -> None:
        """Phase A: pin the longest cached prefix of ``hashes``. Lookup and pin are one step."""
        blocks = self.cpu_pool.lookup(hashes)
        self.cpu_pool.touch(blocks)
        self._hit[key] = blocks

    def plan_load(self, key: Hashable, /, gpu_blocks: Sequence[int] = (), **_: Any) -> None:
        """Phase B: keep the first ``len(gpu_blocks)`` pinned blocks for the load and unpin the rest."""
        hit = self._hit[key]
        if len(gpu_blocks) > len(hit):
            raise LoadPlanError(f"{key!r}: phase B asks to load {len(gpu_blocks)} blocks but phase A pinned {len(hit)}")
        self.cpu_pool.free(hit[len(gpu_blocks) :])
        del hit[len(gpu_blocks) :]

    def hold_gpu_dst(self, key: Hashable, /, gpu_blocks: Sequence[int] = (), **_: Any) -> None:
        self.gpu_pool.touch(gpu_blocks)
        self._dst[key] = list(gpu_blocks)

    def unpin_cpu_hit(self, key: Hashable, /, **_: Any) -> None:
        self.cpu_pool.free(self._hit.pop(key))

    def free_gpu_dst(self, key: Hashable, /, **_: Any) -> None:
        self.gpu_pool.free(self._dst.pop(key))

    # -- queries -----------------------------------------------------------------

    def pinned(self, key: Hashable) -> list[int]:
        """The CPU blocks key pins now (a copy)."""
        return list(self._hit.get(key, ()))

    def transfer(self, key: Hashable) -> tuple[list[int], list[int]]:
        """The planned load: (CPU source blocks, GPU destination blocks)."""
        return list(self._hit[key]), list(self._dst[key])

    def observe(self, key: Hashable) -> set[str]:
        """What key really holds: a resource counts only if the pool's ref counts cover every holder of its blocks."""
        held = set()
        cpu, gpu = self.references()
        if key in self._hit and _held(self.cpu_pool, self._hit[key], cpu):
            held.add("cpu_hit")
        if key in self._dst and _held(self.gpu_pool, self._dst[key], gpu):
            held.add("gpu_dst")
        return held

    def references(self) -> tuple[Counter[int], Counter[int]]:
        """References this driver owns, per block: (CPU, GPU)."""
        return Counter(b for bs in self._hit.values() for b in bs), Counter(b for bs in self._dst.values() for b in bs)


class StoreDriver:
    """Holds a finished request's GPU blocks, takes CPU blocks for the copy, and publishes them once it is over.

    ``_src[key]`` lists the GPU blocks key holds, ``_dst[key]`` the CPU blocks
    it took and ``_hashes[key]`` the prefix hash each CPU block is published under.
    """

    def __init__(self, cpu_pool: BlockPool, gpu_pool: BlockPool) -> None:
        self.cpu_pool = cpu_pool
        self.gpu_pool = gpu_pool
        self._src: dict[Hashable, list[int]] = {}
        self._dst: dict[Hashable, list[int]] = {}
        self._hashes: dict[Hashable, list[BlockHash]] = {}
        self.duplicates = 0
        """Blocks not published because another block was published under the same hash first."""

    def hold_gpu_src(
        self, key: Hashable, /, gpu_blocks: Sequence[int] = (), hashes: Sequence[BlockHash] = (), **_: Any
    ) -> None:
        if len(gpu_blocks) != len(hashes):
            raise ValueError(f"{key!r}: {len(gpu_blocks)} GPU blocks to store but {len(hashes)} hashes")
        self.gpu_pool.touch(gpu_blocks)
        self._src[key] = list(gpu_blocks)

    def alloc_cpu_dst(self, key: Hashable, /, hashes: Sequence[BlockHash] = (), **_: Any) -> None:
        """Take one CPU block per hash from the LRU end (raises NoFreeBlocks when too few are free)."""
        self._dst[key] = self.cpu_pool.get_new_blocks(len(hashes))
        self._hashes[key] = list(hashes)

    def publish(self, key: Hashable, /, **_: Any) -> None:
        """The copy is over: make the CPU blocks findable under their prefix hashes."""
        for block, block_hash in zip(self._dst[key], self._hashes[key], strict=True):
            if not self.cpu_pool.cache(block, block_hash):
                self.duplicates += 1

    def free_gpu_src(self, key: Hashable, /, **_: Any) -> None:
        self.gpu_pool.free(self._src.pop(key))

    def free_cpu_dst(self, key: Hashable, /, **_: Any) -> None:
        del self._hashes[key]
        self.cpu_pool.free(self._dst.pop(key))

    def transfer(self, key: Hashable) -> tuple[list[int], list[int]]:
        """The planned store: (GPU source blocks, CPU destination blocks)."""
        return list(self._src[key]), list(self._dst[key])

    def observe(self, key: Hashable) -> set[str]:
        held = set()
        cpu, gpu = self.references()
        if key in self._src and _held(self.gpu_pool, self._src[key], gpu):
            held.add("gpu_src")
        if key in self._dst and _held(self.cpu_pool, self._dst[key], cpu):
            held.add("cpu_dst")
        return held

    def references(self) -> tuple[Counter[int], Counter[int]]:
        """References this driver owns, per block: (CPU, GPU)."""
        return Counter(b for bs in self._dst.values() for b in bs), Counter(b for bs in self._src.values() for b in bs)


class CpuOffload:
    """One engine's CPU offload: the GPU and CPU KV caches, the CPU pool, and the drivers of both machines.

    The GPU side is on CUDA when it is available (the CPU cache then in pinned
    host memory, so copies are DMA), on the CPU otherwise. ``gpu_pool`` is the
    scheduler's own GPU block pool when there is one (vLLM's
    ``bind_gpu_block_pool``); the drivers take references on it next to the
    scheduler's.
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
        self.cpu_cache = KVCache(layout, num_cpu_blocks, "cpu", pin_memory=self.gpu_cache.device.type == "cuda")
        self.cpu_pool = BlockPool(num_cpu_blocks)
        self.gpu_pool = gpu_pool if gpu_pool is not None else BlockPool(num_gpu_blocks)
        self.load = LoadDriver(self.cpu_pool, self.gpu_pool)
        self.store = StoreDriver(self.cpu_pool, self.gpu_pool)

    def check_references(self, gpu_owners: Mapping[int, int] | None = None) -> None:
        """Raise :class:`BlockPoolError` unless every block's ref count is exactly what its holders account for.

        CPU blocks are referenced only by the drivers; GPU blocks by the
        drivers and by ``gpu_owners`` (block -> references the scheduler holds).
        """
        self.cpu_pool.check()
        self.gpu_pool.check()
        load_cpu, load_gpu = self.load.references()
        store_cpu, store_gpu = self.store.references()
        for name, pool, expected in (
            ("CPU", self.cpu_pool, load_cpu + store_cpu),
            ("GPU", self.gpu_pool, load_gpu + store_gpu + Counter(gpu_owners or {})),
        ):
            actual = Counter(pool.referenced())
            if actual != expected:
                diff = {
                    b: (actual[b], expected[b]) for b in sorted(set(actual) | set(expected)) if actual[b] != expected[b]
                }
                raise BlockPoolError(f"{name} ref counts differ from their holders (block: (ref_cnt, holders)): {diff}")
