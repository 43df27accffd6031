"""A pool of KV blocks with reference counts, a prefix-hash index and LRU eviction (vLLM ``block_pool.py``).

The same structure serves as the CPU tier of an offload connector and as the
scheduler's GPU pool in the simulator. Bookkeeping only: the bytes live in a
:class:`~kvfsm.drivers.kv_cache.KVCache`, indexed by the same block ids.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = int
"""A block's prefix hash: it names the block's tokens and every token before them."""


class BlockPoolError(RuntimeError):
    """A block pool was used against its contract."""


class NoFreeBlocks(BlockPoolError):
    """More blocks were asked for than are free (unreferenced)."""


class RefCountError(BlockPoolError):
    """A block was freed more often than it was referenced."""


class BlockPool:
    """``num_blocks`` blocks, each with a reference count and at most one prefix hash.

    Invariant, kept by every method: ``ref_cnt[b] == 0`` if and only if ``b``
    is in the free queue. Only free blocks are ever evicted, so a block that
    anyone references keeps its bytes and its hash. The free queue is in LRU
    order: ``free`` appends at the tail, ``get_new_blocks`` takes from the
    head and evicts the hash of what it takes. A free block that still has a
    hash is *cached*: ``lookup`` finds it, and ``touch`` takes it back out of
    the queue.
    """

    __slots__ = ("_cached", "_free", "_hash_of", "evictions", "num_blocks", "ref_cnt")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, not {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self.evictions = 0
        """Cached blocks whose hash was dropped to reuse the block, since construction."""

    # -- allocation and references -----------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out now (cached ones included)."""
        return len(self._free)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` free blocks from the LRU end, evicting their hashes; each starts with one reference."""
        if n > len(self._free):
            raise NoFreeBlocks(f"asked for {n} blocks, {len(self._free)} of {self.num_blocks} are free")
        out = []
        for _ in range(n):
            block, _none = self._free.popitem(last=False)
            self._evict(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Add a reference to each block; a free one leaves the queue (and so cannot be evicted)."""
        ref, free = self.ref_cnt, self._free
        for block in blocks:
            if ref[block] == 0:
                del free[block]
            ref[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop a reference from each block; one that reaches zero joins the tail of the queue."""
        ref, free = self.ref_cnt, self._free
        for block in blocks:
            if ref[block] <= 0:
                raise RefCountError(f"block {block} freed with ref_cnt {ref[block]}")
            ref[block] -= 1
            if ref[block] == 0:
                free[block] = None

    # -- the prefix cache ----------------------------------------------------

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Publish ``block`` under ``block_hash``; False if another block already has that hash."""
        if block_hash in self._cached:
            return self._cached[block_hash] == block
        old = self._hash_of[block]
        if old is not None:  # republished under a new hash: not an eviction
            del self._cached[old]
        self._hash_of[block] = block_hash
        self._cached[block_hash] = block
        return True

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes`` (no references taken)."""
        out = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def hash_of(self, block: int) -> BlockHash | None:
        return self._hash_of[block]

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def _evict(self, block: int) -> None:
        old = self._hash_of[block]
        if old is not None:
            del self._cached[old]
            self._hash_of[block] = None
            self.evictions += 1

    # -- checks ----------------------------------------------------------------

    def referenced(self) -> dict[int, int]:
        """Every block with a reference, and its count."""
        return {b: n for b, n in enumerate(self.ref_cnt) if n}

    def check(self) -> None:
        """Raise :class:`BlockPoolError` if the invariant or the hash index is broken (O(blocks))."""
        for block, n in enumerate(self.ref_cnt):
            if n < 0 or (n == 0) != (block in self._free):
                raise BlockPoolError(
                    f"block {block}: ref_cnt {n} but {'in' if block in self._free else 'not in'} the free queue"
                )
        for h, block in self._cached.items():
            if self._hash_of[block] != h:
                raise BlockPoolError(f"hash {h} names block {block}, which carries {self._hash_of[block]}")
        if sum(h is not None for h in self._hash_of) != len(self._cached):
            raise BlockPoolError("a block carries a hash the index does not know")
