"""kvfsm's PD role specs around SGLang's real Mooncake KV manager, sender, receiver and bootstrap server.

One process plays one SGLang server of a prefill/decode pair: it builds
SGLang's own ``MooncakeKVManager`` over CPU tensors (the KV buffers SGLang
registers with Mooncake, and so the bytes every check reads), a
``MooncakeKVBootstrapServer`` on prefill, and one ``MooncakeKVSender`` or
``MooncakeKVReceiver`` per room. A :class:`~kvfsm.Tracker` over the role spec
of ``specs/pd_abort/`` follows every room, fed from SGLang's own status
changes by a subclass of the manager that overrides only the methods where
they happen:

========================================  =======================================
SGLang, prefill                           event
========================================  =======================================
``update_status(room, WaitingForInput)``  ``metadata`` (the bootstrap thread)
``update_status(room, Success)``          ``transfer_done`` (the transfer worker)
``conclude_transfer`` → Failed            ``transfer_failed``
``_handle_abort_notification`` (ABORT)    ``abort_req`` (the bootstrap thread)
``send_kvcache`` returns                  ``drained``, for a room already Failed
========================================  =======================================

========================================  =======================================
SGLang, decode                            event
========================================  =======================================
``apply_prefill_status`` → Success        ``success``
``apply_prefill_status`` → Failed         ``failure``
``handle_abort_ack_message``              ``abort_ack`` (every rank has acked)
``_handle_node_failure``                  ``failure`` (prefill's heartbeat lost)
========================================  =======================================

What SGLang's schedulers do is played by the command loop (:func:`serve`):
decode takes pages and calls ``send_metadata`` (``bootstrapped``), aborts
(``receiver.abort()``, then ``abort``), and frees a room's pages when its
tracker releases ``kv_pages``; prefill fills a room's pages and calls
``send`` (``forward_done``). The pages are a :class:`~kvfsm.drivers.block_pool.BlockPool`
whose indices are SGLang's page indices, so a freed page is the next room's
at once, as in a busy server.

Two gates make a race deterministic instead of lucky: ``chunk`` holds a
chunk in the transfer worker after it passed SGLang's Failed check and before
its write is issued (a chunk inside ``batch_transfer_sync``: it will land),
and ``abort`` holds an ABORT before the bootstrap thread handles it (a
message still in flight). The controller (:mod:`.sglang_pair`) opens them.

SGLang is imported here only; nothing in kvfsm's core imports this module.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ..drivers.block_pool import BlockPool
from ..engine import Tracker
from ..errors import ActionError, IllegalTransition
from ..replay import JsonlJournal
from .sglang_pair import Layout, RoleConfig, pattern, spec_of

os.environ.setdefault("MC_FORCE_TCP", "1")
os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")

import contextlib

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, ABORT_TAG
from sglang.srt.disaggregation.mooncake.conn import (
    MooncakeKVBootstrapServer,
    MooncakeKVManager,
    MooncakeKVReceiver,
    MooncakeKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
    maybe_init_shared_mooncake_transfer_engine,
)
from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
from sglang.srt.server_args import ServerArgs

PREFILL, DECODE = "prefill", "decode"


# -- SGLang's classes on the CPU -------------------------------------------------


class Buffers:
    """The KV buffers SGLang's manager registers with Mooncake (one tensor per layer and K/V) and an aux buffer."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        shape = (layout.pages * layout.page_tokens, layout.heads, layout.head_dim)
        self.kv = [torch.zeros(shape) for _ in range(2 * layout.layers)]
        self.aux = torch.zeros(layout.pages, 64, dtype=torch.uint8)

    def page_views(self, page: int) -> list[torch.Tensor]:
        t = self.layout.page_tokens
        return [buf[page * t : (page + 1) * t] for buf in self.kv]

    def fill(self, pages: list[int], value: float) -> None:
        for page in pages:
            for view in self.page_views(page):
                view.fill_(value)

    def value(self, page: int) -> float | None:
        """The page's value if every byte of it (all layers, K and V) holds one value; None if mixed."""
        views = self.page_views(page)
        first = float(views[0].reshape(-1)[0])
        return first if all(bool((v == first).all()) for v in views) else None

    def kv_args(self) -> Any:
        layout = self.layout
        a = KVArgs()
        a.engine_rank, a.pp_rank, a.system_dp_rank = 0, 0, 0
        a.kv_data_ptrs = [b.data_ptr() for b in self.kv]
        a.kv_data_lens = [b.nbytes for b in self.kv]
        a.kv_item_lens = [b[0].nbytes * layout.page_tokens for b in self.kv]
        a.kv_layer_ids, a.kv_cache_dtype_str, a.num_draft_entries = [], "float32", 0
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = [self.aux.data_ptr()], [self.aux.nbytes], [64]
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts = [], [], []
        a.is_hybrid_mla_backend, a.state_conv_shard_groups, a.swa_kv_cache_layout = False, [], None
        a.ib_device, a.gpu_id, a.page_size = None, 0, layout.page_tokens
        a.kv_head_num = a.total_kv_head_num = layout.heads
        a.prefill_start_layer, a.prefill_end_layer = 0, layout.layers
        return a


