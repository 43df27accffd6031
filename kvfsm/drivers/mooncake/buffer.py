"""A block pool's blocks as the rows of one registered tensor: what a Mooncake store reads from and writes into.

The bookkeeping (who holds which block) is the one
:class:`~kvfsm.drivers.block_pool.BlockPool`; this class adds only the bytes
and their addresses, which zero-copy store calls (``batch_put_from``,
``batch_get_into``) take.

In an engine the blocks are the engine's own KV cache (vLLM's per-layer
tensors), which the store never sees: :meth:`BlockBuffer.attach` makes the
rows their staging copy, one row per engine block. A store job
:meth:`~BlockBuffer.gather` s the engine's blocks into their rows before it
puts them, and a load :meth:`~BlockBuffer.scatter` s the rows it got into the
engine's blocks before they count as filled. Each row is one run of bytes, so
every key stays one ``ptr, size`` pair whatever layout the engine chose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..block_pool import BlockPool
from ..kv_cache import KVCache, copy_blocks


class BlockBuffer:
    """``pool``'s blocks as rows of ``kv``, a contiguous uint8 ``(num_blocks, block_bytes)`` tensor.

    ``kv`` is a new zeroed tensor on ``device`` unless one is passed (for
    example a tensor already registered with a store). Register
    ``kv.data_ptr()`` / :attr:`nbytes` with the store before any call.
    Until :meth:`attach`, the rows are the blocks themselves.
    """

    def __init__(
        self, num_blocks: int, block_bytes: int, *, device: str | torch.device = "cpu", kv: torch.Tensor | None = None
    ) -> None:
        if num_blocks <= 0 or block_bytes <= 0:
            raise ValueError(f"a buffer needs num_blocks > 0 and block_bytes > 0 (got {num_blocks}, {block_bytes})")
        if kv is None:
            kv = torch.zeros((num_blocks, block_bytes), dtype=torch.uint8, device=device)
        elif kv.shape != (num_blocks, block_bytes) or kv.dtype != torch.uint8 or not kv.is_contiguous():
            raise ValueError(
                f"kv must be a contiguous uint8 tensor of shape ({num_blocks}, {block_bytes}); "
                f"got {kv.dtype} {tuple(kv.shape)}"
            )
        self.kv = kv
        """Row ``b`` is block ``b`` (its staging copy once an engine cache is attached)."""
        self.pool = BlockPool(num_blocks)
        """Who holds each block: the requests, each store job's pin, each load's pin."""
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._base = kv.data_ptr()
        self.engine: KVCache | None = None
        """The engine's KV cache whose blocks the rows stage, or None: the rows are the blocks."""
        self._rows: KVCache | None = None

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def ptr(self, block: int) -> int:
        """The address of ``block``'s first byte (what zero-copy store calls take)."""
        return self._base + block * self.block_bytes

    def attach(self, engine: KVCache) -> None:
        """Stage ``engine``'s blocks (the KV cache the model attends over) in the rows, block ``b`` in row ``b``.

        Call it before any job runs: the engine registers its cache once,
        before its first step.
        """
        if engine.num_blocks != self.num_blocks:
            raise ValueError(
                f"the engine's KV cache has {engine.num_blocks} blocks, the buffer {self.num_blocks}: "
                "the connector and the engine disagree on the cache"
            )
        rows = KVCache.over_rows(self.kv, engine)  # raises unless a block of the engine's is block_bytes
        self.engine, self._rows = engine, rows

    def gather(self, blocks: Sequence[int]) -> int:
        """Copy the engine's ``blocks`` into their rows (before a put reads them); returns the bytes moved."""
        if self.engine is None or self._rows is None:
            return 0
        return copy_blocks(self.engine, blocks, self._rows, blocks)

    def scatter(self, blocks: Sequence[int]) -> int:
        """Copy the rows of ``blocks`` into the engine's blocks (after a get filled them); returns the bytes moved."""
        if self.engine is None or self._rows is None:
            return 0
        return copy_blocks(self._rows, blocks, self.engine, blocks)
