"""One pool of KV blocks that knows who holds each block: holder sets, an LRU free queue and a prefix index.

Every driver keeps its blocks here (the CPU tier of an offload connector, a
scheduler's GPU pool, the Mooncake worker's registered blocks, the PD
loopback's pages) and every driver's ``observe(key)`` reads it back. A
*holder* is whoever keeps a block alive (a request, a load's pin, a store
job's pin), so a release by someone who holds nothing is refused instead of
freeing a block another holder still reads. Bookkeeping only: the bytes live
elsewhere (:class:`~kvfsm.drivers.kv_cache.KVCache`, or a registered tensor),
indexed by the same block ids.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import overload

BlockHash = Hashable
"""A block's prefix hash: it names the block's tokens and every token before them."""

Holder = Hashable
"""Whoever keeps blocks alive: a request id, ``("cpu_hit", request_id)``, ``("store", job)``, ..."""


class BlockPoolError(RuntimeError):
    """A block pool was used against its contract; nothing was changed."""


class NoFreeBlocks(BlockPoolError):
    """More blocks were asked for than are free (held by nobody)."""


class HolderError(BlockPoolError):
    """A pin or a release that would corrupt the holder sets: a release by a non-holder, a pin of garbage."""


class RefCounts(Sequence[int]):
    """``pool.ref_cnt[b]``: the number of holders of block ``b``, read live (a view, not a copy)."""

    __slots__ = ("_holders",)

    def __init__(self, holders: list[set[Holder]]) -> None:
        self._holders = holders

    def __len__(self) -> int:
        return len(self._holders)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return [len(h) for h in self._holders[index]]
        return len(self._holders[index])


class BlockPool:
    """``num_blocks`` blocks handed out to holders, reused in LRU order, findable by prefix hash.

    Invariants, kept by every method under ``_lock`` and verified by :meth:`check`:

    - the reference count of block ``b`` is the size of its holder set ``_holders[b]``;
    - ``b`` is in the free queue ``_free`` ⇔ ``_holders[b]`` is empty; the queue
      is in the order blocks became free, least recently used first;
    - ``_held[h]`` is exactly the set of blocks whose holder set contains ``h``,
      and a holder that holds nothing has no entry;
    - ``_cached[x] == b`` ⇔ ``_hash_of[b] == x``. A cached block that nobody
      holds sits in the free queue, findable and evictable: :meth:`allocate`
      drops the hash of every block it takes (an eviction).
    """

    __slots__ = ("_cached", "_free", "_hash_of", "_held", "_holders", "_lock", "evictions", "num_blocks", "ref_cnt",
                 "refused_releases")  # fmt: skip

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, not {num_blocks}")
        self.num_blocks = num_blocks
        self._holders: list[set[Holder]] = [set() for _ in range(num_blocks)]
        self._held: dict[Holder, set[int]] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._lock = threading.Lock()
        self.ref_cnt = RefCounts(self._holders)
        """Holders per block, as vLLM's ``ref_cnt`` (read-only)."""
        self.evictions = 0
        """Cached blocks whose hash was dropped to reuse the block, since construction."""
        self.refused_releases = 0
        """Releases refused because the holder did not hold the block: always 0 for a correct driver."""

    # -- holding ---------------------------------------------------------------

    def allocate(self, holder: Holder, n: int) -> list[int]:
        """Take ``n`` free blocks from the LRU end for ``holder``, evicting their hashes.

        Raises :class:`NoFreeBlocks` (nothing taken) when fewer are free.
        """
        with self._lock:
            free = self._free
            if n > len(free):
                raise NoFreeBlocks(f"{holder!r} asked for {n} blocks, {len(free)} of {self.num_blocks} are free")
            blocks = [free.popitem(last=False)[0] for _ in range(n)]
            for block in blocks:
                self._evict(block)
            self._add(holder, blocks)
            return blocks

    def pin(self, holder: Holder, blocks: Iterable[int]) -> None:
        """Make ``holder`` a holder of ``blocks``: each is held by someone already, or free but cached (a prefix hit).

        All or nothing. Pinning a free uncached block would keep garbage alive
        and pinning a block twice would need two releases: both raise
        :class:`HolderError`, as does a block outside the pool.
        """
        blocks = list(blocks)
        with self._lock:
            if len(set(blocks)) != len(blocks):
                raise HolderError(f"{holder!r} named a block twice in {blocks}")
            for b in blocks:
                if not 0 <= b < self.num_blocks:
                    raise HolderError(f"{holder!r} cannot pin block {b}: the pool has blocks 0..{self.num_blocks - 1}")
                if holder in self._holders[b]:
                    raise HolderError(f"{holder!r} already holds block {b}; release it before pinning it again")
                if not self._holders[b] and self._hash_of[b] is None:
                    raise HolderError(
                        f"{holder!r} cannot pin block {b}: it is free and uncached (nobody holds its contents); "
                        "allocate() new blocks instead"
                    )
            for b in blocks:
                self._free.pop(b, None)
            self._add(holder, blocks)

    def release(self, holder: Holder, blocks: Iterable[int] | None = None) -> list[int]:
        """Drop ``holder``'s hold on ``blocks`` (default: all it holds); returns the blocks now free.

        All or nothing: a block ``holder`` does not hold (or a holder that
        holds nothing) releases nothing, is counted in
        :attr:`refused_releases` and raises :class:`HolderError`.
        """
        with self._lock:
            mine = self._held.get(holder)
            todo = sorted(mine or ()) if blocks is None else list(blocks)
            stray = [b for b in todo if mine is None or b not in mine]
            if not mine or stray or len(set(todo)) != len(todo):
                self.refused_releases += 1
                what = f"blocks {stray or todo}" if blocks is not None else "all its blocks"
                raise HolderError(
                    f"{holder!r} released {what} but holds {sorted(mine or ())}: a double release, or a release "
                    "for someone else's blocks"
                )
            freed = []
            for b in todo:
                holders = self._holders[b]
                holders.discard(holder)
                mine.discard(b)
                if not holders:
                    self._free[b] = None
                    freed.append(b)
            if not mine:
                del self._held[holder]
            return freed

    # -- the prefix index -------------------------------------------------------

    def cache(self, block: int, block_hash: BlockHash) -> bool:
        """Publish held ``block`` under ``block_hash``; False if another block already has that hash.

        Only a held block can be published: a free one may be taken and
        rewritten at any moment (:class:`HolderError`).
        """
        with self._lock:
            if not self._holders[block]:
                raise HolderError(f"block {block} is free: publish it under {block_hash!r} while someone holds it")
            other = self._cached.get(block_hash)
            if other is not None:
                return other == block
            old = self._hash_of[block]
            if old is not None:  # republished under a new hash: not an eviction
                del self._cached[old]
            self._hash_of[block] = block_hash
            self._cached[block_hash] = block
            return True

    def lookup(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks of the longest cached prefix of ``hashes`` (no hold taken: :meth:`pin` them)."""
        out = []
        with self._lock:
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

    def reset_prefix_cache(self) -> bool:
        """Forget every published hash, as vLLM's ``BlockPool.reset_prefix_cache`` does; refused (False, nothing
        changed) while any block is held, since a holder may be a pin on a hit or a copy under way."""
        with self._lock:
            if self._held:
                return False
            self.evictions += len(self._cached)
            self._cached.clear()
            self._hash_of = [None] * self.num_blocks
            return True

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def _evict(self, block: int) -> None:
        old = self._hash_of[block]
        if old is not None:
            del self._cached[old]
            self._hash_of[block] = None
            self.evictions += 1

    def _add(self, holder: Holder, blocks: list[int]) -> None:
        if not blocks:
            return
        mine = self._held.setdefault(holder, set())
        for b in blocks:
            self._holders[b].add(holder)
            mine.add(b)

    # -- reading back -------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out now (cached ones included)."""
        return len(self._free)

    def held_by(self, holder: Holder) -> tuple[int, ...]:
        """The blocks ``holder`` holds now, sorted."""
        with self._lock:
            return tuple(sorted(self._held.get(holder, ())))

    def holders(self, block: int) -> frozenset[Holder]:
        with self._lock:
            return frozenset(self._holders[block])

    def refcount(self, block: int) -> int:
        return len(self._holders[block])

    def holdings(self) -> dict[Holder, tuple[int, ...]]:
        """Every holder and the blocks it holds (sorted): what a leak check reads. O(holders)."""
        with self._lock:
            return {h: tuple(sorted(bs)) for h, bs in self._held.items()}

    def holder_count(self) -> int:
        """How many distinct holders hold something: 0 once everything is released."""
        return len(self._held)

    def referenced(self) -> dict[int, int]:
        """Every held block and its number of holders."""
        with self._lock:
            return {b: len(h) for b, h in enumerate(self._holders) if h}

    def check(self) -> None:
        """Raise :class:`BlockPoolError` naming the first broken invariant (O(blocks + holders))."""
        with self._lock:
            for b, holders in enumerate(self._holders):
                if (not holders) != (b in self._free):
                    where = "in" if b in self._free else "not in"
                    raise BlockPoolError(f"block {b}: {len(holders)} holders but {where} the free queue")
                for h in holders:
                    if b not in self._held.get(h, ()):
                        raise BlockPoolError(f"block {b} names holder {h!r}, whose blocks do not include it")
            for h, blocks in self._held.items():
                if not blocks:
                    raise BlockPoolError(f"holder {h!r} holds nothing but still has an entry")
                for b in blocks:
                    if h not in self._holders[b]:
                        raise BlockPoolError(f"holder {h!r} lists block {b}, which does not name it")
            for x, b in self._cached.items():
                if self._hash_of[b] != x:
                    raise BlockPoolError(f"hash {x!r} names block {b}, which carries {self._hash_of[b]!r}")
            if sum(x is not None for x in self._hash_of) != len(self._cached):
                raise BlockPoolError("a block carries a hash the prefix index does not know")
