"""Where a rank's KV blocks are in memory, and the NIXL descriptors that READ one side's blocks into the other's.

A block is *logically* one run of ``block_bytes`` bytes (what :class:`~.topology.Topology`
slices between TP ranks); *physically* it is spread over the tensors a rank
registers with its agent. kvfsm's own :class:`~.blocks.KVBlocks` is one
tensor, one run per block. vLLM's KV cache (``register_kv_caches``) is one
tensor per attention layer, in whatever layout its attention backend chose:
block ``b`` of layer ``l`` is at ``base_l + b * stride_l``, as one run on the
CPU backend (``[blocks, kv_heads, block_size, 2*head_size]``) or as two (K
and V) for FlashAttention's ``[2, blocks, ...]``.

:class:`BlockLayout` describes that: per registered part, a base, a block
stride and the runs of one block. :func:`read_extents` pairs a local and a
remote layout and cuts the transfer at every boundary of either side, so each
``(address, length)`` pair is contiguous on both: one READ descriptor per
(layer, block) when both sides run the same model. The layout travels in the
handshake (:meth:`BlockLayout.to_json`), the decode side never reads the
prefill's tensors any other way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from typing import Any, Protocol

import torch

from ..block_pool import BlockPool
from ..dataplane import Extent
from ..kv_cache import KVCache


@dataclass(frozen=True)
class Part:
    """One registered tensor's share of every block: block ``b``'s bytes are ``runs`` from ``base + b * stride``."""

    base: int
    stride: int
    runs: tuple[tuple[int, int], ...]
    """``(offset from the block's start, length)`` of each contiguous run, in logical order."""

    @property
    def block_bytes(self) -> int:
        return sum(n for _, n in self.runs)


@dataclass(frozen=True)
class BlockLayout:
    """A rank's blocks: its parts in logical order (a block's logical bytes are every part's runs, concatenated)."""

    parts: tuple[Part, ...]

    def __post_init__(self) -> None:
        if not self.parts or any(not p.runs or any(n <= 0 for _, n in p.runs) for p in self.parts):
            raise ValueError(f"a block layout needs at least one part, each with runs of positive length: {self}")

    @classmethod
    def contiguous(cls, base: int, block_bytes: int) -> BlockLayout:
        """Blocks of ``block_bytes`` one after the other from ``base`` (kvfsm's own :class:`~.blocks.KVBlocks`)."""
        return cls((Part(base, block_bytes, ((0, block_bytes),)),))

    @classmethod
    def of_cache(cls, cache: KVCache) -> BlockLayout:
        """vLLM's per-layer caches, adopted by :meth:`KVCache.of_layers`: one part per layer, in layer order."""
        return cls(tuple(_part(p) for p in cache.parts))

    @property
    def block_bytes(self) -> int:
        return sum(p.block_bytes for p in self.parts)

    def spans(self) -> tuple[tuple[int, int, int, int], ...]:
        """Every run as ``(logical offset, part, offset in the block, length)``, in logical order."""
        return _spans(self)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"base": p.base, "stride": p.stride, "runs": [list(r) for r in p.runs]} for p in self.parts]

    @classmethod
    def from_json(cls, data: Sequence[dict[str, Any]]) -> BlockLayout:
        try:
            return cls(tuple(
                Part(int(p["base"]), int(p["stride"]), tuple((int(o), int(n)) for o, n in p["runs"])) for p in data
            ))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a block layout: {exc}") from None


@cache
def _spans(layout: BlockLayout) -> tuple[tuple[int, int, int, int], ...]:
    out = []
    logical = 0
    for index, part in enumerate(layout.parts):
        for offset, n in part.runs:
            out.append((logical, index, offset, n))
            logical += n
    return tuple(out)


Segment = tuple[int, int, int, int, int]
"""``(local part, offset in the local block, remote part, offset in the remote block, length)``: contiguous on both."""


