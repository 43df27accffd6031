"""KV blocks in one registered torch tensor, each with the set of holders that keep it out of the free pool.

Invariant, kept by every method under ``_lock``: a block is in ``_free`` ⇔ its
holder set is empty; ``_held[h]`` is exactly the blocks whose holder set
contains ``h``. A holder is whoever keeps a block alive: the scheduler's
request, a store job's pin, a load's pin. Reference counts are the sizes of
the holder sets, so a release by someone who holds nothing is caught (and
counted) instead of freeing a block that another holder still reads.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable

import torch


class BlockError(RuntimeError):
    """A pool operation that would corrupt the holder sets; nothing was changed."""


class BlockPool:
    """``num_blocks`` blocks of ``block_bytes`` bytes in one contiguous tensor, handed out to holders."""

    def __init__(
        self, num_blocks: int, block_bytes: int, *, device: str | torch.device = "cpu", kv: torch.Tensor | None = None
    ) -> None:
        """A pool over a new zeroed tensor on ``device``, or over ``kv`` (a contiguous uint8
        ``(num_blocks, block_bytes)`` tensor, e.g. one already registered with a store)."""
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(f"a pool needs num_blocks > 0 and block_bytes > 0 (got {num_blocks}, {block_bytes})")
        if kv is None:
            kv = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=device)
        elif kv.shape != (num_blocks, block_bytes) or kv.dtype != torch.uint8 or not kv.is_contiguous():
            raise ValueError(
                f"kv must be a contiguous uint8 tensor of shape ({num_blocks}, {block_bytes}); got {kv.dtype} {tuple(kv.shape)}"
            )
        self.kv = kv
        """The KV cache: row ``b`` is block ``b``. Register ``kv.data_ptr()``/``nbytes`` with the store."""
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._base = self.kv.data_ptr()
        self._holders: list[set[Hashable]] = [set() for _ in range(num_blocks)]
        self._held: dict[Hashable, set[int]] = {}
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        """Free blocks in the order they were freed (oldest first), like vLLM's free queue."""
        self._lock = threading.Lock()
        self.over_releases = 0
        """Releases refused because the holder did not hold the block: always 0 for a correct driver."""

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def ptr(self, block: int) -> int:
        """The address of ``block``'s first byte (what zero-copy store calls take)."""
        return self._base + block * self.block_bytes

    def allocate(self, holder: Hashable, n: int) -> list[int]:
        """Take ``n`` free blocks for ``holder``; raises :class:`BlockError` when fewer are free."""
        with self._lock:
            if n > len(self._free):
                raise BlockError(f"{holder!r} asked for {n} blocks but only {len(self._free)} are free")
            blocks = []
            for _ in range(n):
                block = next(iter(self._free))
                del self._free[block]
                blocks.append(block)
            self._add(holder, blocks)
            return blocks

    def pin(self, holder: Hashable, blocks: Iterable[int]) -> None:
        """Make ``holder`` a holder of ``blocks``, each of which someone must already hold.

        Pinning a free block would keep garbage alive, and pinning twice would
        need two releases: both are refused with :class:`BlockError`.
        """
        blocks = list(blocks)
        with self._lock:
            for b in blocks:
                self._check_index(b)
                if not self._holders[b]:
                    raise BlockError(f"{holder!r} cannot pin block {b}: it is free (nobody holds its contents)")
                if holder in self._holders[b]:
                    raise BlockError(f"{holder!r} already holds block {b}")
            if len(set(blocks)) != len(blocks):
                raise BlockError(f"{holder!r} named a block twice in {blocks}")
            self._add(holder, blocks)

    def release(self, holder: Hashable, blocks: Iterable[int] | None = None) -> list[int]:
        """Drop ``holder``'s hold on ``blocks`` (default: all it holds); returns the blocks now free.

        All or nothing: if ``holder`` does not hold one of them, nothing is
        released, the over-release is counted and :class:`BlockError` raised.
        """
        with self._lock:
            mine = self._held.get(holder, set())
            todo = sorted(mine) if blocks is None else list(blocks)
            stray = [b for b in todo if b not in mine]
            if stray or len(set(todo)) != len(todo):
                self.over_releases += 1
                raise BlockError(f"{holder!r} released blocks {stray or todo} it does not hold")
            freed = []
            for b in todo:
                holders = self._holders[b]
                holders.discard(holder)
                mine.discard(b)
                if not holders:
                    self._free[b] = None
                    freed.append(b)
            if not mine:
                self._held.pop(holder, None)
            return freed

    def held_by(self, holder: Hashable) -> tuple[int, ...]:
        """The blocks ``holder`` holds now, sorted."""
        with self._lock:
            return tuple(sorted(self._held.get(holder, ())))

    def holders(self, block: int) -> frozenset[Hashable]:
        with self._lock:
            return frozenset(self._holders[block])

    def refcount(self, block: int) -> int:
        with self._lock:
            return len(self._holders[block])

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def holder_count(self) -> int:
        """How many distinct holders hold something: 0 once everything is released."""
        with self._lock:
            return len(self._held)

    def _add(self, holder: Hashable, blocks: list[int]) -> None:
        mine = self._held.setdefault(holder, set())
        for b in blocks:
            self._holders[b].add(holder)
            self._free.pop(b, None)
            mine.add(b)

    def _check_index(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise BlockError(f"block {block} is outside the pool (0..{self.num_blocks - 1})")
