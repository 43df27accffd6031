"""An in-process PD transport: the drivers of ``specs/pd_abort/`` over real KV tensors, prefill writing into decode's.

One :class:`PDLoopback` stands for a prefill server and a decode server joined
by an RDMA fabric. Each side owns a :class:`~kvfsm.drivers.kv_cache.KVCache`
and a :class:`~kvfsm.drivers.block_pool.BlockPool` of pages. Decode takes pages
for a room and sends their indices (``metadata``); prefill's transfer copies
the room's KV from its own pages into decode's cache at exactly those indices,
with one real tensor copy. As in the real systems, nothing on the write path
asks whether decode still holds the pages: a write into freed pages lands in
whatever request owns them now. That is the race of seed 002, and replaying
the explorer's trace on these drivers shows it in the tensors.

The same drivers serve the merged-fix and the corrected specs: the specs
differ in *when* decode frees, which is the Tracker's business, not the
driver's.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .block_pool import BlockPool, BlockPoolError
from .kv_cache import KVCache, KVLayout, copy_blocks

LAYOUT = KVLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8)
"""A small layout: the tests and the replay care about which pages are written, not how big they are."""


def pattern(room: Hashable) -> float:
    """The value prefill's KV for ``room`` is filled with: distinct per room, exact in float16 (1..1000)."""
    return float(zlib.crc32(repr(room).encode()) % 1000 + 1)


@dataclass(frozen=True)
class Metadata:
    """What decode sends prefill for a room: the page indices to write into, as they were when sent."""

    room: Hashable
    pages: tuple[int, ...]


@dataclass(frozen=True)
class Write:
    """One transfer that landed: prefill's pages copied into decode's ``dst`` pages."""

    room: Hashable
    src: tuple[int, ...]
    dst: tuple[int, ...]
    bytes: int