def publish_cpu(role: str, bootstrap_port: int) -> Any:
    """SGLang's runtime context for one CPU rank (what its launcher publishes), and the shared TransferEngine."""
    server_args = ServerArgs(
        model_path="dummy",
        device="cpu",
        disaggregation_mode=role,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
    )
    publish(server_args, role=role, ranks=SpawnRanks(world_rank=0))
    one_rank = SimpleNamespace(rank_in_group=0, world_size=1, is_first_rank=True, is_last_rank=True)
    get_parallel().override_permanently(pp_group=one_rank)
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    return server_args


# -- the rooms' trackers, fed from SGLang ----------------------------------------


class Rooms:
    """The role's Tracker and what the SGLang hooks feed it; SGLang's threads and the command loop share it."""

    def __init__(self, config: RoleConfig, driver: object) -> None:
        self.spec = spec_of(config.protocol, config.role)
        self.journal = JsonlJournal(config.journal, machine=self.spec.name, append=False) if config.journal else None
        self.changed = threading.Condition()
        observers: list[Callable[..., None]] = [self._notify]
        if self.journal is not None:
            observers.insert(0, self.journal)
        params = {k: v for k, v in config.params.items() if k in self.spec.params}
        self.tracker = Tracker(self.spec, driver, params=params, observer=observers)
        if self.journal is not None:
            self.journal.attach(self.tracker)  # the header records the params, for kvfsm replay
        self.refused: list[tuple[int, str, str | None]] = []
        """Events SGLang's code produced that the room's spec does not accept where it is: divergences."""
        self.on_transition: Callable[[int, str], None] | None = None

    def _notify(self, key: Hashable, generation: int, event: str, source: str, target: str, now: float) -> None:
        if self.on_transition is not None:
            assert isinstance(key, int)
            self.on_transition(key, event)
        with self.changed:
            self.changed.notify_all()

    def feed(self, room: int, event: str) -> bool:
        """Fire ``event`` at the room (an ignored event is a legal no-op); one its spec refuses goes to :attr:`refused`."""
        try:
            self.tracker.fire(room, event)
        except ActionError:
            pass  # the spec's on_error path was taken
        except IllegalTransition:
            self.refused.append((room, event, self.tracker.state(room)))
            return False
        return True

    def state(self, room: int) -> str | None:
        return self.tracker.state(room)

    def succeeded(self, room: int) -> bool:
        """Whether the room is in a ``final: success`` state of its spec (decode: the pages arrived)."""
        state = self.tracker.state(room)
        return state is not None and self.spec.states[state].final == "success"

    def abort(self, room: int, party: Any) -> str | None:
        """The scheduler aborts the request: SGLang's ``abort()`` on its sender or receiver (if it has one), then
        the room's ``abort``; returns the room's state."""
        if party is not None:
            party.abort()
        if self.tracker.accepts(room, "abort"):
            self.tracker.fire(room, "abort")
        return self.tracker.state(room)

    def wait(self, room: int, states: set[str], limit: float) -> str | None:
        """Block until the room is in one of ``states`` (``limit`` only bounds a hang); returns its state."""
        end = time.monotonic() + limit
        with self.changed:
            while (state := self.tracker.state(room)) not in states:
                left = end - time.monotonic()
                if left <= 0:
                    return state
                self.changed.wait(min(left, 0.05))
                self.tracker.poll()
        return state


class Gate:
    """Holds threads at one point until opened; counts who reached it, per room."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.reached: dict[int, int] = {}
        self._cond = threading.Condition()

    def close(self) -> None:
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    def passing(self, room: int) -> None:
        with self._cond:
            self.reached[room] = self.reached.get(room, 0) + 1
            self._cond.notify_all()
        self._open.wait()

    def wait_reached(self, room: int, limit: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.reached.get(room, 0) > 0, timeout=limit)


_worker = threading.local()
"""The room whose chunk the current transfer-worker thread is handling."""


class _NotingQueue:
    """A transfer queue that notes the room of the chunk its worker thread took."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue

    def get(self) -> Any:
        chunk = self._queue.get()
        _worker.room = None if chunk is None else chunk.room
        return chunk

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


