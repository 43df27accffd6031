"""BlockPool: reference counts, the prefix-hash index and LRU eviction of unreferenced blocks only."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfsm.drivers.block_pool import BlockPool, BlockPoolError, NoFreeBlocks, RefCountError


def cached_pool(n: int, hashes: list[int]) -> tuple[BlockPool, list[int]]:
    """A pool whose first blocks are published under ``hashes`` and free (cached, evictable)."""
    pool = BlockPool(n)
    blocks = pool.get_new_blocks(len(hashes))
    for b, h in zip(blocks, hashes, strict=True):
        assert pool.cache(b, h)
    pool.free(blocks)
    return pool, blocks


def test_new_blocks_come_from_the_least_recently_freed_end() -> None:
    pool = BlockPool(4)
    a = pool.get_new_blocks(4)
    pool.free([a[2]])
    pool.free([a[0]])
    assert pool.get_new_blocks(2) == [a[2], a[0]]


def test_taking_a_cached_block_evicts_its_hash() -> None:
    pool, blocks = cached_pool(2, [11, 22])
    assert pool.lookup([11, 22]) == blocks
    pool.get_new_blocks(1)
    assert pool.lookup([11, 22]) == []
    assert pool.evictions == 1
    assert pool.cached_block(22) == blocks[1]


def test_a_referenced_block_is_never_evicted() -> None:
    pool, blocks = cached_pool(3, [11, 22])
    pool.touch([blocks[0]])  # pinned
    assert pool.get_new_blocks(2) == [2, blocks[1]]  # block 2 was never used, so it heads the queue
    with pytest.raises(NoFreeBlocks, match="asked for 1 blocks, 0 of 3 are free"):
        pool.get_new_blocks(1)
    assert pool.lookup([11]) == [blocks[0]]


def test_touch_takes_a_free_block_out_of_the_queue_and_free_puts_it_back_at_the_tail() -> None:
    pool, blocks = cached_pool(3, [11, 22, 33])
    pool.touch([blocks[0]])
    assert pool.num_free == 2
    pool.free([blocks[0]])
    assert pool.get_new_blocks(3) == [blocks[1], blocks[2], blocks[0]]


def test_freeing_an_unreferenced_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(RefCountError, match="block 1 freed with ref_cnt 0"):
        pool.free([1])


def test_lookup_stops_at_the_first_missing_hash() -> None:
    pool, blocks = cached_pool(4, [1, 2, 4])
    assert pool.lookup([1, 2, 3, 4]) == blocks[:2]
    assert pool.lookup([9, 1]) == []


def test_a_hash_is_published_once() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache(a, 7)
    assert not pool.cache(b, 7)
    assert pool.cached_block(7) == a and pool.hash_of(b) is None


def test_check_finds_a_broken_invariant() -> None:
    pool = BlockPool(2)
    pool.ref_cnt[0] = 1  # a reference nobody took through the pool
    with pytest.raises(BlockPoolError, match="block 0: ref_cnt 1 but in the free queue"):
        pool.check()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "touch", "free", "cache"]), st.integers(0, 7)), max_size=60))
def test_random_use_keeps_the_invariant_and_the_counts(ops: list[tuple[str, int]]) -> None:
    pool = BlockPool(8)
    refs = [0] * 8
    for op, arg in ops:
        if op == "new" and pool.num_free:
            for b in pool.get_new_blocks(1 + arg % pool.num_free):
                refs[b] += 1
        elif op == "touch":
            pool.touch([arg])
            refs[arg] += 1
        elif op == "free" and refs[arg]:
            pool.free([arg])
            refs[arg] -= 1
        elif op == "cache":
            pool.cache(arg, 1000 + arg % 3)
        pool.check()
    assert pool.ref_cnt == refs
    assert pool.num_free == refs.count(0)
