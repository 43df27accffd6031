"""The P/D job's prefill process: computes each room's KV and writes it, chunk by chunk, into the pages decode named.

Its transfer worker skips the remaining chunks of a room that is no longer
``transferring`` (the spec says so: only ``transferring`` accepts
``transfer_done``); a room whose last write in flight has landed while
``draining`` takes ``drained``. ABORT for a room this process does not run
(finished, or begun by an earlier incarnation that was killed) is answered
with the system's ``reply_if_finished`` message, as SGLang's bootstrap thread
does.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Hashable
from ctypes import c_byte
from multiprocessing.queues import Queue
from typing import TYPE_CHECKING, Any

from ...drivers.block_pool import BlockPool, NoFreeBlocks
from ...drivers.pd import Pages, PageWriter, PrefillDriver, embedded_writer
from ...wire import AbortAck, Failed, Hello, Message, Metadata, Request, Succeeded, tag
from . import role
from .config import JobConfig
from .faults import plan
from .role import Role

if TYPE_CHECKING:
    from ...drivers.mooncake.agent import MooncakeAgent

DECODE, PREFILL = "decode", "prefill"


class Prefill(Role):
    name, peer_name = PREFILL, DECODE
    actions = ("send_kv",)

    def __init__(self, config: JobConfig, incarnation: int) -> None:
        self.pool = BlockPool(config.prefill_pages)
        self.pages = Pages(config.prefill_pages, config.page_elems)
        self.agent = _real_agent() if config.backend == "real" else None
        self.transport: PageWriter = (
            PageWriter(self.agent, self.pages)
            if self.agent is not None
            else embedded_writer(self.pages, config.shared_path, config.decode_pages)
        )
        self.driver = PrefillDriver(self.pool, self.transport, config.chunk_pages)
        self.driver.delay = self._write_time
        params = {"bootstrap_timeout": config.prefill_bootstrap_timeout, "transfer_timeout": config.transfer_timeout}
        seed = config.seed * 7 + 2 + 100 * incarnation
        super().__init__(config, self.driver, params, config.prefill_port, config.decode_port, seed)
        self.incarnation = incarnation
        self.slow = plan(config.fault_rate, ("slow_write",), seed)
        self.forward: list[tuple[float, int]] = []
        self.reply_if_finished = self.system.messages["abort_req"].reply_if_finished

    def _write_time(self, room: Hashable, chunk: int) -> float:
        """How long a chunk's write takes: the job's chunk time, or a slow write's where the plan says so."""
        if self.slow.fault(f"write/{room}/{chunk}") == "slow_write":
            self.injected["slow_write"] += 1
            return self.rng.uniform(*self.config.slow_write_time)
        return self.rng.uniform(*self.config.chunk_time)

    def close(self) -> None:
        super().close()
        if self.agent is not None:
            self.agent.close()

    def check(self, message: Message) -> str | None:
        reason = super().check(message)
        if (
            reason is None
            and isinstance(message, Metadata)
            and (len(message.pages) != self.config.pages_per_room or max(message.pages) >= self.config.decode_pages)
        ):
            return "unknown_id"  # not pages of decode's pool, or not a room's worth
        return reason

    def compose(self, name: str, room: Hashable) -> Message | None:
        assert isinstance(room, int)
        kinds: dict[str, type[Succeeded | Failed | AbortAck]] = {
            "success": Succeeded,
            "failure": Failed,
            "abort_ack": AbortAck,
        }
        if name not in kinds:
            raise ValueError(f"prefill's spec sends {name!r}, which this driver cannot compose")
        return kinds[name](peer=PREFILL, room=room)

    def run(self, stop: c_byte) -> dict[str, Any]:
        """Serve until ``stop.value`` is set, then drain; ``stop`` is a raw shared byte (see :func:`serve`)."""
        drain_until: float | None = None
        while True:
            now = time.monotonic()
            for message in self.listener.take(limit=4096):
                self._on_message(message, now)
            self._forward(now)
            for room, chunk, ok in self.transport.landed():
                self._landed(room, chunk, ok)
            self.tracker.poll()
            self.flush(now)
            self.tracker.finished()
            if stop.value:
                if drain_until is None:
                    drain_until = now + self.config.prefill_bootstrap_timeout + self.config.transfer_timeout
                if (self.tracker.live() == 0 and not self.transport.in_flight()) or now > drain_until:
                    break
            time.sleep(0.0003)
        hung = self.tracker.live()
        self.tracker.close()
        self.flush(time.monotonic())
        self.tracker.finished()
        leaked = sum(len(b) for b in self.pool.holdings().values())
        self.transport.close()
        return {"role": PREFILL, "incarnation": self.incarnation, "hung": hung, "leaked_blocks": leaked, **self.stats()}

    def _on_message(self, message: Message, now: float) -> None:
        if isinstance(message, Hello):
            if not self.transport.attached:
                self.transport.attach(message.session, message.base, message.page_bytes, message.pages)
            return
        room = getattr(message, "room", None)
        if room is None:
            return
        if isinstance(message, Request):
            if self.tracker.state(room) is None:
                self.tracker.begin(room)
            return
        event = tag(message)
        if isinstance(message, Metadata) and self.tracker.accepts(room, "metadata"):
            try:
                src = self.pool.allocate(("src_pages", room), len(message.pages))
            except NoFreeBlocks:
                self.counts["no_pages"] += 1
                return
            self.driver.src[room], self.driver.dst[room] = src, list(message.pages)
            heapq.heappush(self.forward, (now + self.rng.uniform(*self.config.forward_time), room))
        if event == "abort_req" and not self.live(room) and self.reply_if_finished:
            self.sends.pending.append((room, self.reply_if_finished))
            return
        self.deliver(room, event)

    def _forward(self, now: float) -> None:
        """Rooms whose forward pass is done: their KV is in their pages, and the transfer starts."""
        while self.forward and self.forward[0][0] <= now:
            _, room = heapq.heappop(self.forward)
            if not self.tracker.accepts(room, "forward_done"):
                continue
            if not self.transport.attached:
                heapq.heappush(self.forward, (now + 0.005, room))  # no hello from decode yet
                continue
            self.pages.fill(room, self.driver.src[room])
            self.fire(room, "forward_done")

    def _landed(self, room: Hashable, chunk: int, ok: bool) -> None:
        """A chunk's write has landed: start the next, conclude the room, or let a draining room go."""
        if not ok:
            self.counts["transfer_errors"] += 1
            if self.tracker.accepts(room, "transfer_failed"):
                self.fire(room, "transfer_failed")
            elif self.tracker.accepts(room, "drained"):
                self.fire(room, "drained")
            return
        if self.tracker.accepts(room, "transfer_done"):
            if chunk + 1 < self.driver.chunks(room):
                self.driver.submit(room, chunk + 1)
            else:
                self.fire(room, "transfer_done")
        elif self.tracker.accepts(room, "drained"):
            self.fire(room, "drained")


def _real_agent() -> MooncakeAgent:
    from ...drivers.mooncake.agent import MooncakeAgent  # imports mooncake and zmq

    return MooncakeAgent()


def serve(config: JobConfig, incarnation: int, report: Queue[Any], stop: c_byte) -> None:
    """The prefill process's entry point: serve until ``stop``, drain, then report (or the error that stopped it).

    ``stop`` is a lock-free shared byte, not a ``multiprocessing.Event``: the job SIGKILLs a prefill mid-run, and
    one killed while it held an Event's lock (polling ``is_set``) would leave every later ``set`` waiting forever.
    """
    role.serve(PREFILL, lambda: Prefill(config, incarnation), lambda prefill: prefill.run(stop), config, report)
