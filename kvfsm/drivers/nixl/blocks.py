"""A rank's KV blocks: rows of one registered torch tensor, a :class:`BlockPool` saying who holds each, and their bytes.

The bytes of a request's blocks are a pattern of (prefill request id, block
position, logical byte offset), so the decode side can byte-check every
block it read without a second copy, whatever slice of the heads it holds.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from typing_extensions import TypeVar

from ..block_pool import BlockPool
from .memory import BlockLayout, BlockMemory


def kv_pattern(request_id: str, position: int, lo: int, hi: int) -> torch.Tensor:
    """Bytes ``[lo, hi)`` of block ``position`` of ``request_id``'s KV, as the prefill computed it."""
    seed = zlib.crc32(f"{request_id}/{position}".encode())
    offsets = torch.arange(lo, hi, dtype=torch.int64)
    return ((offsets * 131 + seed) % 251).to(torch.uint8)


class KVBlocks:
    """``num_blocks`` blocks of ``block_bytes`` each, contiguous in one uint8 tensor (what NIXL registers)."""

    def __init__(self, num_blocks: int, block_bytes: int) -> None:
        self.tensor = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)
        self.pool = BlockPool(num_blocks)
        self.block_bytes = block_bytes

    @property
    def base(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def layout(self) -> BlockLayout:
        """One part, one run per block: what a decode rank reads from (a peer's) or into (its own)."""
        return BlockLayout.contiguous(self.base, self.block_bytes)

    def tensors(self) -> list[torch.Tensor]:
        return [self.tensor]

    def addr(self, block: int, offset: int = 0) -> int:
        return self.base + block * self.block_bytes + offset

    def fill(self, blocks: Sequence[int], request_id: str, lo: int) -> None:
        """Write the pattern of ``request_id`` into ``blocks`` (positions 0, 1, …), logical bytes from ``lo``."""
        for position, block in enumerate(blocks):
            self.tensor[block] = kv_pattern(request_id, position, lo, lo + self.block_bytes)

    def wrong(self, blocks: Sequence[int], request_id: str, lo: int, first: int = 0) -> list[int]:
        """The blocks (positions ``first``, ``first+1``, …) whose bytes are not ``request_id``'s pattern."""
        return [
            block
            for position, block in enumerate(blocks, first)
            if not torch.equal(self.tensor[block], kv_pattern(request_id, position, lo, lo + self.block_bytes))
        ]


M = TypeVar("M", bound=BlockMemory, default=KVBlocks)
"""A rank's block memory: kvfsm's own :class:`KVBlocks` unless the rank is given vLLM's cache."""


def own_blocks(blocks: M | None, num_blocks: int, block_bytes: int) -> M:
    """``blocks``, checked against ``num_blocks``; or kvfsm's own :class:`KVBlocks` when none is given."""
    if blocks is None:
        return KVBlocks(num_blocks, block_bytes)  # type: ignore[return-value]  # M defaults to KVBlocks
    if blocks.pool.num_blocks != num_blocks:
        raise ValueError(f"the rank's memory has {blocks.pool.num_blocks} blocks, not the {num_blocks} it was told")
    return blocks
