"""The one BlockPool: holder sets, LRU reuse of free blocks, the prefix index, and refused releases."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvfsm.drivers.block_pool import BlockPool, BlockPoolError, HolderError, NoFreeBlocks


def cached_pool(n: int, hashes: list[int]) -> tuple[BlockPool, list[int]]:
    """A pool whose first blocks are published under ``hashes`` and free (cached, evictable)."""
    pool = BlockPool(n)
    blocks = pool.allocate("writer", len(hashes))
    for b, h in zip(blocks, hashes, strict=True):
        assert pool.cache(b, h)
    pool.release("writer")
    return pool, blocks


def test_new_blocks_come_from_the_least_recently_freed_end() -> None:
    pool = BlockPool(4)
    a = pool.allocate("r", 4)
    pool.release("r", [a[2]])
    pool.release("r", [a[0]])
    assert pool.allocate("s", 2) == [a[2], a[0]]


def test_taking_a_cached_block_evicts_its_hash() -> None:
    pool, blocks = cached_pool(2, [11, 22])
    assert pool.lookup([11, 22]) == blocks
    pool.allocate("r", 1)
    assert pool.lookup([11, 22]) == []
    assert pool.evictions == 1
    assert pool.cached_block(22) == blocks[1]


def test_a_held_block_is_never_evicted() -> None:
    pool, blocks = cached_pool(3, [11, 22])
    pool.pin("hit", [blocks[0]])  # a prefix hit takes a free cached block out of the queue
    assert pool.allocate("r", 2) == [2, blocks[1]]  # block 2 was never used, so it heads the queue
    with pytest.raises(NoFreeBlocks, match="asked for 1 blocks, 0 of 3 are free"):
        pool.allocate("s", 1)
    assert pool.lookup([11]) == [blocks[0]]


def test_a_block_stays_out_of_the_free_queue_until_its_last_holder_lets_go() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate("request", 1)
    pool.pin("store job", [b])
    assert pool.release("request") == []
    assert pool.holders(b) == {"store job"} and pool.num_free == 1
    assert pool.release("store job") == [b]
    assert pool.num_free == 2 and pool.holder_count() == 0


def test_a_release_by_a_non_holder_is_refused_and_changes_nothing() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate("a", 2)
    with pytest.raises(HolderError, match=r"'b' released all its blocks but holds \[\]"):
        pool.release("b")
    with pytest.raises(HolderError, match=r"'a' released blocks \[2\] but holds \[0, 1\]"):
        pool.release("a", [blocks[0], 2])
    assert pool.held_by("a") == tuple(blocks) and pool.refused_releases == 2


def test_a_second_release_is_refused() -> None:
    pool = BlockPool(2)
    pool.allocate("a", 1)
    pool.release("a")
    with pytest.raises(HolderError, match="double release"):
        pool.release("a")


@pytest.mark.parametrize(
    ("blocks", "message"),
    [([1], "free and uncached"), ([0, 0], "named a block twice"), ([0, 5], "the pool has blocks 0..3")],
    ids=["garbage", "twice", "outside"],
)
def test_a_pin_that_would_corrupt_the_holder_sets_is_refused(blocks: list[int], message: str) -> None:
    pool = BlockPool(4)
    pool.allocate("request", 1)
    with pytest.raises(HolderError, match=message):
        pool.pin("load", blocks)
    assert pool.held_by("load") == () and pool.num_free == 3


def test_pinning_a_block_one_already_holds_is_refused() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate("r", 1)
    with pytest.raises(HolderError, match="already holds block 0"):
        pool.pin("r", [b])


def test_lookup_stops_at_the_first_missing_hash() -> None:
    pool, blocks = cached_pool(4, [1, 2, 4])
    assert pool.lookup([1, 2, 3, 4]) == blocks[:2]
    assert pool.lookup([9, 1]) == []


def test_a_hash_is_published_once_and_only_on_a_held_block() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate("r", 2)
    assert pool.cache(a, 7)
    assert not pool.cache(b, 7)
    assert pool.cached_block(7) == a and pool.hash_of(b) is None
    with pytest.raises(HolderError, match="block 2 is free"):
        pool.cache(2, 8)


def test_ref_cnt_reads_the_holder_sets_live() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate("r", 1)
    pool.pin("s", [b])
    assert pool.ref_cnt[b] == 2 and list(pool.ref_cnt) == [2, 0] and pool.referenced() == {b: 2}


class PoolMachine(RuleBasedStateMachine):
    """Random allocations, pins, releases (some by non-holders) and publications against a plain model."""

    BLOCKS = 6
    HOLDERS = ("a", "b", "c")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.BLOCKS)
        self.model: dict[str, set[int]] = {h: set() for h in self.HOLDERS}
        self.hashes: dict[int, int] = {}
        """Published blocks and their hash, until allocate evicts them."""
        self.order: list[int] = list(range(self.BLOCKS))
        """The free blocks, least recently freed first."""

    def held(self, block: int) -> bool:
        return any(block in blocks for blocks in self.model.values())

    @rule(holder=st.sampled_from(HOLDERS), n=st.integers(0, 3))
    def allocate(self, holder: str, n: int) -> None:
        if n > len(self.order):
            with pytest.raises(NoFreeBlocks):
                self.pool.allocate(holder, n)
            return
        got = self.pool.allocate(holder, n)
        assert got == self.order[:n], "allocate takes the least recently freed blocks first"
        del self.order[:n]
        for b in got:
            self.hashes.pop(b, None)
        self.model[holder] |= set(got)

    @rule(holder=st.sampled_from(HOLDERS), block=st.integers(0, BLOCKS - 1))
    def pin(self, holder: str, block: int) -> None:
        if block in self.model[holder] or (not self.held(block) and block not in self.hashes):
            with pytest.raises(HolderError):
                self.pool.pin(holder, [block])
            return
        self.pool.pin(holder, [block])
        if block in self.order:
            self.order.remove(block)
        self.model[holder].add(block)

    @rule(holder=st.sampled_from(HOLDERS), block=st.integers(0, BLOCKS - 1))
    def release_one(self, holder: str, block: int) -> None:
        refused = self.pool.refused_releases
        if block not in self.model[holder]:
            with pytest.raises(HolderError):
                self.pool.release(holder, [block])
            assert self.pool.refused_releases == refused + 1
            return
        self.model[holder].discard(block)
        freed = self.pool.release(holder, [block])
        assert freed == ([] if self.held(block) else [block])
        self.order += freed

    @precondition(lambda self: any(self.model.values()))
    @rule(holder=st.sampled_from(HOLDERS))
    def release_all(self, holder: str) -> None:
        if not self.model[holder]:
            with pytest.raises(HolderError):
                self.pool.release(holder)
            return
        mine, self.model[holder] = sorted(self.model[holder]), set()
        freed = self.pool.release(holder)
        assert freed == [b for b in mine if not self.held(b)]
        self.order += freed

    @rule(block=st.integers(0, BLOCKS - 1), block_hash=st.integers(100, 103))
    def publish(self, block: int, block_hash: int) -> None:
        if not self.held(block):
            with pytest.raises(HolderError):
                self.pool.cache(block, block_hash)
            return
        owner = next((b for b, h in self.hashes.items() if h == block_hash), None)
        assert self.pool.cache(block, block_hash) == (owner in (None, block))
        if owner is None:
            self.hashes[block] = block_hash

    @rule()
    def reset_prefix_cache(self) -> None:
        held = any(self.model.values())
        assert self.pool.reset_prefix_cache() is not held, "a reset is refused exactly while a block is held"
        if not held:
            self.hashes.clear()
            assert self.pool.lookup([100]) == []

    @invariant()
    def the_pool_matches_the_model(self) -> None:
        self.pool.check()
        for holder, blocks in self.model.items():
            assert self.pool.held_by(holder) == tuple(sorted(blocks))
        for b in range(self.BLOCKS):
            assert self.pool.refcount(b) == sum(b in blocks for blocks in self.model.values())
        assert self.pool.num_free == len(self.order)
        assert {b: self.pool.hash_of(b) for b in self.hashes} == self.hashes
        assert self.pool.num_cached == len(self.hashes)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def test_check_names_a_broken_invariant() -> None:
    pool = BlockPool(2)
    pool._holders[0].add("ghost")  # a hold nobody took through the pool
    with pytest.raises(BlockPoolError, match="block 0: 1 holders but in the free queue"):
        pool.check()