class PDLoopback:
    """A prefill server and a decode server in one process, and their drivers (:attr:`prefill`, :attr:`decode`).

    ``metadata[room]`` is what decode sent for the room (SGLang's
    ``transfer_infos``, filled by prefill's bootstrap thread); prefill reads it
    only once its tracker has taken the ``metadata`` event. ``writes`` lists
    every transfer that landed, in order.
    """

    def __init__(
        self,
        layout: KVLayout = LAYOUT,
        *,
        decode_pages: int = 8,
        prefill_pages: int = 8,
        pages_per_room: int = 2,
        device: str | torch.device | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.pages_per_room = pages_per_room
        self.decode_cache = KVCache(layout, decode_pages, device)
        self.decode_pool = BlockPool(decode_pages)
        self.prefill_cache = KVCache(layout, prefill_pages, device)
        self.prefill_pool = BlockPool(prefill_pages)
        self.metadata: dict[Hashable, Metadata] = {}
        self.writes: list[Write] = []
        self.decode = DecodeDriver(self)
        self.prefill = PrefillDriver(self)

    def page_values(self, pages: Collection[int]) -> set[float]:
        """The distinct values in decode's ``pages`` (one value per page once a transfer wrote it)."""
        if not pages:
            return set()
        data = self.decode_cache.storage[list(pages)].float().cpu()
        return {float(v) for v in data.flatten().tolist()}

    def check(self) -> None:
        """Raise :class:`BlockPoolError` unless both pools keep their invariants and only the drivers hold pages."""
        for name, pool, holders in (
            ("decode", self.decode_pool, ("prealloc", "kv_pages")),
            ("prefill", self.prefill_pool, ("src_pages",)),
        ):
            pool.check()
            stray = [h for h in pool.holdings() if not (isinstance(h, tuple) and h[0] in holders)]
            if stray:
                raise BlockPoolError(f"{name} pool has holders no driver knows: {stray}")


class DecodeDriver:
    """Decode's side of a room: ``kv_pages`` are pages of decode's pool, freed back to it.

    The Tracker runs a transition's ``do`` before its acquires, so on
    ``bootstrapped`` :meth:`send_metadata` preallocates the pages (held by
    ``("prealloc", room)``) and sends their indices (SGLang's prealloc queue:
    allocate, then ``receiver.init``), and :meth:`alloc_kv_pages` makes them
    the room's (held by ``("kv_pages", room)``), which is what
    :meth:`observe` reads. ``_pages[room]`` keeps their order.
    """

    def __init__(self, loop: PDLoopback) -> None:
        self.loop = loop
        self._pages: dict[Hashable, list[int]] = {}

    def send_metadata(self, room: Hashable, /) -> None:
        pages = self.loop.decode_pool.allocate(("prealloc", room), self.loop.pages_per_room)
        self.loop.metadata[room] = Metadata(room, tuple(pages))

    def alloc_kv_pages(self, room: Hashable, /) -> None:
        pool = self.loop.decode_pool
        pages = list(self.loop.metadata[room].pages)
        pool.pin(("kv_pages", room), pages)
        pool.release(("prealloc", room))
        self._pages[room] = pages

    def release_kv_cache(self, room: Hashable, /) -> None:
        """Free the room's pages back to the pool: the next request may take them at once."""
        self._pages.pop(room, None)
        self.loop.decode_pool.release(("kv_pages", room))

    def pages(self, room: Hashable) -> list[int]:
        """The pages ``room`` holds now (a copy; empty once freed)."""
        return list(self._pages.get(room, ()))

    def observe(self, room: Hashable) -> set[str]:
        """``kv_pages`` while the pool really has the room as a holder of its pages."""
        return {"kv_pages"} if self.loop.decode_pool.held_by(("kv_pages", room)) else set()


class PrefillDriver:
    """Prefill's side of a room: ``src_pages`` are its own KV pages; :meth:`send_kv` writes them into decode's.

    ``src_pages`` has no acquire action in the specs: the request's pages are
    taken by the prefill scheduler when decode's indices are in, so the
    replayer calls :meth:`before_fire` just before that transition.
    """

    def __init__(self, loop: PDLoopback) -> None:
        self.loop = loop
        self._src: dict[Hashable, list[int]] = {}

    def before_fire(self, room: Hashable, event: str, resources: Collection[str]) -> None:
        """Take the room's own pages and fill them with its KV (the forward pass, as a known pattern)."""
        if "src_pages" in resources:
            pages = self.loop.prefill_pool.allocate(("src_pages", room), self.loop.pages_per_room)
            self.loop.prefill_cache.storage[pages] = pattern(room)
            self._src[room] = pages

    def send_kv(self, room: Hashable, /) -> None:
        """The transfer: copy the room's pages into decode's cache at the indices its metadata named."""
        meta = self.loop.metadata.get(room)
        if meta is None:
            raise KeyError(f"room {room!r}: no metadata from decode, so no destination pages to write into")
        src = self._src[room]
        if len(src) != len(meta.pages):
            raise ValueError(f"room {room!r}: {len(src)} source pages but decode sent {len(meta.pages)} indices")
        moved = copy_blocks(self.loop.prefill_cache, src, self.loop.decode_cache, meta.pages)
        self.loop.writes.append(Write(room, tuple(src), meta.pages, moved))

    def release_kv_cache(self, room: Hashable, /) -> None:
        self._src.pop(room, None)
        self.loop.prefill_pool.release(("src_pages", room))

    def observe(self, room: Hashable) -> set[str]:
        return {"src_pages"} if self.loop.prefill_pool.held_by(("src_pages", room)) else set()


DriverFactory = Callable[[], object]


def factories(**options: Any) -> dict[str, DriverFactory]:
    """Zero-argument factories for ``prefill`` and ``decode`` whose drivers share one :class:`PDLoopback`.

    A factory asked for a role it already gave out starts a new loopback, so
    each replay (which asks every role's factory once) gets a fresh pair.
    ``options`` go to :class:`PDLoopback`.
    """
    current: list[PDLoopback] = []
    given: set[str] = set()

    def factory(role: str) -> DriverFactory:
        def make() -> object:
            if not current or role in given:
                current[:] = [PDLoopback(**options)]
                given.clear()
            given.add(role)
            return current[0].prefill if role == "prefill" else current[0].decode

        make.__qualname__ = role
        return make

    return {"prefill": factory("prefill"), "decode": factory("decode")}


_PAIR = factories()
"""The pair ``kvfsm test`` names on the command line (one process per run). In-process code that also uses one
role alone (a model-based test of the decode) should take its own ``factories()``: a role left given here would
pair the next replay's other role with a stale loopback."""
prefill = _PAIR["prefill"]
"""``--driver prefill=kvfsm.drivers.pd_loopback:prefill``; pairs with :data:`decode`."""
decode = _PAIR["decode"]
"""``--driver decode=kvfsm.drivers.pd_loopback:decode``."""