class TrackedPrefillManager(MooncakeKVManager):
    """SGLang's prefill manager, unchanged except that its status changes feed the rooms' tracker."""

    rooms: Rooms
    chunk_gate: Gate
    abort_gate: Gate

    def update_status(self, bootstrap_room: int, status: Any) -> None:
        super().update_status(bootstrap_room, status)
        if status == KVPoll.WaitingForInput:
            self.rooms.feed(bootstrap_room, "metadata")
        elif status == KVPoll.Success and self.request_status.get(bootstrap_room) == KVPoll.Success:
            self.rooms.feed(bootstrap_room, "transfer_done")

    def conclude_transfer(self, *, bootstrap_room: int, status: Any, **kwargs: Any) -> Any:
        emitted = super().conclude_transfer(bootstrap_room=bootstrap_room, status=status, **kwargs)
        if emitted == KVPoll.Failed and self.rooms.tracker.accepts(bootstrap_room, "transfer_failed"):
            self.rooms.feed(bootstrap_room, "transfer_failed")
        return emitted

    def _handle_abort_notification(self, msg: list[bytes]) -> bool:
        if not msg or msg[0] != ABORT_TAG:
            return bool(super()._handle_abort_notification(msg))
        room = int(msg[1])
        self.abort_gate.passing(room)
        handled = bool(super()._handle_abort_notification(msg))
        if self.rooms.state(room) is not None:
            self.rooms.feed(room, "abort_req")
        return handled

    def transfer_worker(self, queue: Any, *args: Any, **kwargs: Any) -> None:
        super().transfer_worker(_NotingQueue(queue), *args, **kwargs)

    def send_kvcache(self, *args: Any, **kwargs: Any) -> int:
        room = getattr(_worker, "room", None)
        if room is not None:
            self.chunk_gate.passing(room)
        ret = int(super().send_kvcache(*args, **kwargs))
        if room is not None and self.rooms.tracker.accepts(room, "drained"):
            self.rooms.feed(room, "drained")  # the write that was in flight when the room failed has landed
        return ret


class TrackedDecodeManager(MooncakeKVManager):
    """SGLang's decode manager, unchanged except that its status changes feed the rooms' tracker."""

    rooms: Rooms
    deliver: Callable[[int, str], None]

    def apply_prefill_status(self, *, bootstrap_room: int, status: int, **kwargs: Any) -> None:
        super().apply_prefill_status(bootstrap_room=bootstrap_room, status=status, **kwargs)
        now = self.request_status.get(bootstrap_room)
        if status == KVPoll.Success and now == KVPoll.Success:
            self.deliver(bootstrap_room, "success")
        elif status == KVPoll.Failed:
            self.deliver(bootstrap_room, "failure")

    def handle_abort_ack_message(self, msg: list[bytes]) -> bool:
        handled = bool(super().handle_abort_ack_message(msg))
        if msg and msg[0] == ABORT_ACK_TAG:
            room = int(msg[1])
            if not self.enable_deferred_decode_kv_release or self.is_abort_release_safe(room, 1):
                self.deliver(room, "abort_ack")
        return handled

    def _handle_node_failure(self, failed_bootstrap_addr: str) -> None:
        rooms = set(self.addr_to_rooms_tracker.get(failed_bootstrap_addr, ()))
        super()._handle_node_failure(failed_bootstrap_addr)
        for room in rooms:
            if self.request_status.get(room) == KVPoll.Failed:
                self.deliver(room, "failure")


# -- the two servers ---------------------------------------------------------------


def release_room(pool: BlockPool, pages: dict[int, list[int]], holder: str, peers: dict[int, Any], room: int) -> None:
    """What a scheduler does as a room ends: its pages go back to the pool, its SGLang sender or receiver is cleared."""
    if pages.pop(room, None) is not None:
        pool.release((holder, room))
    peer = peers.pop(room, None)
    if peer is not None:
        peer.clear()


class PrefillDriver:
    """Prefill's actions: ``send_kv`` is SGLang's ``sender.init`` + ``send``; the release frees the room's pages."""

    def __init__(self, server: PrefillServer) -> None:
        self.server = server

    def send_kv(self, room: Hashable, /) -> None:
        assert isinstance(room, int)
        sender = self.server.senders[room]
        pages = self.server.src[room]
        sender.init(len(pages), pages[0])
        sender.send(np.array(pages, dtype=np.int32))

    def release_kv_cache(self, room: Hashable, /) -> None:
        """The prefill scheduler's cleanup: the room's own pages go back to the pool, the sender is cleared."""
        assert isinstance(room, int)
        release_room(self.server.pool, self.server.src, "src", self.server.senders, room)


