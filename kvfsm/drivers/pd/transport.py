"""How prefill's pages reach decode's: one interface, an embedded transport and the Mooncake TransferEngine.

Prefill ``submit``s a chunk (source pages, destination pages) and later
learns from :meth:`Transport.landed` that it has landed, or failed. Decode
``expose``s its pages and sends the answer in its ``hello``; prefill
``attach``es to it. As on a real fabric, a write lands wherever the
destination indices point, whoever holds those pages by then.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ..mooncake.agent import mooncake_engine
from .pages import Pages

Landed = tuple[int, int, bool]
"""``(room, chunk, ok)``: a chunk's write completed (ok) or the transport reported it failed."""


class Transport(Protocol):
    """What prefill's transfer worker needs from a fabric."""

    def attach(self, session: str, base: int, page_bytes: int, pages: int) -> None: ...
    @property
    def attached(self) -> bool: ...
    def submit(self, room: int, chunk: int, src: Sequence[int], dst: Sequence[int], delay: float) -> None: ...
    def landed(self) -> list[Landed]: ...
    def in_flight(self) -> int: ...
    def close(self) -> None: ...


class EmbeddedTransport:
    """Writes into decode's pages through the shared file both processes map: a tensor copy per chunk.

    ``delay`` is when the write lands after it was submitted (the time the
    RDMA write takes); the copy happens then, in the loop that calls
    :meth:`landed`, so a slow write lands late exactly as on a fabric.
    """

    def __init__(self, src: Pages, shared_path: str, dst_pages: int) -> None:
        self.src = src
        self._path = shared_path
        self._dst_count = dst_pages
        self.dst: Pages | None = None
        self._due: list[tuple[float, int, int, int, tuple[int, ...], tuple[int, ...]]] = []
        self._seq = itertools.count()

    def attach(self, session: str, base: int, page_bytes: int, pages: int) -> None:
        if page_bytes != self.src.page_bytes or pages != self._dst_count:
            raise ValueError(f"decode's pages ({pages} × {page_bytes} B) do not match this job's layout")
        if self.dst is None:
            self.dst = Pages(self._dst_count, self.src.elems, self._path)

    @property
    def attached(self) -> bool:
        return self.dst is not None

    def submit(self, room: int, chunk: int, src: Sequence[int], dst: Sequence[int], delay: float) -> None:
        heapq.heappush(self._due, (time.monotonic() + delay, next(self._seq), room, chunk, tuple(src), tuple(dst)))

    def landed(self) -> list[Landed]:
        out: list[Landed] = []
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            _, _, room, chunk, src, dst = heapq.heappop(self._due)
            assert self.dst is not None
            self.dst.tensor[list(dst)] = self.src.tensor[list(src)]
            out.append((room, chunk, True))
        return out

    def in_flight(self) -> int:
        return len(self._due)

    def close(self) -> None:
        self._due.clear()


class MooncakeExposure:
    """Decode's side of the real backend: its pages registered with a TransferEngine that peers write into."""

    def __init__(self, pages: Pages) -> None:
        self.engine = mooncake_engine()
        self.pages = pages
        rc = self.engine.register_memory(pages.base, pages.count * pages.page_bytes)
        if rc != 0:
            raise RuntimeError(f"TransferEngine.register_memory of decode's pages returned {rc}")
        self.session = f"127.0.0.1:{self.engine.get_rpc_port()}"


class MooncakeTransport:
    """Prefill's side of the real backend: ``batch_transfer_sync_write`` per chunk, on a small pool of threads.

    A sync write that returns -1 may still land later (Mooncake #4247,
    dependencies_measured.md §7), so a failed chunk is reported only after
    its call returned, and the room's ``transfer_timeout`` must exceed the
    engine's own (``MC_TRANSFER_TIMEOUT``).
    """

    def __init__(self, src: Pages, workers: int = 4) -> None:
        self.src = src
        self.engine = mooncake_engine()
        rc = self.engine.register_memory(src.base, src.count * src.page_bytes)
        if rc != 0:
            raise RuntimeError(f"TransferEngine.register_memory of prefill's pages returned {rc}")
        self._peer: tuple[str, int] | None = None
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvfsm-transfer")
        self._done: queue.SimpleQueue[Landed] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._flying = 0

    def attach(self, session: str, base: int, page_bytes: int, pages: int) -> None:
        if page_bytes != self.src.page_bytes:
            raise ValueError(f"decode's pages are {page_bytes} B, this side's {self.src.page_bytes} B")
        self._peer = (session, base)

    @property
    def attached(self) -> bool:
        return self._peer is not None

    def submit(self, room: int, chunk: int, src: Sequence[int], dst: Sequence[int], delay: float) -> None:
        assert self._peer is not None
        session, base = self._peer
        size = self.src.page_bytes
        srcs = [self.src.address(p) for p in src]
        dsts = [base + p * size for p in dst]
        with self._lock:
            self._flying += 1
        self._pool.submit(self._write, room, chunk, session, srcs, dsts, [size] * len(srcs), delay)

    def _write(
        self, room: int, chunk: int, session: str, srcs: list[int], dsts: list[int], sizes: list[int], delay: float
    ) -> None:
        ok = False
        try:
            if delay > 0:
                time.sleep(delay)
            ok = self.engine.batch_transfer_sync_write(session, srcs, dsts, sizes) == 0
        finally:
            with self._lock:
                self._flying -= 1
            self._done.put((room, chunk, ok))

    def landed(self) -> list[Landed]:
        out: list[Landed] = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def in_flight(self) -> int:
        with self._lock:
            return self._flying

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
