"""Decode's driver for the PD abort protocol: a room's pages, preallocated from its pool and freed on release."""

from __future__ import annotations

from collections.abc import Hashable

from ..block_pool import BlockPool


class DecodeDriver:
    """Decode's actions: ``kv_pages`` are pages of its pool, preallocated by ``send_metadata`` and freed on release.

    The Tracker runs a transition's ``do`` before its acquires, so on
    ``bootstrapped`` :meth:`send_metadata` preallocates the pages (held by
    ``("prealloc", room)``), whose indices the ``metadata`` message carries
    (SGLang's prealloc queue: allocate, then ``receiver.init``), and
    :meth:`alloc_kv_pages` makes them the room's (held by ``("kv_pages", room)``).
    """

    def __init__(self, pool: BlockPool, pages_per_room: int) -> None:
        self.pool = pool
        self.pages_per_room = pages_per_room
        self._pages: dict[Hashable, list[int]] = {}

    def send_metadata(self, room: Hashable, /) -> None:
        """Preallocate the room's pages: their indices are what ``metadata`` sends."""
        self._pages[room] = self.pool.allocate(("prealloc", room), self.pages_per_room)

    def alloc_kv_pages(self, room: Hashable, /) -> None:
        self.pool.pin(("kv_pages", room), self._pages[room])
        self.pool.release(("prealloc", room))

    def release_kv_cache(self, room: Hashable, /) -> None:
        """Free the room's pages: the next room may take them at once."""
        self._pages.pop(room, None)
        self.pool.release(("kv_pages", room))

    def pages(self, room: Hashable) -> list[int]:
        """The pages the room holds now, in order (a copy; empty once freed)."""
        return list(self._pages.get(room, ()))

    def observe(self, room: Hashable) -> set[str]:
        """``kv_pages`` while the pool really has the room as a holder of its pages (what a replay checks)."""
        return {"kv_pages"} if self.pool.held_by(("kv_pages", room)) else set()
