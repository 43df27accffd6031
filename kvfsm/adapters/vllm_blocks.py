"""vLLM's own GPU block pool seen as a kvfsm :class:`BlockPool`: a driver's hold is a reference on vLLM's block.

vLLM hands a connector its scheduler's ``BlockPool`` (``bind_gpu_block_pool``).
kvfsm's drivers hold GPU blocks as ``(resource, key)`` holders; through this
view every such hold is also one ``ref_cnt`` on vLLM's ``KVCacheBlock``
(``touch`` to take it, ``free_blocks`` to drop it), so vLLM cannot hand a
block out while a load writes it or a store reads it, and kvfsm's holder
bookkeeping still refuses a release by someone who holds nothing.

Invariant, checked by :meth:`VllmGpuBlocks.check`: each block's vLLM
``ref_cnt`` is at least the number of kvfsm holders of it (vLLM's requests
hold the rest). Duck-typed on vLLM's pool (``blocks``, ``touch``,
``free_blocks``), so it needs no vLLM import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from ..drivers.block_pool import BlockPool, BlockPoolError, Holder, HolderError


class VllmBlockPool(Protocol):
    """What this view uses of ``vllm.v1.core.block_pool.BlockPool``."""

    @property
    def blocks(self) -> Sequence[Any]:
        """``KVCacheBlock``s by block id, each with ``ref_cnt`` and ``block_hash``."""
        ...

    def touch(self, blocks: Sequence[Any]) -> None: ...
    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None: ...


class VllmGpuBlocks(BlockPool):
    """A kvfsm pool whose holds are also references on vLLM's GPU blocks; vLLM allocates, kvfsm only pins."""

    __slots__ = ("vllm_pool",)

    def __init__(self, vllm_pool: VllmBlockPool) -> None:
        super().__init__(len(vllm_pool.blocks))
        self.vllm_pool = vllm_pool

    def pin(self, holder: Holder, blocks: Iterable[int]) -> None:
        """Hold ``blocks``: each must be in use by vLLM (a request's block) or cached there (a prefix hit)."""
        blocks = list(blocks)
        vblocks = [self.vllm_pool.blocks[b] for b in blocks if 0 <= b < self.num_blocks]
        for vb in vblocks:
            if vb.ref_cnt == 0 and vb.block_hash is None:
                raise HolderError(
                    f"{holder!r} cannot pin GPU block {vb.block_id}: vLLM holds it nowhere and it caches nothing, "
                    "so its bytes are garbage; pin the blocks vLLM gave the request"
                )
        with self._lock:
            # kvfsm's side: the same checks as any pool, but these blocks were allocated by vLLM.
            if len(set(blocks)) != len(blocks) or len(vblocks) != len(blocks):
                raise HolderError(f"{holder!r} named a block twice or outside 0..{self.num_blocks - 1} in {blocks}")
            for b in blocks:
                if holder in self._holders[b]:
                    raise HolderError(f"{holder!r} already holds block {b}; release it before pinning it again")
            for b in blocks:
                self._free.pop(b, None)
            self._add(holder, blocks)
        self.vllm_pool.touch(vblocks)

    def release(self, holder: Holder, blocks: Iterable[int] | None = None) -> list[int]:
        """Drop the holds (kvfsm's checks first, nothing changes if they refuse), then vLLM's references."""
        todo = list(self.held_by(holder)) if blocks is None else list(blocks)
        freed = super().release(holder, todo)
        self.vllm_pool.free_blocks([self.vllm_pool.blocks[b] for b in todo])
        return freed

    def check(self) -> None:
        super().check()
        for b, holders in self.referenced().items():
            if self.vllm_pool.blocks[b].ref_cnt < holders:
                raise BlockPoolError(
                    f"GPU block {b}: {holders} kvfsm holders but vLLM's ref_cnt is {self.vllm_pool.blocks[b].ref_cnt}"
                )
