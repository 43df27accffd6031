"""KV caches as torch tensors shaped like vLLM's, and batched block copies between them.

A cache is stored block-major — ``(blocks, layers, block_size, heads, head_size)``,
vLLM's cross-layer layout — and exposed layer-major through :attr:`KVCache.layers`,
a ``(layers, blocks, block_size, heads, head_size)`` view, which is what an
attention layer indexes. Block-major storage makes one block one contiguous
run of bytes, so moving ``n`` blocks is ``n`` large memcpys issued by a single
batched call instead of ``layers × n`` small ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Protocol

import torch


@dataclass(frozen=True)
class KVLayout:
    """The shape of one KV block. A *layer* is one cache tensor: vLLM keeps K and V of an attention layer apart."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be at least 1, not {getattr(self, name)}")

    @property
    def block_numel(self) -> int:
        return self.num_layers * self.block_size * self.num_kv_heads * self.head_size

    @property
    def block_bytes(self) -> int:
        return self.block_numel * torch.empty((), dtype=self.dtype).element_size()


class KVCache:
    """``num_blocks`` KV blocks on one device; block ids are the ones a :class:`BlockPool` hands out."""

    __slots__ = ("_rows", "device", "layout", "num_blocks", "storage")

    def __init__(
        self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", *, pin_memory: bool = False
    ) -> None:
        """``pin_memory`` page-locks a CPU cache so CUDA copies to and from it are asynchronous DMA."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        shape = (num_blocks, layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_size)
        self.storage = torch.zeros(shape, dtype=layout.dtype, device=self.device, pin_memory=pin_memory)
        self._rows: tuple[torch.Tensor, ...] = self.storage.view(num_blocks, -1).unbind(0)
        """One flat view per block, made once, so a copy never builds views block by block."""

    @classmethod
    def wrap(cls, storage: torch.Tensor) -> KVCache:
        """Adopt an existing block-major cache ``(blocks, layers, block_size, heads, head_size)``.

        This is how a worker uses the KV cache vLLM allocated (its cross-layer
        layout, ``register_cross_layers_kv_cache``) instead of a copy.
        """
        if storage.dim() != 5 or not storage.is_contiguous():
            raise ValueError(
                f"expected a contiguous (blocks, layers, block_size, heads, head_size) tensor, got shape {tuple(storage.shape)}"
                + ("" if storage.is_contiguous() else " (not contiguous)")
            )
        blocks, layers, block_size, heads, head_size = storage.shape
        cache = cls.__new__(cls)
        cache.layout = KVLayout(layers, block_size, heads, head_size, storage.dtype)
        cache.num_blocks = blocks
        cache.device = storage.device
        cache.storage = storage
        cache._rows = storage.view(blocks, -1).unbind(0)
        return cache

    @property
    def layers(self) -> torch.Tensor:
        """The cache as ``(layers, blocks, block_size, heads, head_size)``: ``layers[i]`` is layer i's cache."""
        return self.storage.permute(1, 0, 2, 3, 4)

    def block(self, block: int) -> torch.Tensor:
        """One block across all layers, ``(layers, block_size, heads, head_size)`` (a view)."""
        return self.storage[block]

    def rows(self, blocks: Sequence[int]) -> list[torch.Tensor]:
        """Flat views of ``blocks``, gathered in C (``itemgetter``), not by a Python loop."""
        if not blocks:
            return []
        picked = itemgetter(*blocks)(self._rows)
        return [picked] if len(blocks) == 1 else list(picked)


def copy_blocks(
    src: KVCache, src_blocks: Sequence[int], dst: KVCache, dst_blocks: Sequence[int], *, non_blocking: bool = False
) -> int:
    """Copy block ``src_blocks[i]`` of ``src`` into block ``dst_blocks[i]`` of ``dst``; returns the bytes moved.

    One ``torch._foreach_copy_`` over per-block views: every block is one
    contiguous memcpy (a DMA between devices), all issued by one call. A
    gather (``index_select``) into a staging buffer and a scatter
    (``index_copy_``) would touch every byte twice; ``kvfsm.showcase.bench.offload``
    measures both against one contiguous ``copy_``.
    """
    if src.layout != dst.layout:
        raise ValueError(f"cannot copy between KV layouts {src.layout} and {dst.layout}")
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
    if not src_blocks:
        return 0
    torch._foreach_copy_(dst.rows(dst_blocks), src.rows(src_blocks), non_blocking=non_blocking)
    return len(src_blocks) * src.layout.block_bytes


@dataclass
class Copy:
    """One requested block copy: what to move, and for which job."""

    job: int
    src: KVCache
    src_blocks: list[int]
    dst: KVCache
    dst_blocks: list[int]


Done = tuple[int, BaseException | None]
"""A finished copy: its job and the error it raised, or None."""


class Copier(Protocol):
    """Runs block copies and reports each submitted job exactly once, failed or not."""

    def submit(self, copy: Copy) -> None: ...

    def poll(self) -> list[Done]:
        """The jobs whose copies are over since the last call."""
        ...


@dataclass
class BlockCopier:
    """Runs copies and says which are over: on a side CUDA stream when a cache is on a GPU, inline otherwise.

    ``poll()`` returns each submitted job exactly once, failed or not: a
    worker must report every load it started, even a failed one.
    """

    _inflight: list[tuple[int, Callable[[], bool]]] = field(default_factory=list)
    _done: list[Done] = field(default_factory=list)
    _stream: torch.cuda.Stream | None = None

    def submit(self, copy: Copy) -> None:
        on_gpu = copy.src.device.type == "cuda" or copy.dst.device.type == "cuda"
        try:
            if not on_gpu:
                copy_blocks(copy.src, copy.src_blocks, copy.dst, copy.dst_blocks)
                self._done.append((copy.job, None))
                return
            if self._stream is None:
                self._stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            # The copy must see what the model wrote on the compute stream before it.
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                copy_blocks(copy.src, copy.src_blocks, copy.dst, copy.dst_blocks, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self._stream)
            self._inflight.append((copy.job, event.query))
        except Exception as exc:
            self._done.append((copy.job, exc))

    def poll(self) -> list[Done]:
        """The jobs whose copies are over since the last call."""
        done, self._done = self._done, []
        if self._inflight:
            still = []
            for job, finished in self._inflight:
                if finished():
                    done.append((job, None))
                else:
                    still.append((job, finished))
            self._inflight = still
        return done
