"""A block pool's blocks as the rows of one registered tensor: what a Mooncake store reads from and writes into.

The bookkeeping (who holds which block) is the one
:class:`~kvfsm.drivers.block_pool.BlockPool`; this class adds only the bytes
and their addresses, which zero-copy store calls (``batch_put_from``,
``batch_get_into``) take.
"""

from __future__ import annotations

import torch

from ..block_pool import BlockPool


class BlockBuffer:
    """``pool``'s blocks as rows of ``kv``, a contiguous uint8 ``(num_blocks, block_bytes)`` tensor.

    ``kv`` is a new zeroed tensor on ``device`` unless one is passed (for
    example a tensor already registered with a store). Register
    ``kv.data_ptr()`` / :attr:`nbytes` with the store before any call.
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
        """Row ``b`` is block ``b``."""
        self.pool = BlockPool(num_blocks)
        """Who holds each block: the requests, each store job's pin, each load's pin."""
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self._base = kv.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def ptr(self, block: int) -> int:
        """The address of ``block``'s first byte (what zero-copy store calls take)."""
        return self._base + block * self.block_bytes