@cache
def segments(local: BlockLayout, dst: int, remote: BlockLayout, src: int, length: int) -> tuple[Segment, ...]:
    """Logical bytes ``[src, src+length)`` of a remote block to ``[dst, dst+length)`` of a local one, cut where either
    side's runs end."""
    if dst < 0 or src < 0 or length <= 0 or dst + length > local.block_bytes or src + length > remote.block_bytes:
        raise ValueError(
            f"cannot read bytes [{src}, {src + length}) of a {remote.block_bytes}-byte remote block into "
            f"[{dst}, {dst + length}) of a {local.block_bytes}-byte local one: the two sides' blocks do not match "
            "(the engines must run the same model, block size and dtype)"
        )
    cuts = {0, length}
    for start, spans in ((dst, local.spans()), (src, remote.spans())):
        for logical, _, _, n in spans:
            for edge in (logical - start, logical + n - start):
                if 0 < edge < length:
                    cuts.add(edge)
    edges = sorted(cuts)
    return tuple((*_locate(local, dst + a), *_locate(remote, src + a), b - a) for a, b in pairwise(edges))


def _locate(layout: BlockLayout, logical: int) -> tuple[int, int]:
    """The part and in-block offset of logical byte ``logical``."""
    for start, part, offset, n in layout.spans():
        if start <= logical < start + n:
            return part, offset + logical - start
    raise ValueError(f"logical byte {logical} is outside a {layout.block_bytes}-byte block")


def read_extents(
    local: BlockLayout, local_blocks: Sequence[int], dst: int,
    remote: BlockLayout, remote_blocks: Sequence[int], src: int, length: int,
) -> tuple[list[Extent], list[Extent]]:  # fmt: skip
    """The local and remote descriptor lists of one READ: block by block, segment by segment (pairwise equal)."""
    if len(local_blocks) != len(remote_blocks):
        raise ValueError(f"{len(local_blocks)} local blocks for {len(remote_blocks)} remote ones")
    segs = segments(local, dst, remote, src, length)
    lp, rp = local.parts, remote.parts
    mine: list[Extent] = []
    theirs: list[Extent] = []
    for lb, rb in zip(local_blocks, remote_blocks, strict=True):
        for lpart, loff, rpart, roff, n in segs:
            mine.append((lp[lpart].base + lb * lp[lpart].stride + loff, n))
            theirs.append((rp[rpart].base + rb * rp[rpart].stride + roff, n))
    return mine, theirs


def _part(part: torch.Tensor) -> Part:
    """A block-major view's base, block stride and the contiguous runs of its block 0."""
    size = part.element_size()
    block = part[0]
    shape, strides = list(block.shape), list(block.stride())
    if math.prod(shape) == 0:
        raise ValueError(f"a KV cache tensor with an empty block (shape {tuple(part.shape)})")
    # Drop dimensions of size 1 (their stride means nothing), then merge the innermost contiguous ones into a run.
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    offsets = [0]
    for n, s in dims:
        offsets = [o + i * s for o in offsets for i in range(n)]
    return Part(part.data_ptr(), part.stride(0) * size, tuple((o * size, run * size) for o in offsets))


class BlockMemory(Protocol):
    """A rank's KV blocks: who holds each (``pool``), where their bytes are, what its agent registers."""

    pool: BlockPool

    @property
    def layout(self) -> BlockLayout: ...

    def tensors(self) -> Sequence[torch.Tensor]:
        """What the rank's agent registers (each region once)."""
        ...

    def wrong(self, blocks: Sequence[int], request_id: str, lo: int, first: int = 0) -> list[int] | None:
        """The blocks whose bytes are not ``request_id``'s; None when this memory cannot tell (the model's KV)."""
        ...


class CacheBlocks:
    """vLLM's own KV cache as a rank's blocks: the per-layer tensors ``register_kv_caches`` hands over, never a copy.

    The READ lands where vLLM's attention reads: there is no pattern to
    byte-check (the bytes are the model's KV), so :meth:`wrong` answers None
    and the decode side's check is that every READ ended ``DONE``; a test
    compares the tokens generated from what was read.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.pool = BlockPool(cache.num_blocks)
        self._layout = BlockLayout.of_cache(cache)
        self._tensors = _regions(cache.parts)

    @property
    def layout(self) -> BlockLayout:
        return self._layout

    @property
    def block_bytes(self) -> int:
        return self._layout.block_bytes

    def tensors(self) -> Sequence[torch.Tensor]:
        return self._tensors

    def wrong(self, blocks: Sequence[int], request_id: str, lo: int, first: int = 0) -> list[int] | None:
        return None


def _regions(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One flat uint8 tensor per distinct storage under ``parts``: layers that share memory are registered once."""
    seen: dict[int, torch.Tensor] = {}
    for p in parts:
        storage = p.untyped_storage()
        if storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = torch.empty(0, dtype=torch.uint8, device=p.device).set_(storage)
    return list(seen.values())
