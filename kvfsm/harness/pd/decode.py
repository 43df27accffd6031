"""The P/D job's decode process: admits requests, takes pages, and reads every page it decodes from, byte-checked.

Decode is also the job's load generator (the router): on the closed loop
every soak runs (:mod:`kvfsm.harness.load`) it begins ``requests`` rooms, at
most ``concurrency`` at a time, hands each to prefill, and aborts some at
random points. Its pool has exactly the pages ``concurrency`` rooms
hold, so a freed page is taken by the next room at once, as in a busy
server: a write that lands after the free corrupts that room, and the byte
check when decoding starts and ends sees it.

The room's lifecycle is the verified role spec's and ends where it says: in a
success final state (``received``) "the pages pass to the running decode
request". That request is the serving engine's (SGLang's scheduler), not the
connector's, so it is not in the spec; this process plays it. Which message
hands the pages over is not named here: whatever event the tracker takes to
a success final state does (:meth:`Decode._deliver`), and the decode request
pins the pages before the room's release lets them go.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING, Any

from ...drivers.block_pool import BlockPool
from ...drivers.pd import EMBEDDED, DecodeDriver, Pages
from ...wire import AbortReq, Hello, Message, Metadata, Request, tag
from ..load import closed_loop
from . import role
from .config import JobConfig
from .role import Role

if TYPE_CHECKING:
    from ...drivers.mooncake.agent import MooncakeAgent

DECODE, PREFILL = "decode", "prefill"


class Decode(Role):
    name, peer_name = DECODE, PREFILL
    actions = ("send_metadata",)

    def __init__(self, config: JobConfig, report: Queue[Any]) -> None:
        self.pool = BlockPool(config.decode_pages)
        faults_seed = config.seed * 7 + 1
        self.driver = DecodeDriver(self.pool, config.pages_per_room)
        params = {
            "bootstrap_timeout": config.bootstrap_timeout,
            "waiting_timeout": config.waiting_timeout,
            "ack_timeout": config.ack_timeout,
        }
        super().__init__(config, self.driver, params, config.decode_port, config.prefill_port, faults_seed)
        self.report = report
        self.pages = Pages(config.decode_pages, config.page_elems, config.shared_path or None)
        self.agent = _real_agent(self.pages) if config.backend == "real" else None
        """The agent decode's pages are registered with, for the real backend (the embedded one maps the file)."""
        self.hello = Hello(
            peer=DECODE,
            incarnation=1,
            session=self.agent.name if self.agent is not None else EMBEDDED,
            base=self.pages.base if self.agent is not None else 0,
            page_bytes=self.pages.page_bytes,
            pages=self.pages.count,
        )
        self.begun: dict[int, float] = {}
        self.waiting_pages: list[int] = []
        self.aborts: list[tuple[float, int]] = []
        self.decoding: list[tuple[float, int, list[int], str]] = []
        """Running decode requests: when each ends, its room, the pages it holds, the room's success final state."""
        self.corrupted: set[tuple[int, int]] = set()
        self._ended: list[Hashable] = []
        """Rooms reported done since the last step."""
        self._next_hello = 0.0

    def close(self) -> None:
        super().close()
        if self.agent is not None:
            self.agent.close()

    def compose(self, name: str, room: Hashable) -> Message | None:
        assert isinstance(room, int)
        if name == "metadata":
            return Metadata(peer=DECODE, room=room, pages=self.driver.pages(room))
        if name == "abort_req":
            return AbortReq(peer=DECODE, room=room)
        raise ValueError(f"decode's spec sends {name!r}, which this driver cannot compose")

    # -- the loop ----------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        """The job's requests on the closed loop (:func:`~kvfsm.harness.load.closed_loop`), until every one has
        ended or none has for ``config.deadline`` seconds; then this side's ledger."""
        cfg = self.config
        loop = closed_loop(
            cfg.requests, cfg.concurrency, start=self._admit_all, step=self._step, deadline=cfg.deadline,
            stall=cfg.deadline,
        )  # fmt: skip
        hung = len(self.begun)  # rooms not ended by the deadline (decoding ones included)
        self.tracker.close()
        self._finish(time.monotonic())
        self.flush(time.monotonic())
        for _, room, _pages, _final in self.decoding:
            self.pool.release(("decoding", room))
        leaked = sum(len(b) for b in self.pool.holdings().values())
        return {
            "role": DECODE,
            "requests": cfg.requests,
            "issued": loop.opened,
            "hung": hung,
            "leaked_blocks": leaked,
            "corrupted": len(self.corrupted),
            **self.stats(),
        }

    def _admit_all(self, rooms: range) -> list[Hashable]:
        now = time.monotonic()
        for room in rooms:
            self._admit(room, now)
        return list(rooms)

    def _step(self) -> list[Hashable]:
        """Say hello now and then, give rooms their pages, take prefill's messages, abort, end decode requests and
        send what the transitions sent; the rooms that ended."""
        now = time.monotonic()
        if now >= self._next_hello:
            self.link.send_reliably(self.hello)
            self._next_hello = now + 0.2
        self._bootstrap()
        for message in self.listener.take(limit=4096):
            self._on_message(message, now)
        self._due_aborts(now)
        self._end_decoding(now)
        self.tracker.poll()
        self.flush(now)
        self._finish(now)
        ended, self._ended = self._ended, []
        return ended

    def _admit(self, room: int, now: float) -> None:
        self.link.send_reliably(Request(peer=DECODE, room=room))
        self.tracker.begin(room)
        self.begun[room] = now
        self.waiting_pages.append(room)
        if self.config.fault_rate and self.rng.random() < self.config.fault_rate:
            self.injected["abort"] += 1
            heapq.heappush(self.aborts, (now + self.rng.uniform(0, self.config.abort_within), room))

    def _bootstrap(self) -> None:
        """Rooms take their pages in admission order while the pool has them (SGLang's prealloc queue)."""
        keep: list[int] = []
        for room in self.waiting_pages:
            if not self.tracker.accepts(room, "bootstrapped"):
                continue  # aborted or expired before it got pages
            if self.pool.num_free >= self.config.pages_per_room:
                self.fire(room, "bootstrapped")
            else:
                keep.append(room)
        self.waiting_pages = keep

    def _on_message(self, message: Message, now: float) -> None:
        event = tag(message)
        room = getattr(message, "room", None)
        if room is None:
            return  # hello / heartbeat from prefill: liveness only
        self._deliver(room, event, now)

    def _deliver(self, room: int, event: str, now: float) -> None:
        """Deliver ``event``; if the tracker takes the room to a success final state, its decode request starts.

        The decode request pins the room's pages before the transition
        releases ``kv_pages`` (a freed page is the next room's at once); if
        the room ends any other way, it lets them go again.
        """
        pages = self.driver.pages(room) if self.tracker.accepts(room, event) else []
        if pages:
            self.pool.pin(("decoding", room), pages)
        self.deliver(room, event)
        if not pages:
            return
        final = self.tracker.state(room)
        if final is not None and self._succeeded(final):
            self._check(room, pages)
            heapq.heappush(self.decoding, (now + self.rng.uniform(*self.config.decode_time), room, pages, final))
        else:
            self.pool.release(("decoding", room))

    def _succeeded(self, state: str) -> bool:
        """Whether ``state`` is one of the spec's success final states: the room's pages went to its decode request."""
        return self.spec.states[state].final == "success"

    def _check(self, room: int, pages: list[int]) -> None:
        for page in self.pages.wrong(room, pages):
            self.corrupted.add((room, page))

    def _due_aborts(self, now: float) -> None:
        while self.aborts and self.aborts[0][0] <= now:
            _, room = heapq.heappop(self.aborts)
            if self.live(room):
                self.fire(room, "abort")

    def _end_decoding(self, now: float) -> None:
        while self.decoding and self.decoding[0][0] <= now:
            _, room, pages, final = heapq.heappop(self.decoding)
            self._check(room, pages)
            self.pool.release(("decoding", room))
            self._done(room, final, now)

    def _finish(self, now: float) -> None:
        """Report the rooms that ended; one that succeeded is reported when its decode request ends."""
        for room, final in self.tracker.finished():
            assert isinstance(room, int)
            if not self._succeeded(final):
                self._done(room, final, now)

    def _done(self, room: int, outcome: str, now: float) -> None:
        began = self.begun.pop(room, now)
        bad = sum(1 for r, _ in self.corrupted if r == room)
        self._ended.append(room)
        self.report.put(("done", room, outcome, now - began, bad))


def _real_agent(pages: Pages) -> MooncakeAgent:
    """An agent with decode's pages registered: what prefill's WRITEs go to over the TransferEngine."""
    from ...drivers.mooncake.agent import MooncakeAgent  # imports mooncake and zmq

    agent = MooncakeAgent()
    try:
        agent.register(pages.tensor)
    except BaseException:
        agent.close()
        raise
    return agent


def serve(config: JobConfig, report: Queue[Any]) -> None:
    """The decode process's entry point: run the job, then report its ledger (or the error that stopped it)."""
    role.serve(DECODE, lambda: Decode(config, report), Decode.run, config, report)
