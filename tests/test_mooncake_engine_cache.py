"""The Mooncake store worker on an engine's own KV cache: what is stored is the engine's blocks, and what is
loaded lands in the engine's blocks before it is reported, in every layout vLLM registers.

The buffer the store reads and writes is a staging copy (one row per engine
block); these tests never look at it, only at the engine's tensors and at
what the store holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch
from mooncake_fixtures import (  # noqa: F401
    Backend,
    assert_everything_released,
    backend_fixture,
    mooncake_master_fixture,
    real_store_fixture,
    settle,
    unique,
)

from kvfsm.drivers.kv_cache import KVCache, KVLayout
from kvfsm.drivers.mooncake import BlockBuffer, MooncakeStoreWorker, block_key, codes
from kvfsm.harness.mooncake import FaultyStore, returning

BLOCKS = 12
LAYOUT = KVLayout(num_layers=4, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
"""Two attention layers (K and V apart): 1 KiB a block."""


def per_layer_cpu() -> KVCache:
    """vLLM's CPU backend: ``[blocks, kv_heads, block_size, 2 * head_size]`` per layer."""
    shape = (BLOCKS, LAYOUT.num_kv_heads, LAYOUT.block_size, 2 * LAYOUT.head_size)
    return KVCache.of_layers([torch.zeros(shape) for _ in range(2)], BLOCKS, LAYOUT)


def per_layer_flash() -> KVCache:
    """FlashAttention: ``[2, blocks, block_size, kv_heads, head_size]`` per layer (a block is two runs)."""
    shape = (2, BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_size)
    return KVCache.of_layers([torch.zeros(shape) for _ in range(2)], BLOCKS, LAYOUT)


def cross_layer() -> KVCache:
    """The cross-layer cache, one block-major tensor."""
    return KVCache(LAYOUT, BLOCKS)


LAYOUTS: dict[str, Callable[[], KVCache]] = {"cpu": per_layer_cpu, "flash": per_layer_flash, "cross": cross_layer}


@pytest.fixture(params=sorted(LAYOUTS))
def engine(request: pytest.FixtureRequest) -> KVCache:
    cache: KVCache = LAYOUTS[request.param]()
    gen = torch.Generator().manual_seed(0)
    for part in cache.parts:
        part.copy_(torch.randn(part.shape, generator=gen))
    return cache


@pytest.fixture
def buffer(engine: KVCache) -> BlockBuffer:
    buffer = BlockBuffer(BLOCKS, LAYOUT.block_bytes)
    buffer.attach(engine)
    return buffer


@pytest.fixture
def faulty(backend: Backend) -> FaultyStore:
    return FaultyStore(backend.store)


@pytest.fixture
def worker(faulty: FaultyStore, buffer: BlockBuffer) -> Iterator[MooncakeStoreWorker]:
    w = MooncakeStoreWorker(faulty, buffer, prefix=unique("kv"))
    yield w
    w.close()


def store_request(worker: MooncakeStoreWorker, buffer: BlockBuffer, n: int) -> tuple[list[int], list[str]]:
    """A request's ``n`` engine blocks stored and reported; returns the blocks and their hashes."""
    blocks = buffer.pool.allocate("writer", n)
    hashes = [unique("h") for _ in blocks]
    worker.save("writer", blocks, hashes)
    worker.request_finished("writer")
    settle(worker)
    assert worker.outcomes["send:stored"] == 1
    return blocks, hashes


def wipe(engine: KVCache, blocks: list[int]) -> None:
    """Fill ``blocks`` with a value no random block has, so a block nobody loaded is told apart."""
    for part in engine.parts:
        for b in blocks:
            part[b].fill_(-7.0)


def test_the_store_holds_the_engine_blocks_bytes(
    backend: Backend, worker: MooncakeStoreWorker, buffer: BlockBuffer, engine: KVCache
) -> None:
    blocks, hashes = store_request(worker, buffer, 3)
    keys = [block_key(worker.sender.prefix, h) for h in hashes]
    out = torch.zeros((len(keys), LAYOUT.block_bytes), dtype=torch.uint8)
    got = backend.store.batch_get_into(keys, [out[i].data_ptr() for i in range(len(keys))], [LAYOUT.block_bytes] * 3)
    assert got == [LAYOUT.block_bytes] * 3
    for row, b in zip(out, blocks, strict=True):
        assert row.numpy().tobytes() == engine.block_bytes(b), f"the store holds other bytes than engine block {b}"
    buffer.pool.release("writer")
    assert_everything_released(worker, buffer)


def test_a_load_fills_the_engine_blocks_before_it_is_reported(
    worker: MooncakeStoreWorker, buffer: BlockBuffer, engine: KVCache
) -> None:
    blocks, hashes = store_request(worker, buffer, 3)
    want = [engine.block_bytes(b) for b in blocks]
    wipe(engine, blocks)  # the writer's blocks are gone from the engine: only the store has them now
    buffer.pool.release("writer")
    assert worker.lookup("reader", hashes) == 3
    dst = buffer.pool.allocate("reader", 3)
    worker.start_load("reader", dst)
    for _ in range(5000):
        done = worker.get_finished()
        if done.recving:
            break
        time.sleep(0.001)
    else:
        raise AssertionError("the load was never reported")
    # The report is vLLM's signal to run the request: the engine's blocks must hold the bytes now.
    assert done.recving == {"reader"} and not done.invalid_blocks
    assert [engine.block_bytes(b) for b in dst] == want
    settle(worker)
    assert worker.stats()["blocks_loaded"] == 3 and worker.stats()["loads_done"] == 1
    buffer.pool.release("reader")
    assert_everything_released(worker, buffer)


def test_a_partial_load_fills_only_the_blocks_it_read_and_reports_the_rest_invalid(
    faulty: FaultyStore, worker: MooncakeStoreWorker, buffer: BlockBuffer, engine: KVCache
) -> None:
    blocks, hashes = store_request(worker, buffer, 3)
    want = [engine.block_bytes(b) for b in blocks]
    buffer.pool.release("writer")
    dst = buffer.pool.allocate("reader", 3)
    wipe(engine, dst)
    untouched = engine.block_bytes(dst[0])
    assert worker.lookup("reader", hashes) == 3
    faulty.fail_next("batch_get_into", returning(codes.OBJECT_NOT_FOUND, keys=1))
    worker.start_load("reader", dst)
    reports = settle(worker)
    assert {b for f in reports for b in f.invalid_blocks} == {dst[0]}, "vLLM must recompute the block not read"
    assert engine.block_bytes(dst[0]) == untouched
    assert [engine.block_bytes(b) for b in dst[1:]] == want[1:]
    assert worker.stats()["loads_failed"] == 1
    buffer.pool.release("reader")
    assert_everything_released(worker, buffer)


def test_a_buffer_refuses_an_engine_cache_of_another_shape() -> None:
    with pytest.raises(ValueError, match="disagree"):
        BlockBuffer(BLOCKS + 1, LAYOUT.block_bytes).attach(per_layer_cpu())
    with pytest.raises(ValueError, match="cannot hold"):
        BlockBuffer(BLOCKS, LAYOUT.block_bytes // 2).attach(per_layer_cpu())