class PrefillServer:
    """One SGLang prefill server: its bootstrap server, manager, senders, pages and rooms."""

    def __init__(self, config: RoleConfig) -> None:
        self.config = config
        server_args = publish_cpu(PREFILL, config.bootstrap_port)
        self.addr = f"127.0.0.1:{config.bootstrap_port}"
        self.bootstrap = MooncakeKVBootstrapServer("127.0.0.1", config.bootstrap_port)
        self.buffers = Buffers(config.layout)
        self.pool = BlockPool(config.layout.pages)
        self.senders: dict[int, Any] = {}
        self.src: dict[int, list[int]] = {}
        self.rooms = Rooms(config, PrefillDriver(self))
        TrackedPrefillManager.rooms = self.rooms
        TrackedPrefillManager.chunk_gate = self.chunk_gate = Gate()
        TrackedPrefillManager.abort_gate = self.abort_gate = Gate()
        self.manager = TrackedPrefillManager(self.buffers.kv_args(), DisaggregationMode.PREFILL, server_args, False)

    def begin(self, room: int) -> str | None:
        self.senders[room] = MooncakeKVSender(self.manager, self.addr, room)
        self.rooms.tracker.begin(room)
        return self.rooms.state(room)

    def forward(self, room: int) -> str | None:
        """The forward pass: the room's KV goes into its own pages, then SGLang's sender sends them."""
        if not self.rooms.tracker.accepts(room, "forward_done"):
            return self.rooms.state(room)
        pages = self.pool.allocate(("src", room), self.config.pages_per_room)
        self.src[room] = pages
        self.buffers.fill(pages, pattern(room))
        with contextlib.suppress(ActionError):
            self.rooms.tracker.fire(room, "forward_done")
        return self.rooms.state(room)

    def abort(self, room: int) -> str | None:
        """The prefill scheduler aborts the request (``sender.abort()``)."""
        return self.rooms.abort(room, self.senders.get(room))

    def gate(self, which: str, closed: bool) -> None:
        gate = self.chunk_gate if which == "chunk" else self.abort_gate
        gate.close() if closed else gate.open()

    def reached(self, which: str, room: int, limit: float) -> bool:
        return (self.chunk_gate if which == "chunk" else self.abort_gate).wait_reached(room, limit)

    def summary(self) -> dict[str, Any]:
        self.rooms.tracker.finished()
        return {
            "live": self.rooms.tracker.live(),
            "refused": list(self.rooms.refused),
            "held_pages": sum(len(b) for b in self.pool.holdings().values()),
        }


class DecodeDriver:
    """Decode's actions: ``send_metadata`` takes the pages and is SGLang's; the release frees them."""

    def __init__(self, server: DecodeServer) -> None:
        self.server = server

    def send_metadata(self, room: Hashable, /) -> None:
        assert isinstance(room, int)
        server = self.server
        pages = server.pool.allocate(("prealloc", room), server.config.pages_per_room)
        server.pages[room] = pages
        server.receivers[room].send_metadata(np.array(pages, dtype=np.int32), pages[0])

    def alloc_kv_pages(self, room: Hashable, /) -> None:
        assert isinstance(room, int)
        pages = self.server.pages[room]
        self.server.pool.pin(("kv_pages", room), pages)
        self.server.pool.release(("prealloc", room))

    def release_kv_cache(self, room: Hashable, /) -> None:
        """The decode scheduler frees the room's pages (the next room may take them at once) and clears its receiver."""
        assert isinstance(room, int)
        release_room(self.server.pool, self.server.pages, "kv_pages", self.server.receivers, room)


