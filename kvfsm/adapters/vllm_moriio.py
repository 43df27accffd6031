"""kvfsm's MoRIIO connector (seed 001) as a real ``KVConnectorBase_V1``: WRITE mode over the Mooncake TransferEngine.

Configure the two engines with::

    KVTransferConfig(kv_connector="MoRIIOConnector", kv_connector_module_path="kvfsm.adapters.vllm_moriio",
                     kv_role="kv_producer",                  # the prefill engine; the decode engine: kv_consumer
                     kv_connector_extra_config={"notify_port": 61005})

The shape is vLLM's MoRIIO connector in WRITE mode (push). A router sends a
request to both engines at once, with one ``transfer_id`` both agree on:
the prefill request carries ``kv_transfer_params={"do_remote_decode": True,
"transfer_id": T}``, the decode request ``{"do_remote_prefill": True,
"transfer_id": T, "remote_host": H, "remote_notify_port": P}`` (where the
prefill rank's notify socket is). The decode scheduler answers
``get_num_new_matched_tokens`` with the whole prompt, loaded asynchronously
(``WAITING_FOR_REMOTE_KVS``); its worker tells the prefill rank where the
request's new blocks are (``remote_blocks``). The prefill's
``request_finished`` keeps the computed blocks (``delay_free``); its worker
holds them until ``remote_blocks`` names the transfer, WRITEs them into the
decode engine's blocks with the TransferEngine, and sends ``write_done``; the
decode side reports ``finished_recving`` and vLLM runs the request on the
written KV.

Everything the workers hold is a Tracker instance of
``specs/moriio/write_producer.yaml`` (prefill: ``deferred`` until
``remote_blocks`` with ``defer_timeout``, ``writing`` with
``transfer_timeout``, every end frees the blocks and reports
``finished_sending``) or ``write_consumer.yaml`` (decode: ``waiting``, and
``aborting`` after an abort, under one ``recv_timeout``; every end reports
``finished_recving``; a load that did not end with ``write_done`` reports its
blocks invalid). No wait is without a
deadline: seed 001's hang cannot happen. The drivers are
:class:`~kvfsm.drivers.moriio.PrefillEngine` and
:class:`~kvfsm.drivers.moriio.DecodeEngine`, given vLLM's cache as their
blocks.

**The blocks are vLLM's KV cache.** ``register_kv_caches`` hands each worker
vLLM's per-layer tensors; they are adopted where vLLM placed them
(:meth:`~kvfsm.drivers.kv_cache.KVCache.of_layers` with
``kv_cache_tensors``) and registered with the worker's TransferEngine (tcp,
P2PHANDSHAKE). ``remote_blocks`` carries the decode engine's block layout, so
a write is one TransferEngine write per (layer, block): from where the
prefill's model wrote the KV to where the decode's model reads it.

**Deadlines across engines.** ``remote_blocks`` says when the decode side
stops waiting (``write_by``, wall clock); the prefill refuses to start writes
that could still be in flight then (the request fails, its blocks are
freed), so no write lands in blocks the decode engine has given back
however late the message arrives. An aborted decode request sends the
prefill a ``release`` (as vLLM's MoRIIO does) and keeps its blocks (vLLM
frees an aborted ``WAITING_FOR_REMOTE_KVS`` request's blocks at its
``finished_recving``) until the prefill answers ``released``: at once if it
has not written yet, after draining if its writes had started.

Limits: one worker per engine (tensor parallel size 1), one KV-cache group,
WRITE mode only (the TransferEngine has no asynchronous single read).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..drivers.mooncake.agent import MooncakeAgent, notify_only
from ..drivers.moriio import DecodeEngine, PrefillEngine, Release, moriio_spec
from ..drivers.moriio.plane import PlaneTransport
from ..drivers.nixl.memory import CacheBlocks
from .vllm_async import VLLM
from .vllm_kv_cache import adopt_layers, layout_of
from .vllm_pd import PDConnector, handshakes, held_for_decode, tp_rank
from .vllm_settings import check_keys, seconds

log = logging.getLogger(__name__)

PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
DECODE_KEYS = ("transfer_id", "remote_host", "remote_notify_port")
"""What a decode request's kv_transfer_params must carry besides ``do_remote_prefill``."""


