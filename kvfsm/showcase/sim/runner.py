"""The worker side of the simulated engine: the model writing KV, a slow and faulty DMA engine, a flaky delivery of its outputs back.

The model writes into each block the bytes its prefix hash names
(:class:`KVPattern`), so any block anywhere can be checked: a load that
brought the wrong bytes, a store that read a reused block, a copy that
landed in someone else's block all show up as a mismatch.
"""

from __future__ import annotations

import copy as copying
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ...adapters.vllm_api import KVConnectorOutput
from ...adapters.vllm_cpu_offload import CpuOffloadMetadata, CpuOffloadWorker, CpuOffloadWorkerMeta
from ...drivers.kv_cache import Copy, Done, KVCache, KVLayout, copy_blocks

_MOD = 65_521


class KVPattern:
    """The bytes a block with a given prefix hash must hold: a fixed function of the hash."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._base = torch.arange(layout.block_numel, dtype=torch.int64)

    def of(self, hashes: Sequence[int]) -> torch.Tensor:
        """``(len(hashes), block_numel)`` values: exact in float32 (all below 2**16)."""
        a = torch.tensor([((h >> 16) & 0xFFFF) | 1 for h in hashes], dtype=torch.int64)
        b = torch.tensor([h & 0xFFFF for h in hashes], dtype=torch.int64)
        return ((self._base[None, :] * a[:, None] + b[:, None]) % _MOD).to(self.layout.dtype)

    def write(self, cache: KVCache, blocks: Sequence[int], hashes: Sequence[int]) -> None:
        if blocks:
            rows = cache.storage.view(cache.num_blocks, -1)
            rows[torch.tensor(list(blocks), device=cache.device)] = self.of(hashes).to(cache.device)

    def mismatches(self, cache: KVCache, blocks: Sequence[int], hashes: Sequence[int]) -> int:
        """How many of ``blocks`` do not hold the bytes of their hash."""
        if not blocks:
            return 0
        rows = cache.storage.view(cache.num_blocks, -1)[torch.tensor(list(blocks), device=cache.device)]
        return int((rows.cpu() != self.of(hashes)).any(dim=1).sum())


class CopyFailed(RuntimeError):
    """The simulated DMA engine failed a copy (it left garbage in the destination)."""


@dataclass
class DelayedCopier:
    """A DMA engine that finishes each copy 1..k steps after it started, and moves the bytes only then.

    Copying at the last possible moment is the worst case for a connector: a
    block freed too early has been reused (and rewritten by the model) by
    then. A failed copy writes garbage; a lost report copies but never says so.
    """

    step: Callable[[], int]
    rng: random.Random
    delay: tuple[int, int] = (1, 4)
    failure_rate: float = 0.0
    loss_rate: float = 0.0
    failed: int = 0
    lost: int = 0
    _queue: list[tuple[int, Copy]] = field(default_factory=list)

    def submit(self, copy: Copy) -> None:
        self._queue.append((self.step() + self.rng.randint(*self.delay), copy))

    def poll(self) -> list[Done]:
        now = self.step()
        done: list[Done] = []
        later: list[tuple[int, Copy]] = []
        for due, c in self._queue:
            if due > now:
                later.append((due, c))
            elif self.rng.random() < self.failure_rate:
                self.failed += 1
                c.dst.poison(c.dst_blocks)
                done.append((c.job, CopyFailed(f"job {c.job}: simulated DMA error")))
            else:
                copy_blocks(c.src, c.src_blocks, c.dst, c.dst_blocks)
                if self.rng.random() < self.loss_rate:
                    self.lost += 1
                else:
                    done.append((c.job, None))
        self._queue = later
        return done

    def busy(self) -> bool:
        return bool(self._queue)


def run_worker(
    worker: CpuOffloadWorker,
    meta: CpuOffloadMetadata,
    finished_req_ids: set[str],
    forward: Callable[[], None] | None = None,
) -> KVConnectorOutput:
    """One worker step in the order of vLLM's KV-connector model-runner mixin; returns what it reports."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    if forward is not None:
        forward()
    worker.wait_for_save()
    sending, recving = worker.get_finished(finished_req_ids)
    invalid = worker.get_block_ids_with_load_errors()
    worker_meta = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return KVConnectorOutput(sending, recving, invalid_block_ids=invalid, kv_connector_worker_meta=worker_meta)


def _merge(outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
    """Several worker outputs delivered in one step, as one."""
    merged = KVConnectorOutput(invalid_block_ids=set())
    meta = CpuOffloadWorkerMeta()
    sending: set[str] = set()
    recving: set[str] = set()
    for out in outputs:
        sending |= out.finished_sending or set()
        recving |= out.finished_recving or set()
        merged.invalid_block_ids |= out.invalid_block_ids
        m = out.kv_connector_worker_meta
        if isinstance(m, CpuOffloadWorkerMeta):
            meta.loads_done += m.loads_done
            meta.loads_failed += m.loads_failed
            meta.stores_done += m.stores_done
            meta.stores_failed += m.stores_failed
    merged.finished_sending = sending or None
    merged.finished_recving = recving or None
    merged.kv_connector_worker_meta = meta
    return merged


@dataclass
class OutputDelivery:
    """Delivers worker outputs to the scheduler, some twice, some again much later (a flaky process boundary)."""

    rng: random.Random
    duplicate_rate: float = 0.0
    late_rate: float = 0.0
    late_steps: tuple[int, int] = (2, 30)
    duplicated: int = 0
    late: int = 0
    _held: list[tuple[int, KVConnectorOutput]] = field(default_factory=list)

    def deliver(self, step: int, output: KVConnectorOutput) -> KVConnectorOutput:
        """What the scheduler receives at ``step``, given what the worker produced then."""
        if self.rng.random() < self.duplicate_rate:
            self.duplicated += 1
            self._held.append((step + 1, copying.deepcopy(output)))
        if self.rng.random() < self.late_rate:
            self.late += 1
            self._held.append((step + self.rng.randint(*self.late_steps), copying.deepcopy(output)))
        due = [output] + [o for s, o in self._held if s <= step]
        self._held = [(s, o) for s, o in self._held if s > step]
        return _merge(due)

    def busy(self) -> bool:
        return bool(self._held)
