"""How prefill's pages reach decode's: WRITEs of the data plane (:mod:`kvfsm.drivers.dataplane`), chunk by chunk.

Decode registers its pages with an agent and names it in its ``hello``
(session, base); prefill ``attach``es to it. For each chunk, prefill
``submit``s its source pages and the destination pages; the
:class:`PageWriter` posts the WRITE once the chunk's delay has passed (how
long the write takes on a busy fabric) and later reports from
:meth:`PageWriter.landed` that it has landed, or failed. As on a real
fabric, a write lands wherever the destination indices point, whoever holds
those pages by then.

Two backends, one writer:

- ``real``: Mooncake's TransferEngine on both sides
  (:class:`~kvfsm.drivers.mooncake.agent.MooncakeAgent`), across processes;
- ``embedded``: decode's pages are a file both processes map
  (:class:`~.pages.Pages`); prefill maps it and writes into it through the
  in-process fabric (:class:`~kvfsm.drivers.fabric.Fabric`), one agent for
  its own pages and one that stands for decode's, mapped here.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Hashable, Sequence

from ..dataplane import DataPlane, TransferError
from ..fabric import Fabric
from .pages import Pages

Landed = tuple[Hashable, int, bool]
"""``(room, chunk, ok)``: a chunk's write completed (ok), or failed."""

EMBEDDED = "embedded"
"""The session an embedded decode names in its hello: its pages are the job's shared file."""


class PageWriter:
    """Prefill's transfer worker: chunks posted as WRITEs once due, their states polled until they end."""

    def __init__(
        self, agent: DataPlane, src: Pages, reach: Callable[[str, int, int], tuple[str, int]] | None = None
    ) -> None:
        """``reach(session, base, pages)``: the agent and base address a hello's pages are written at (default:
        the session's agent, at the base it says)."""
        self.agent = agent
        self.src = src
        agent.register(src.tensor)
        self._reach = reach
        self._peer: tuple[str, int] | None = None
        self._due: list[tuple[float, int, Hashable, int, tuple[int, ...], tuple[int, ...]]] = []
        self._seq = itertools.count()
        self._flying: dict[object, tuple[Hashable, int]] = {}

    def attach(self, session: str, base: int, page_bytes: int, pages: int) -> None:
        if page_bytes != self.src.page_bytes:
            raise ValueError(f"decode's pages are {page_bytes} B, this side's {self.src.page_bytes} B")
        self._peer = self._reach(session, base, pages) if self._reach is not None else (session, base)

    @property
    def attached(self) -> bool:
        return self._peer is not None

    def submit(self, room: Hashable, chunk: int, src: Sequence[int], dst: Sequence[int], delay: float) -> None:
        heapq.heappush(self._due, (time.monotonic() + delay, next(self._seq), room, chunk, tuple(src), tuple(dst)))

    def landed(self) -> list[Landed]:
        """Post the chunks now due, then report every posted one that ended."""
        out: list[Landed] = []
        now = time.monotonic()
        while self._due and self._due[0][0] <= now:
            _, _, room, chunk, src, dst = heapq.heappop(self._due)
            try:
                handle = self._post(src, dst)
            except TransferError:
                out.append((room, chunk, False))
                continue
            self._flying[handle] = (room, chunk)
        for handle, (room, chunk) in list(self._flying.items()):
            state = self.agent.state(handle)
            if state == "PROC":
                continue
            del self._flying[handle]
            self.agent.release(handle)
            out.append((room, chunk, state == "DONE"))
        return out

    def in_flight(self) -> int:
        return len(self._due) + len(self._flying)

    def close(self) -> None:
        """Forget what is still due; writes in flight are left to land (they cannot be recalled)."""
        self._due.clear()

    def _post(self, src: tuple[int, ...], dst: tuple[int, ...]) -> object:
        assert self._peer is not None
        peer, base = self._peer
        size = self.src.page_bytes
        local = [(self.src.address(p), size) for p in src]
        remote = [(base + p * size, size) for p in dst]
        return self.agent.post("WRITE", peer, local, remote, b"")


def embedded_writer(src: Pages, shared_path: str, dst_pages: int) -> PageWriter:
    """A writer into decode's pages through the job's shared file, on an in-process fabric."""
    fabric = Fabric()
    mapped: list[Pages] = []

    def reach(session: str, base: int, pages: int) -> tuple[str, int]:
        if session != EMBEDDED or pages != dst_pages:
            raise ValueError(f"an embedded decode names session {EMBEDDED!r} and {dst_pages} pages, not {session!r}")
        if not mapped:
            mapped.append(Pages(dst_pages, src.elems, shared_path))
            fabric.agent("decode").register(mapped[0].tensor)
        return "decode", mapped[0].base

    return PageWriter(fabric.agent("prefill"), src, reach)