@dataclass(frozen=True)
class MoRIIOSettings:
    """``kv_connector_extra_config``: where the prefill rank's notify socket is, the specs' deadlines, the rank."""

    notify_host: str = "127.0.0.1"
    notify_port: int = 0
    """Prefill: the port of rank 0's notify socket (rank r: ``notify_port + r``); 0 binds a free one, which the
    prefill's ``request_finished`` then returns (a router sending both requests at once needs it fixed)."""
    params: Mapping[str, float] = field(default_factory=dict)
    """The specs' deadlines given: ``defer_timeout``, ``transfer_timeout`` (prefill), ``recv_timeout`` (decode)."""
    tp_rank: int | None = None

    PARAMS: ClassVar[dict[str, tuple[str, str]]] = {
        "defer_timeout": ("write_producer", PRODUCER),
        "transfer_timeout": ("write_producer", PRODUCER),
        "recv_timeout": ("write_consumer", CONSUMER),
    }
    KNOWN: ClassVar[frozenset[str]] = frozenset({"notify_host", "notify_port", "tp_rank", "read_mode", *PARAMS})

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> MoRIIOSettings:
        check_keys(extra, cls.KNOWN, "MoRIIOConnector")
        if extra.get("read_mode"):
            raise ValueError(
                "MoRIIOConnector runs WRITE mode (the prefill pushes into the decode engine's blocks): the Mooncake "
                "TransferEngine has no asynchronous single read. Drop 'read_mode' from kv_connector_extra_config"
            )
        params = seconds(extra, cls.PARAMS)
        for name, value in params.items():
            if not value > 0:
                raise ValueError(f"kv_connector_extra_config '{name}' must be a positive number of seconds")
        port = int(extra.get("notify_port", 0))
        if not 0 <= port < 65536:
            raise ValueError(
                f"kv_connector_extra_config 'notify_port' must be a TCP port (0: any free one), not {port}"
            )
        rank = int(extra["tp_rank"]) if "tp_rank" in extra else None
        return cls(str(extra.get("notify_host", "127.0.0.1")), port, params, rank)

    def for_spec(self, machine: str) -> dict[str, float]:
        """The deadlines of ``machine``: the ones given, the spec's defaults for the rest."""
        defaults = moriio_spec(machine).params
        return {
            name: float(self.params.get(name, defaults[name])) for name, (m, _) in self.PARAMS.items() if m == machine
        }


@dataclass(frozen=True)
class HoldOrder:
    """Prefill: hold a finished request's blocks for ``transfer_id``'s write (vLLM keeps them until finished_sending)."""

    request_id: str
    transfer_id: str
    block_ids: list[int]


@dataclass(frozen=True)
class LoadOrder:
    """Decode: announce ``block_ids`` to the prefill rank at ``peer`` and wait for its write of ``transfer_id``."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    peer: str


@dataclass(frozen=True)
class CancelOrder:
    """Decode: tell the prefill rank at ``peer`` that ``transfer_id`` will never be loaded (free it, do not write)."""

    transfer_id: str
    peer: str


@dataclass
class MoRIIOMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler to worker, once per step."""

    holds: list[HoldOrder] = field(default_factory=list)
    loads: list[LoadOrder] = field(default_factory=list)
    cancels: list[CancelOrder] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    """Requests vLLM finished since the last step: a load still waiting for one was aborted."""