class DecodeServer:
    """One SGLang decode server: its manager, receivers, pages, rooms, and the decode requests holding pages."""

    def __init__(self, config: RoleConfig) -> None:
        self.config = config
        server_args = publish_cpu(DECODE, config.bootstrap_port)
        self.buffers = Buffers(config.layout)
        self.pool = BlockPool(config.layout.pages)
        self.receivers: dict[int, Any] = {}
        self.pages: dict[int, list[int]] = {}
        self.decoding: dict[int, list[int]] = {}
        """Rooms whose transfer succeeded: the running decode request holds their pages until ``finish``."""
        self.corrupted: dict[int, list[int]] = {}
        """Room → its pages that did not hold its own KV when its decode request read them."""
        self.lock = threading.Lock()
        self.rooms = Rooms(config, DecodeDriver(self))
        self.rooms.on_transition = self._on_transition
        TrackedDecodeManager.rooms = self.rooms
        TrackedDecodeManager.deliver = staticmethod(self.deliver)
        self.manager = TrackedDecodeManager(self.buffers.kv_args(), DisaggregationMode.DECODE, server_args, False)

    def connect(self, addr: str, limit: float) -> bool:
        """What decode's scheduler does before a room of a prefill server: resolve its parallel info."""
        end = time.monotonic() + limit
        while not self.manager.try_ensure_parallel_info(addr):
            if time.monotonic() > end:
                return False
            time.sleep(0.1)  # polling a server that is starting; the result, not the time, is what counts
        return True

    def begin(self, room: int, addr: str) -> str | None:
        receiver = MooncakeKVReceiver(self.manager, addr, room)
        receiver.init(0)
        self.receivers[room] = receiver
        self.rooms.tracker.begin(room)
        return self.rooms.state(room)

    def bootstrapped(self, room: int) -> str | None:
        """The prealloc queue: take pages (if the pool has them) and send their indices; None if none are free."""
        if self.pool.num_free < self.config.pages_per_room:
            return None
        with contextlib.suppress(ActionError):
            self.rooms.tracker.fire(room, "bootstrapped")
        return self.rooms.state(room)

    def abort(self, room: int) -> str | None:
        """The decode scheduler aborts the request: SGLang's ``receiver.abort()`` (Failed, ABORT sent), then ``abort``."""
        return self.rooms.abort(room, self.receivers.get(room))

    def deliver(self, room: int, event: str) -> None:
        """A status from prefill: on success the room's decode request takes its pages before the room lets them go."""
        with self.lock:
            accepted = self.rooms.tracker.accepts(room, event)
            pages = list(self.pages.get(room, ())) if accepted and event == "success" else []
            if pages:
                self.pool.pin(("decoding", room), pages)
            self.rooms.feed(room, event)
            if not pages:
                return
            if self.rooms.succeeded(room):
                self.decoding[room] = pages
                self._check(room, pages)
            else:
                self.pool.release(("decoding", room))

    def _on_transition(self, room: int, event: str) -> None:
        if event == "resend":  # decode_corrected: no answer yet, ABORT again
            receiver = self.receivers.get(room)
            if receiver is not None:
                receiver._send_abort_notification()

    def _check(self, room: int, pages: list[int]) -> None:
        bad = [p for p in pages if self.buffers.value(p) != pattern(room)]
        if bad:
            self.corrupted[room] = sorted(set(self.corrupted.get(room, [])) | set(bad))

    def finish(self, room: int) -> list[int]:
        """The room's decode request ends: its pages are read once more, then freed; returns its corrupted pages."""
        with self.lock:
            pages = self.decoding.pop(room, None)
            if pages is not None:
                self._check(room, pages)
                self.pool.release(("decoding", room))
            return self.corrupted.get(room, [])

    def values(self, pages: list[int]) -> list[float | None]:
        return [self.buffers.value(p) for p in pages]

    def summary(self) -> dict[str, Any]:
        self.rooms.tracker.finished()
        return {
            "live": self.rooms.tracker.live(),
            "refused": list(self.rooms.refused),
            "held_pages": sum(len(b) for b in self.pool.holdings().values()),
            "corrupted": {str(k): v for k, v in self.corrupted.items()},
        }


def serve(conn: Connection, config: RoleConfig) -> None:
    """A server process's loop: build the server, then answer ``(method, args)`` commands until ``close``."""
    os.environ.update(config.env)
    deferred = "0" if config.protocol == "merged_fix" else "1"
    os.environ["SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"] = deferred
    try:
        server: PrefillServer | DecodeServer = PrefillServer(config) if config.role == PREFILL else DecodeServer(config)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    rooms = server.rooms
    while True:
        if not conn.poll(0.05):
            rooms.tracker.poll()
            continue
        method, args = conn.recv()
        if method == "close":
            rooms.tracker.close()
            summary = server.summary()
            if rooms.journal is not None:
                rooms.journal.close()
            conn.send(("ok", summary))
            conn.close()
            os._exit(0)  # SGLang's and Mooncake's threads never join
        try:
            if method == "wait":
                room, states, limit = args
                result: Any = rooms.wait(room, set(states), limit)
            elif method == "state":
                result = rooms.state(args[0])
            else:
                result = getattr(server, method)(*args)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))
