"""Seed 003, replayed: a CPU hit found in phase A, the CPU cache filled until LRU evicts, then phase B.

vLLM #39702: ``get_num_new_matched_tokens`` counted the hit without
referencing it; stores that ran before ``update_state_after_alloc`` evicted
the hit blocks, the second lookup came up short and the scheduler died on
``AssertionError: Expected N hit tokens, got 0``. Here the hit is a state that
holds the blocks, so the same interleaving loads exactly the bytes stored.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from kvfsm.adapters.vllm_api import KVConnectorOutput, RequestStatus
from kvfsm.adapters.vllm_cpu_offload import CpuOffloadScheduler, CpuOffloadWorker
from kvfsm.drivers.block_pool import BlockPool
from kvfsm.drivers.cpu_offload import CpuOffload, LoadDriver
from kvfsm.drivers.kv_cache import KVLayout
from kvfsm.showcase.sim import StepOutput, run_worker
from kvfsm.showcase.sim.workload import SimRequest

BS = 4
LAYOUT = KVLayout(num_layers=2, block_size=BS, num_kv_heads=2, head_size=4)
PREFIX = list(range(100, 100 + 4 * BS))
"""Four blocks of tokens that request A shares with the request that stored them."""


class Engine:
    """The connector's two halves on 8 CPU blocks, and just enough scheduler to replay the interleaving."""

    def __init__(self, load_driver: type[LoadDriver] = LoadDriver) -> None:
        self.offload = CpuOffload(LAYOUT, num_gpu_blocks=32, num_cpu_blocks=8, device="cpu")
        self.offload.load = load_driver(self.offload.cpu_pool, self.offload.gpu_pool)
        self.sched = CpuOffloadScheduler(self.offload)
        self.worker = CpuOffloadWorker(self.offload)
        self.rng = torch.Generator().manual_seed(0)
        self.stored: dict[int, torch.Tensor] = {}
        """Bytes each prefix hash was stored with."""
        self._index = 0

    def request(self, tokens: list[int]) -> SimRequest:
        self._index += 1
        return SimRequest(f"req-{self._index}", self._index, tokens, max_output=1, block_size=BS)

    def run_and_finish(self, req: SimRequest) -> None:
        """The request computes its tokens (random KV bytes) and finishes; its store is planned."""
        n = len(req.block_hashes)
        req.blocks = self.offload.gpu_pool.allocate(req.request_id, n)
        for b, h in zip(req.blocks, req.block_hashes, strict=True):
            self.offload.gpu_cache.block(b).copy_(
                torch.randn(self.offload.gpu_cache.block(b).shape, generator=self.rng)
            )
            self.stored.setdefault(h, self.offload.gpu_cache.block(b).clone())
        req.num_computed_tokens = n * BS
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        assert self.sched.request_finished(req, list(req.blocks)) == (False, None)
        self.offload.gpu_pool.release(req.request_id)  # vLLM frees at once: the store holds the blocks too

    def step(self) -> KVConnectorOutput:
        meta = self.sched.build_connector_meta(StepOutput({}, set(), None))
        out = run_worker(self.worker, meta, set())
        self.sched.update_connector_output(out)
        return out


def test_a_pinned_hit_survives_the_cpu_cache_filling_up_and_loads_the_stored_bytes() -> None:
    e = Engine()
    e.run_and_finish(e.request(PREFIX))
    e.step()
    assert e.offload.cpu_pool.num_cached == 4

    a = e.request([*PREFIX, 7])  # the prefix plus one token the model must compute
    assert e.sched.get_num_new_matched_tokens(a, 0) == (4 * BS, True)  # phase A: found and pinned

    # Between phase A and phase B other requests finish and store: the CPU
    # cache fills up, and the LRU end is the prefix found above.
    e.run_and_finish(e.request(list(range(500, 500 + 4 * BS))))
    e.step()
    e.run_and_finish(e.request(list(range(900, 900 + 4 * BS))))
    e.step()
    pool = e.offload.cpu_pool
    assert pool.evictions == 4  # LRU evicted: the first of those stores, not the pinned hit
    assert pool.lookup(a.block_hashes[:4]) == e.offload.load.pinned(a.request_id)

    # Phase B: allocate_slots gave GPU blocks; the load uses the pinned blocks.
    a.blocks = e.offload.gpu_pool.allocate(a.request_id, 5)
    e.sched.update_state_after_alloc(a, a, 4 * BS)
    out = e.step()
    assert out.finished_recving == {a.request_id} and not out.invalid_block_ids
    for b, h in zip(a.blocks[:4], a.block_hashes[:4], strict=True):
        assert torch.equal(e.offload.gpu_cache.block(b), e.stored[h])

    # The load is over: no CPU block is held, the prefix is cached and evictable again.
    assert pool.referenced() == {} and pool.num_free == 8
    e.offload.check()
    assert e.offload.driver_holdings() == {}  # only the request holds its GPU blocks
    assert e.offload.gpu_pool.held_by(a.request_id) == tuple(sorted(a.blocks))


class LookupOnlyLoadDriver(LoadDriver):
    """vLLM before the fix: phase A counts the hit and keeps nothing; phase B looks it up again."""

    def __init__(self, *args: BlockPool) -> None:
        super().__init__(*args)
        self._looked: dict[Hashable, list[int]] = {}
        self._hashes: dict[Hashable, list[int]] = {}

    def pin_cpu_hit(self, key: Hashable, /, hashes: Sequence[Hashable], first: int = 0) -> None:
        self._looked[key] = self.cpu_pool.lookup(hashes)
        self._hashes[key] = list(hashes)

    def pinned(self, key: Hashable) -> list[int]:
        return list(self._looked.get(key, ()))

    def hold_gpu_dst(self, key: Hashable, /, gpu_blocks: Sequence[int]) -> None:
        found = self.cpu_pool.lookup(self._hashes.pop(key))[: len(gpu_blocks)]
        if len(found) < len(gpu_blocks):
            raise AssertionError(f"Expected {len(gpu_blocks) * BS} hit tokens, got {len(found) * BS}")
        self.cpu_pool.pin(("cpu_hit", key), found)
        self._hit[key] = found
        super().hold_gpu_dst(key, gpu_blocks)

    def unpin_cpu_hit(self, key: Hashable, /) -> None:
        if self._hit.pop(key, None) is not None:  # phase A pinned nothing
            self.cpu_pool.release(("cpu_hit", key))


def test_without_the_pin_the_same_interleaving_loses_the_hit() -> None:
    """The replay really evicts: a driver that only looks up in phase A finds nothing in phase B."""
    e = Engine(LookupOnlyLoadDriver)
    e.run_and_finish(e.request(PREFIX))
    e.step()
    a = e.request([*PREFIX, 7])
    assert e.sched.get_num_new_matched_tokens(a, 0) == (4 * BS, True)
    for start in (500, 900):
        e.run_and_finish(e.request(list(range(start, start + 4 * BS))))
        e.step()
    assert e.offload.cpu_pool.lookup(a.block_hashes[:4]) == []  # evicted between the phases
    a.blocks = e.offload.gpu_pool.allocate(a.request_id, 5)
    e.sched.update_state_after_alloc(a, a, 4 * BS)  # hold_gpu_dst raises the seed's AssertionError
    # vLLM crashed here. The spec's recv_report instead reports the load with
    # its blocks as load errors, so vLLM recomputes them rather than read stale bytes.
    out = e.step()
    assert e.sched.stats.loads_refused == 1
    assert out.finished_recving == {a.request_id}
    assert out.invalid_block_ids == set(a.blocks[:4])
    assert e.sched.loads.counts["action_errors"] == 1
