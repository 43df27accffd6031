"""KV caches as torch tensors shaped like vLLM's, and batched block copies between them.

A cache kvfsm allocates is stored block-major — ``(blocks, layers, block_size,
heads, head_size)``, vLLM's cross-layer layout — and exposed layer-major
through :attr:`KVCache.layers`. Block-major storage makes one block one
contiguous run of bytes, so moving ``n`` blocks is ``n`` large memcpys issued
by a single batched call instead of ``layers × n`` small ones. vLLM's own
cache, one tensor per layer, is adopted as it is (:meth:`KVCache.of_layers`):
a connector must read and write the tensors the model attends over, never a
copy of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
    """``num_blocks`` KV blocks on one device; block ids are the ones a :class:`BlockPool` hands out.

    The bytes are one or more *parts*, tensors whose dim 0 indexes blocks. A
    cache kvfsm allocates is one block-major part; vLLM's own cache, adopted
    with :meth:`of_layers`, is one part per attention layer, in whatever
    layout vLLM's attention backend chose. A copy moves block ``b`` of every
    part, so it never needs to know the layout inside a block.
    """

    __slots__ = ("_rows", "device", "layout", "num_blocks", "parts")

    def __init__(
        self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu", *, pin_memory: bool = False
    ) -> None:
        """``pin_memory`` page-locks a CPU cache so CUDA copies to and from it are asynchronous DMA."""
        shape = (num_blocks, layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_size)
        storage = torch.zeros(shape, dtype=layout.dtype, device=torch.device(device), pin_memory=pin_memory)
        self._adopt(layout, num_blocks, (storage,))

    def _adopt(self, layout: KVLayout, num_blocks: int, parts: tuple[torch.Tensor, ...]) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.parts = parts
        self.device = parts[0].device
        # One view per block, made once, so a copy never builds views block by block; for vLLM's
        # per-layer caches (many parts, perhaps 10^5 blocks) they are made per copy instead.
        self._rows: tuple[torch.Tensor, ...] | None = parts[0].unbind(0) if len(parts) == 1 else None

    @classmethod
    def wrap(cls, storage: torch.Tensor) -> KVCache:
        """Adopt an existing block-major cache ``(blocks, layers, block_size, heads, head_size)``.

        This is how a worker uses the KV cache vLLM allocated in its cross-layer
        layout (``register_cross_layers_kv_cache``) instead of a copy.
        """
        if storage.dim() != 5 or not storage.is_contiguous():
            raise ValueError(
                f"expected a contiguous (blocks, layers, block_size, heads, head_size) tensor, got shape {tuple(storage.shape)}"
                + ("" if storage.is_contiguous() else " (not contiguous)")
            )
        blocks, layers, block_size, heads, head_size = storage.shape
        cache = cls.__new__(cls)
        cache._adopt(KVLayout(layers, block_size, heads, head_size, storage.dtype), blocks, (storage,))
        return cache

    @classmethod
    def of_layers(
        cls,
        tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
        num_blocks: int,
        layout: KVLayout,
        placements: Sequence[Placement] = (),
    ) -> KVCache:
        """Adopt vLLM's own KV cache (``register_kv_caches``) without copying: block ``b`` of the result is block
        ``b`` of every layer.

        With ``placements`` (vLLM's ``KVCacheConfig.kv_cache_tensors``) the
        blocks are read from vLLM's allocation as vLLM itself reads them: each
        layer's region of its backing storage, ``num_blocks`` pages of
        ``block_stride`` bytes (the whole packed block when blocks are
        outermost), whatever shape the attention backend gives the tensor.
        Without them, each tensor's block dimension is the one dimension whose
        size is ``num_blocks``. Either way the cache must hold exactly
        ``layout.block_bytes`` per block, the connector's view of the model.
        """
        if not tensors:
            raise ValueError("vLLM registered no KV cache tensors")
        if placements:
            if not isinstance(tensors, Mapping):
                raise TypeError("reading vLLM's placements needs the tensors by layer name")
            parts = _placed_regions(tensors, num_blocks, placements)
        else:
            listed = list(tensors.values()) if isinstance(tensors, Mapping) else list(tensors)
            parts = tuple(_block_major(t, num_blocks, i) for i, t in enumerate(listed))
        devices = {p.device for p in parts}
        if len(devices) != 1:
            raise ValueError(f"vLLM's KV cache tensors are on several devices ({sorted(map(str, devices))})")
        held = sum(_part_block_bytes(p) for p in parts)
        if held != layout.block_bytes:
            raise ValueError(
                f"vLLM's KV cache holds {held} B per block in {len(parts)} tensors, but the KV-cache config "
                f"describes {layout.block_bytes} B ({layout}); the connector and the engine disagree on the model"
            )
        cache = cls.__new__(cls)
        cache._adopt(layout, num_blocks, parts)
        return cache

    @classmethod
    def like(
        cls, other: KVCache, num_blocks: int, device: str | torch.device = "cpu", *, pin_memory: bool = False
    ) -> KVCache:
        """A new zeroed cache of ``num_blocks`` blocks whose every block has ``other``'s parts and shapes (a CPU
        tier for vLLM's cache, say), so blocks copy between the two one for one."""
        parts = tuple(
            torch.zeros((num_blocks, *p.shape[1:]), dtype=p.dtype, device=torch.device(device), pin_memory=pin_memory)
            for p in other.parts
        )
        cache = cls.__new__(cls)
        cache._adopt(other.layout, num_blocks, parts)
        return cache

    @classmethod
    def over_rows(cls, rows: torch.Tensor, like: KVCache) -> KVCache:
        """``rows``, a contiguous uint8 ``(blocks, block_bytes)`` tensor, seen as a cache with ``like``'s parts and
        shapes (no copy): block ``b`` is row ``b``, ``like``'s parts end to end in part order.

        Each block is then one run of bytes, what a store puts from and gets
        into, while blocks still copy between ``like`` and the rows one for
        one (:func:`copy_blocks`). Row ``b`` holds :meth:`block_bytes` of block ``b``.
        """
        if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_contiguous():
            raise ValueError(
                f"rows must be a contiguous uint8 (blocks, block_bytes) tensor, got {rows.dtype} {tuple(rows.shape)}"
            )
        sizes = [_part_block_bytes(p) for p in like.parts]
        if sum(sizes) != rows.shape[1]:
            raise ValueError(f"rows of {rows.shape[1]} B cannot hold blocks of {sum(sizes)} B ({like.signature})")
        parts, offset = [], 0
        for part, size in zip(like.parts, sizes, strict=True):
            try:
                typed = rows[:, offset : offset + size].view(part.dtype)
            except RuntimeError as exc:  # a part of a wider dtype that would start at an unaligned byte
                raise ValueError(f"a {part.dtype} part at byte {offset} of each row is not aligned: {exc}") from exc
            parts.append(typed.unflatten(1, tuple(part.shape[1:])))  # type: ignore[no-untyped-call]
            offset += size
        cache = cls.__new__(cls)
        cache._adopt(like.layout, rows.shape[0], tuple(parts))
        return cache

    @property
    def signature(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        """Each part's per-block shape and dtype: two caches whose signatures match copy blocks one for one."""
        return tuple((tuple(p.shape[1:]), p.dtype) for p in self.parts)

    @property
    def storage(self) -> torch.Tensor:
        """The block-major tensor ``(blocks, layers, block_size, heads, head_size)`` of a one-part cache."""
        if len(self.parts) != 1:
            raise AttributeError(
                f"this cache is {len(self.parts)} per-layer tensors (vLLM's own); read blocks with block_bytes()"
            )
        return self.parts[0]

    @property
    def layers(self) -> torch.Tensor:
        """The cache as ``(layers, blocks, block_size, heads, head_size)``: ``layers[i]`` is layer i's cache."""
        return self.storage.permute(1, 0, 2, 3, 4)

    def block(self, block: int) -> torch.Tensor:
        """One block across all layers, ``(layers, block_size, heads, head_size)`` (a view; one-part caches)."""
        return self.storage[block]

    def block_bytes(self, block: int) -> bytes:
        """Block ``block``'s bytes in every part, in part order: what a test compares across caches and engines."""
        return b"".join(p[block].contiguous().cpu().view(torch.uint8).numpy().tobytes() for p in self.parts)

    def poison(self, blocks: Sequence[int]) -> None:
        """Overwrite ``blocks`` in every part with garbage (NaN, or all bits set): what a failed copy leaves."""
        if blocks:
            index = torch.tensor(list(blocks), device=self.device)
            for p in self.parts:
                p.index_fill_(0, index, float("nan") if p.is_floating_point() else torch.iinfo(p.dtype).max)

    def rows(self, blocks: Sequence[int]) -> list[torch.Tensor]:
        """Views of ``blocks`` in every part, block by block, part by part; gathered in C for a one-part cache."""
        if not blocks:
            return []
        if self._rows is not None:
            picked = itemgetter(*blocks)(self._rows)
            return [picked] if len(blocks) == 1 else list(picked)
        return [p[b] for b in blocks for p in self.parts]


class Placement(Protocol):
    """Where vLLM put a set of layers in its allocation (vLLM's ``KVCacheTensor``): layer ``l``'s page of block
    ``b`` starts ``offset + l * layer_stride + b * block_stride`` bytes in."""

    layers: list[str]
    layer_stride: int
    block_stride: int
    offset: int


def _placed_regions(
    tensors: Mapping[str, torch.Tensor], num_blocks: int, placements: Sequence[Placement]
) -> tuple[torch.Tensor, ...]:
    """Byte views ``(num_blocks, block_stride)`` of vLLM's allocation, one per layer region (one in all when
    blocks are outermost); regions that alias the same bytes count once."""
    parts: list[torch.Tensor] = []
    seen: set[tuple[torch.device, int]] = set()
    for place in placements:
        name = next((n for n in place.layers if n in tensors), None)
        if name is None:
            continue
        span = num_blocks * place.block_stride
        if place.layer_stride >= span:  # layer-outermost: each layer a region of its own
            start, span = place.offset, len(place.layers) * place.layer_stride
        else:  # block-outermost: one region, each block the pages of every layer
            start = 0
        tensor = tensors[name]
        raw = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())
        if raw.numel() < start + span:
            raise ValueError(
                f"vLLM's KV cache {name!r} has {raw.numel()} B of storage, less than the {span} B placed at {start}"
            )
        for region in raw[start : start + span].view(-1, num_blocks, place.block_stride):
            key = (region.device, region.data_ptr())
            if key not in seen:
                seen.add(key)
                parts.append(region)
    if not parts:
        raise ValueError(f"none of vLLM's placements names a registered layer ({sorted(tensors)[:4]}...)")
    return tuple(parts)


def _block_major(tensor: torch.Tensor, num_blocks: int, index: int) -> torch.Tensor:
    """A view of ``tensor`` with its block dimension, the one of size ``num_blocks``, first."""
    dims = [d for d, n in enumerate(tensor.shape) if n == num_blocks]
    if len(dims) != 1:
        raise ValueError(
            f"cannot tell the block dimension of vLLM's KV cache tensor {index} (shape {tuple(tensor.shape)}, "
            f"{num_blocks} blocks): {'several dimensions' if dims else 'no dimension'} fit; pass vLLM's "
            "placements (KVCacheConfig.kv_cache_tensors)"
        )
    return tensor.movedim(dims[0], 0)


def _part_block_bytes(part: torch.Tensor) -> int:
    return part[0].numel() * part.element_size()


def copy_blocks(
    src: KVCache, src_blocks: Sequence[int], dst: KVCache, dst_blocks: Sequence[int], *, non_blocking: bool = False
) -> int:
    """Copy block ``src_blocks[i]`` of ``src`` into block ``dst_blocks[i]`` of ``dst``; returns the bytes moved.

    One ``torch._foreach_copy_`` over per-block views: every block of every
    part is one memcpy (a DMA between devices), all issued by one call. A
    gather (``index_select``) into a staging buffer and a scatter
    (``index_copy_``) would touch every byte twice; ``kvfsm.showcase.bench.offload``
    measures both against one contiguous ``copy_``.
    """
    if src.signature != dst.signature:
        raise ValueError(
            f"cannot copy between KV layouts {src.layout} and {dst.layout} (parts {src.signature} and {dst.signature})"
        )
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
