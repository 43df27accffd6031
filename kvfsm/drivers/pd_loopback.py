"""The PD drivers in one process (:mod:`kvfsm.drivers.pd`, the ones the P/D job runs) over real KV tensors, prefill
writing into decode's.

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
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import pd
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


class DecodeDriver(pd.DecodeDriver):
    """Decode's side of a room: the PD driver (:class:`kvfsm.drivers.pd.DecodeDriver`) on decode's pool, whose
    ``metadata`` the loopback records as sent (:attr:`PDLoopback.metadata`)."""

    def __init__(self, loop: PDLoopback) -> None:
        super().__init__(loop.decode_pool, loop.pages_per_room)
        self.loop = loop

    def send_metadata(self, room: Hashable, /) -> None:
        super().send_metadata(room)
        self.loop.metadata[room] = Metadata(room, tuple(self.pages(room)))


class CacheWriter:
    """Prefill's writes in one process: the room's pages copied into decode's cache at once, on any device."""

    def __init__(self, loop: PDLoopback) -> None:
        self.loop = loop

    def submit(self, room: Hashable, chunk: int, src: Sequence[int], dst: Sequence[int], delay: float) -> None:
        moved = copy_blocks(self.loop.prefill_cache, list(src), self.loop.decode_cache, list(dst))
        self.loop.writes.append(Write(room, tuple(src), tuple(dst), moved))


class PrefillDriver(pd.PrefillDriver):
    """Prefill's side of a room: the PD driver (:class:`kvfsm.drivers.pd.PrefillDriver`) on prefill's pool,
    writing the whole room as one chunk into the pages decode's ``metadata`` named.

    ``src_pages`` has no acquire action in the specs: the request's pages are
    taken by the prefill scheduler when decode's indices are in, so the
    replayer calls :meth:`before_fire` just before that transition.
    """

    def __init__(self, loop: PDLoopback) -> None:
        super().__init__(loop.prefill_pool, CacheWriter(loop), chunk_pages=loop.pages_per_room)
        self.loop = loop

    def before_fire(self, room: Hashable, event: str, resources: Collection[str]) -> None:
        """Take the room's own pages and fill them with its KV (the forward pass, as a known pattern)."""
        if "src_pages" in resources:
            pages = self.pool.allocate(("src_pages", room), self.loop.pages_per_room)
            self.loop.prefill_cache.storage[pages] = pattern(room)
            self.src[room] = pages

    def send_kv(self, room: Hashable, /) -> None:
        """The transfer: the room's pages into decode's cache at the indices its metadata named."""
        meta = self.loop.metadata.get(room)
        if meta is None:
            raise KeyError(f"room {room!r}: no metadata from decode, so no destination pages to write into")
        if len(self.src[room]) != len(meta.pages):
            raise ValueError(
                f"room {room!r}: {len(self.src[room])} source pages but decode sent {len(meta.pages)} indices"
            )
        self.dst[room] = list(meta.pages)
        super().send_kv(room)


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
