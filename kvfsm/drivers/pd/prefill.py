"""Prefill's driver for the PD abort protocol: a room's KV written into decode's pages, chunk by chunk."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from ..block_pool import BlockPool


class ChunkWriter(Protocol):
    """Where a chunk's write goes: :class:`~.transport.PageWriter` (the data plane), or a copy in one process."""

    def submit(self, room: Hashable, chunk: int, src: Sequence[int], dst: Sequence[int], delay: float) -> None: ...


class PrefillDriver:
    """Prefill's actions: ``send_kv`` starts the room's first chunk; the release frees its own pages.

    ``src[room]`` and ``dst[room]`` are the room's own pages and decode's,
    set when decode's ``metadata`` is taken. The caller submits each next
    chunk as the one before lands (:meth:`submit`); ``delay(room, chunk)``
    is how long a chunk's write waits before it is posted (how long it takes
    on a busy fabric; none by default).
    """

    def __init__(self, pool: BlockPool, writer: ChunkWriter, chunk_pages: int = 1) -> None:
        self.pool = pool
        self.writer = writer
        self.chunk_pages = chunk_pages
        self.delay: Callable[[Hashable, int], float] = lambda room, chunk: 0.0
        self.src: dict[Hashable, list[int]] = {}
        self.dst: dict[Hashable, list[int]] = {}

    def send_kv(self, room: Hashable, /) -> None:
        """Enqueue the room's first chunk (SGLang's ``send`` → transfer queue)."""
        self.submit(room, 0)

    def submit(self, room: Hashable, chunk: int) -> None:
        n = self.chunk_pages
        src, dst = self.src[room][chunk * n : (chunk + 1) * n], self.dst[room][chunk * n : (chunk + 1) * n]
        self.writer.submit(room, chunk, src, dst, self.delay(room, chunk))

    def chunks(self, room: Hashable) -> int:
        return len(self.dst.get(room, ())) // self.chunk_pages

    def release_kv_cache(self, room: Hashable, /) -> None:
        self.src.pop(room, None)
        self.dst.pop(room, None)
        self.pool.release(("src_pages", room))

    def observe(self, room: Hashable) -> set[str]:
        """``src_pages`` while the pool really has the room as a holder of its pages (what a replay checks)."""
        return {"src_pages"} if self.pool.held_by(("src_pages", room)) else set()