@dataclass
class MoRIIOHandshakeMetadata(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """A prefill worker's notify socket, from ``get_handshake_metadata`` to its scheduler."""

    host: str
    port: int


class MoRIIOConnector(PDConnector[PrefillEngine, DecodeEngine]):
    """P/D with the prefill WRITing into the decode engine's blocks; each worker's Tracker holds, writes and reports."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = MoRIIOSettings.parse(self._kv_transfer_config.kv_connector_extra_config or {})
        if self.kv_role not in (PRODUCER, CONSUMER):
            raise ValueError(
                f"MoRIIOConnector is a prefill (kv_role 'kv_producer') or a decode engine ('kv_consumer'), "
                f"not {self.kv_role!r}"
            )
        # scheduler side
        self._meta = MoRIIOMetadata()
        self._notify: tuple[str, int] | None = None
        """Prefill: the worker's notify socket, as its handshake metadata said."""
        self._sending: set[str] = set()
        """Prefill: requests vLLM keeps for a write (delay_free) and has not yet heard finished_sending of."""
        self.orders: dict[str, int] = {"holds": 0, "loads": 0, "cancels": 0}
        # worker side
        self.agent: MooncakeAgent | None = None
        self.transport: PlaneTransport | None = None
        self.num_blocks = int(kv_cache_config.num_blocks) if role == KVConnectorRole.WORKER else 0

    @property
    def is_producer(self) -> bool:
        return self.kv_role == PRODUCER

    # -- scheduler side -------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, Any]) -> None:
        """vLLM's engine core hands over the workers' :meth:`get_handshake_metadata`: where rank 0's notify socket
        is, which the prefill's ``request_finished`` returns to the router."""
        for rank, meta in handshakes(metadata, MoRIIOHandshakeMetadata):
            if rank == 0:
                self._notify = (meta.host, meta.port)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Decode only: a prefill engine loads nothing."""
        if self.kv_role != CONSUMER:
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Decode: order the announcement of the request's new blocks (once: ``do_remote_prefill`` is cleared)."""
        params = request.kv_transfer_params
        if self.kv_role != CONSUMER or not params or not params.get("do_remote_prefill"):
            return
        transfer_id, peer = _decode_target(request.request_id, params)
        params["do_remote_prefill"] = False
        local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
        if local:
            self._meta.loads.append(LoadOrder(request.request_id, transfer_id, local, peer))
            self.orders["loads"] += 1
        else:  # the whole prompt was here already: nothing to write
            self._cancel(transfer_id, peer)

    def build_connector_meta(self, scheduler_output: Any) -> MoRIIOMetadata:
        meta, self._meta = self._meta, MoRIIOMetadata()
        meta.finished = set(scheduler_output.finished_req_ids)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._sending.difference_update(connector_output.finished_sending or ())

    def has_pending_push_work(self) -> bool:
        """Prefill: a held request's write is not over, so vLLM keeps stepping (and polling the worker)."""
        return bool(self._sending)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Prefill, ``do_remote_decode``, ran to its length: keep the blocks for the write. Decode, finished before
        it was ever scheduled: tell the prefill to free its blocks (vLLM's MoRIIO sends ``release``)."""
        params = request.kv_transfer_params or {}
        if self.kv_role == CONSUMER:
            if params.get("do_remote_prefill"):
                transfer_id, peer = _decode_target(request.request_id, params)
                params["do_remote_prefill"] = False
                self._cancel(transfer_id, peer)
            return False, None
        if not held_for_decode(request):
            return False, None
        transfer_id = _transfer_id(request.request_id, params)
        if not block_ids:
            return False, None
        host, port = self._notify_socket()
        self._meta.holds.append(HoldOrder(request.request_id, transfer_id, list(block_ids)))
        self._sending.add(request.request_id)
        self.orders["holds"] += 1
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": transfer_id,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_notify_port": port,
        }

    def _notify_socket(self) -> tuple[str, int]:
        if self._notify is not None:
            return self._notify
        s = self.settings
        if s.notify_port:
            return s.notify_host, s.notify_port + (s.tp_rank or 0)
        raise RuntimeError(
            f"MoRIIOConnector of engine {self.engine_id!r} does not know its worker's notify socket: vLLM never "
            "called set_xfer_handshake_metadata; set 'notify_port' in kv_connector_extra_config"
        )

    def _cancel(self, transfer_id: str, peer: str) -> None:
        self._meta.cancels.append(CancelOrder(transfer_id, peer))
        self.orders["cancels"] += 1

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Adopt vLLM's per-layer KV cache where vLLM placed it, register it with this worker's TransferEngine, and
        start the rank's engine (prefill or decode) on it."""
        if self.transport is not None:
            raise RuntimeError("register_kv_caches called twice: this worker already registered vLLM's cache")
        config = self._kv_cache_config
        layout, _ = layout_of(config, "MoRIIOConnector")
        memory = CacheBlocks(adopt_layers(kv_caches, config, layout))
        s = self.settings
        rank = tp_rank(s.tp_rank)
        port = s.notify_port + rank if self.is_producer and s.notify_port else 0
        self.agent = agent = MooncakeAgent(s.notify_host, port)
        self.transport = transport = PlaneTransport(agent)
        try:
            if self.is_producer:
                self.prefill = PrefillEngine(
                    transport, self.num_blocks, memory.block_bytes, rank=rank,
                    params=s.for_spec("write_producer"), blocks=memory,
                )  # fmt: skip
                self.prefill.borrow_from(VLLM)
            else:
                self.decode = DecodeEngine(
                    transport, self.num_blocks, memory.block_bytes, "", rank=rank,
                    params=s.for_spec("write_consumer"), blocks=memory, bound_writes=True,
                )  # fmt: skip
                self.decode.borrow_from(VLLM)
        except BaseException:
            agent.close()
            self.transport = self.agent = None
            raise
        log.info(
            "MoRIIOConnector %s (%s): %d blocks of %d B registered with TransferEngine %s, notify socket %s",
            self.engine_id, self.kv_role, self.num_blocks, memory.block_bytes, agent.session,
            agent.mailbox.endpoint,
        )  # fmt: skip

    def get_handshake_metadata(self) -> MoRIIOHandshakeMetadata | None:
        """Prefill workers: where the decode side sends ``remote_blocks`` and ``release``."""
        if self.prefill is None or self.agent is None:
            return None
        host, _, port = self.agent.mailbox.endpoint.removeprefix("tcp://").rpartition(":")
        return MoRIIOHandshakeMetadata(host, int(port))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """This step's holds (prefill); loads, then aborts of loads vLLM finished, then cancels (decode)."""
        meta = self._step_metadata(MoRIIOMetadata)
        if self.transport is None:
            if meta.holds or meta.loads or meta.cancels:
                raise RuntimeError(
                    f"MoRIIOConnector of engine {self.engine_id!r} has no blocks: vLLM has not called register_kv_caches"
                )
            return
        if self.prefill is not None:
            for hold in meta.holds:
                self.prefill.hold(hold.request_id, hold.transfer_id, hold.block_ids)
        decode = self.decode
        if decode is not None:
            for load in meta.loads:
                decode.load(load.request_id, load.transfer_id, load.block_ids, load.peer)
            for rid in sorted(meta.finished):
                if decode.tracker.accepts(rid, "abort"):  # vLLM aborted it while its load is live: the spec says how
                    decode.abort(rid)  # it ends (reported, its blocks invalid, once the prefill stopped writing)
        for cancel in meta.cancels:
            self.transport.notify(cancel.peer, Release(cancel.transfer_id))

    def shutdown(self) -> None:
        """Abort everything still held (every release runs) and close the sockets."""
        self._close_ranks()
        if self.agent is not None:
            self.agent.close()
            self.transport = self.agent = None

    # -- what it did ------------------------------------------------------------------

    def waiting(self) -> int:
        """Decode loads announced and not yet written (WAITING_FOR_REMOTE_KVS on the connector's side)."""
        return self.decode.waiting() if self.decode is not None else 0

    def loads(self) -> int:
        """Decode loads begun so far: live ones and ended ones."""
        d = self.decode
        return 0 if d is None else d.tracker.live() + sum(d.outcomes.values())

    def stats(self) -> dict[str, Any]:
        """The scheduler's orders, or the worker's engine: outcomes, counts, anomalies, held blocks, writes."""
        out: dict[str, Any] = {"engine_id": self.engine_id, "kv_role": self.kv_role, "orders": dict(self.orders)}
        if self._sending:
            out["pending_sends"] = len(self._sending)
        a, t = self.agent, self.transport
        if a is not None and t is not None:
            out["transfer_engine"] = {"session": a.session, "notify": a.mailbox.endpoint, **a.posted}
            out["dropped_messages"] = dict(a.mailbox.dropped + t.dropped)
        if self.prefill is not None:
            out["prefill"] = self.prefill.stats()
        if self.decode is not None:
            out["decode"] = self.decode.stats()
        return out


def _transfer_id(request_id: str, params: Mapping[str, Any]) -> str:
    transfer_id = params.get("transfer_id")
    if not isinstance(transfer_id, str) or not transfer_id:
        raise ValueError(
            f"request {request_id!r}: kv_transfer_params lack a 'transfer_id' (the id the router gives the prefill "
            f"and the decode request alike), got {params!r}"
        )
    return transfer_id


def _decode_target(request_id: str, params: Mapping[str, Any]) -> tuple[str, str]:
    """A decode request's transfer id and the prefill rank it names (its notify socket)."""
    missing = [k for k in DECODE_KEYS if params.get(k) in (None, "")]
    if missing:
        raise ValueError(
            f"request {request_id!r}: kv_transfer_params lack {missing}; a decode request names its transfer and "
            f"the prefill's notify socket ({', '.join(DECODE_KEYS)})"
        )
    return _transfer_id(request_id, params), notify_only(str(params["remote_host"]), int(params["remote_notify_port"]))


__all__ = ["MoRIIOConnector", "MoRIIOSettings"]
