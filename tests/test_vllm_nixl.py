"""kvfsm's NixlConnector inside vLLM's real Scheduler: a prefill engine and a decode engine, P→D over NIXL READs.

Each engine is vLLM's own ``Scheduler`` (CPU, prefix caching on) that builds
the SCHEDULER role of ``kvfsm.adapters.vllm_nixl.NixlConnector`` from its
config; the WORKER role is one connector per TP rank, stepped in the order of
vLLM's ``KVConnectorModelRunnerMixin``, and the ranks' outputs are merged by
vLLM's own ``KVOutputAggregator``. The prefill "forward pass" writes each
request's KV bytes into every rank's blocks; the decode side byte-checks
every block it READs. MLA, prefill TP 2, decode TP 1: decode READs rank 0
and notifies rank 1 with ``send_notif`` (seed 004's path). The ranks own
their blocks (``kv_cache: "own"``: there is no model, so no vLLM cache), and
the handshake goes as in an engine: the workers' ``get_handshake_metadata``
to the prefill scheduler's ``set_xfer_handshake_metadata`` (what vLLM's
engine core does), served on the pyzmq side channel the decode worker asks.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed: ./dev.sh setup installs it")

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvfsm.adapters.vllm_nixl import VLLM, NixlConnector, NixlSettings, embedded_fabric, forget_fabric
from kvfsm.drivers.nixl import PeerInfo
from kvfsm.drivers.nixl.side_channel import GET_META, PROTOCOL, Handshake, HandshakeError, SideChannel, fetch
from kvfsm.showcase.sim.real import EngineConfig, kv_cache_config, make_request, model_output, vllm_config

pytestmark = pytest.mark.vllm

CONFIG = EngineConfig(num_gpu_blocks=32, block_size=16)
TOPOLOGY = {"prefill_tp": 2, "decode_tp": 1, "mla": True, "kv_bytes": 256, "kv_cache": "own"}
ABORT_TIMEOUT = 50.0
"""In steps: the ranks' clock is the step count."""
EARLY_WITHIN = 3.0
"""Steps a notification for a request a prefill rank has not begun waits for its hold."""
PROMPT = list(range(1, 3 * 16 + 6))  # 4 blocks, the last one partial
_fabrics = itertools.count()


class Engine:
    """vLLM's Scheduler with kvfsm's NixlConnector, one connector WORKER per TP rank, and a step clock."""

    def __init__(self, fabric: str, role: str, engine_id: str, tp: int, **extra: Any) -> None:
        extra = {"fabric": fabric, **TOPOLOGY, "abort_timeout": ABORT_TIMEOUT, "early_within": EARLY_WITHIN, **extra}
        self.vllm_config = vllm_config(CONFIG, "NixlConnector", extra, role=role, engine_id=engine_id)
        self.vllm_config.cache_config.num_gpu_blocks = CONFIG.num_gpu_blocks
        self.kv_cache_config = kv_cache_config(CONFIG)
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=False,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=CONFIG.block_size,
        )
        assert isinstance(self.scheduler.connector, NixlConnector)
        self.now = 0.0
        self.workers = [self._worker(rank) for rank in range(tp)]
        # What vLLM's engine core does once the workers registered their caches: their handshakes to the scheduler.
        handshakes = {(0, rank): w.get_handshake_metadata() for rank, w in enumerate(self.workers)}
        self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(handshakes)
        self.aggregator = KVOutputAggregator(tp)
        self.params: dict[str, dict[str, Any]] = {}
        """kv_transfer_params of the requests that finished, by request id."""
        self.finish_reasons: dict[str, str] = {}
        self.call = ""
        """The connector call under way, for :meth:`record`."""
        self.fired: set[tuple[str, str, str]] = set()
        """(connector call, rank's machine, event) for every transition a rank's tracker took."""

    def record(self) -> None:
        """Tap every rank's tracker: note which events each connector call fires (docs/nixl.md §3's table)."""
        for w in self.workers:
            for rank in (w.prefill, w.decode):
                if rank is not None:
                    machine = rank.tracker.spec.name
                    rank.tracker.tap(
                        lambda _s, event, _t, m=machine: lambda _key: self.fired.add((self.call, m, event)),
                        lambda _key, m=machine: self.fired.add((self.call, m, "begin")),
                    )

    def _worker(self, rank: int) -> NixlConnector:
        config = copy.deepcopy(self.vllm_config)
        config.kv_transfer_config.kv_connector_extra_config["tp_rank"] = rank
        worker = NixlConnector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        worker.clock = lambda: self.now
        return worker

    def add(self, request_id: str, params: dict[str, Any], max_tokens: int = 1) -> None:
        request = make_request(request_id, PROMPT, max_tokens, CONFIG.block_size)
        request.kv_transfer_params = params
        self.scheduler.add_request(request)

    def step(self) -> None:
        """One scheduler step; every rank's worker calls; the prefill forward pass; one merged model output."""
        self.now += 1
        out = self.scheduler.schedule()
        req_ids = list(out.num_scheduled_tokens)
        for rid in req_ids:  # the forward pass writes the KV of what it computes, on every rank
            blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
            for w in self.workers:
                if w.prefill is not None:
                    lo, _ = w.settings.topology.range(w.prefill.rank, w.settings.topology.prefill_tp)
                    w.prefill.blocks.fill(blocks, rid, lo)
        sampled = [
            [7] if self.scheduler.requests[rid].num_computed_tokens >= self.scheduler.requests[rid].num_tokens else []
            for rid in req_ids
        ]
        outputs: list[ModelRunnerOutput | None] = []
        for w in self.workers:
            w.bind_connector_metadata(out.kv_connector_metadata)
            self.call = "start_load_kv"
            w.start_load_kv(None)
            w.wait_for_save()
            self.call = "get_finished"
            sending, recving = w.get_finished(set(out.finished_req_ids))
            invalid = w.get_block_ids_with_load_errors()
            w.clear_connector_metadata()
            kv = KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid)
            outputs.append(model_output(req_ids, sampled, kv))
        merged = self.aggregator.aggregate(outputs)
        for engine_outputs in self.scheduler.update_from_output(out, merged).values():
            for o in engine_outputs.outputs:
                if o.finish_reason is not None:
                    self.finish_reasons[o.request_id] = str(o.finish_reason)
                if o.finish_reason is not None and o.kv_transfer_params is not None:
                    self.params[o.request_id] = o.kv_transfer_params

    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def connector_holders(self) -> dict[Any, tuple[int, ...]]:
        """Every hold a rank's connector keeps on top of vLLM's own: empty once every request ended."""
        out: dict[Any, tuple[int, ...]] = {}
        for w in self.workers:
            for rank in (w.prefill, w.decode):
                if rank is not None:
                    out.update({h: b for h, b in rank.blocks.pool.holdings().items() if h != VLLM})
        return out


class Pair:
    """A prefill engine (TP 2) and a decode engine (TP 1) on one embedded NIXL fabric."""

    def __init__(self, kind: str = "embedded", **decode_extra: Any) -> None:
        self.fabric = f"{kind}:pd-{next(_fabrics)}"
        self.prefill = Engine(self.fabric, "kv_producer", "prefill-engine", tp=2)
        self.decode = Engine(self.fabric, "kv_consumer", "decode-engine", tp=1, **decode_extra)
        self.idle = (self.prefill.free_blocks(), self.decode.free_blocks())

    def prefill_one(self, rid: str) -> dict[str, Any]:
        """Run a prefill request to its end; the params its request_finished handed back for the decode side."""
        self.prefill.add(rid, {"do_remote_decode": True})
        for _ in range(20):
            self.prefill.step()
            if rid in self.prefill.params:
                return self.prefill.params[rid]
        raise AssertionError(f"prefill of {rid} never finished")

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.decode.step()
            self.prefill.step()

    def until(self, done: Callable[[], bool], steps: int = 400) -> None:
        """Step both engines until ``done()``, a little wall time apart (real agents' transfers and notifications)."""
        for _ in range(steps):
            self.step()
            if done():
                return
            time.sleep(0.002)
        raise AssertionError(f"not done after {steps} steps")

    def close(self) -> None:
        for engine in (self.prefill, self.decode):
            for w in engine.workers:
                w.shutdown()
            engine.scheduler.connector.shutdown()
        forget_fabric(self.fabric)


@pytest.fixture(params=["embedded", pytest.param("nixl", marks=pytest.mark.nixl)])
def pair(request: pytest.FixtureRequest) -> Any:
    """Both engines on the embedded fabric, or on real NIXL agents (UCX over DRAM, in this process)."""
    if request.param == "nixl":
        pytest.importorskip("kvfsm.drivers.nixl.agent", reason="NIXL is not installed: pip install 'kvfsm[nixl]'")
    p = Pair(request.param)
    yield p
    p.close()


def test_a_request_goes_from_prefill_to_decode_with_every_block_byte_checked(pair: Pair) -> None:
    params = pair.prefill_one("p-1")
    assert params["remote_request_id"] == "p-1" and params["do_remote_prefill"]
    assert "p-1" in pair.prefill.scheduler.requests, "delay_free: vLLM keeps the blocks until finished_sending"
    pair.decode.add("d-1", dict(params), max_tokens=3)
    decode = pair.decode.workers[0].decode
    assert decode is not None
    pair.until(lambda: bool(decode.outcomes))  # a real READ takes some wall time; the embedded one is done at once
    assert decode.outcomes == {"loaded": 1}
    local = pair.decode.scheduler.kv_cache_manager.get_block_ids("d-1")[0]
    p0 = pair.prefill.workers[0].prefill
    assert p0 is not None
    remote = params["remote_block_ids"]
    assert torch.equal(decode.blocks.tensor[local], p0.blocks.tensor[remote])  # the bytes came over
    assert decode.driver.stats["blocks_verified"] == len(local) == 4
    pair.until(lambda: not pair.prefill.scheduler.requests and not pair.decode.scheduler.requests)
    for w in pair.prefill.workers:  # MLA: rank 0 was read, rank 1 told by send_notif; both let go at once
        assert w.prefill is not None and w.prefill.outcomes == {"read": 1} and not w.prefill.anomalies
    assert decode.driver.outbox.counts == {"sent": 2}
    assert (pair.prefill.free_blocks(), pair.decode.free_blocks()) == pair.idle and not pair.prefill.connector_holders()
    assert not pair.decode.connector_holders()


def notify_before_the_hold(pair: Pair, rid: str, decode_id: str) -> None:
    """Prefill ``rid``, then let the decode engine READ it and notify before the prefill workers hold it.

    vLLM's prefill worker takes notifications in ``get_finished`` apart from the step whose ``start_load_kv``
    carries ``request_finished``'s hold (with async scheduling the worker runs a step the hold missed): here each
    prefill worker's ``get_finished`` runs, as in such a step, once the decode side has read and notified.
    """
    params = pair.prefill_one(rid)  # the hold is queued in the prefill scheduler: no worker has it yet
    pair.decode.add(decode_id, dict(params), max_tokens=1)
    decode = pair.decode.workers[0].decode
    assert decode is not None
    for _ in range(400):
        pair.decode.step()
        if decode.outcomes:
            break
        time.sleep(0.002)
    ranks = [w.prefill for w in pair.prefill.workers if w.prefill is not None]
    deadline = time.monotonic() + 10.0
    while sum(r.stats()["kept_early"] for r in ranks) < 2 and time.monotonic() < deadline:
        for w in pair.prefill.workers:
            assert w.get_finished(set()) == (None, None), "nothing is held yet, nothing can be finished"
        time.sleep(0.002)


def test_a_notification_a_prefill_worker_takes_before_its_hold_frees_the_blocks_at_the_hold(pair: Pair) -> None:
    notify_before_the_hold(pair, "p-1", "d-1")
    ranks = [w.prefill for w in pair.prefill.workers if w.prefill is not None]
    assert [r.stats()["kept_early"] for r in ranks] == [1, 1], "rank 0's READ notification, rank 1's send_notif"
    assert all(r.held_requests() == 0 and not r.outcomes and not r.anomalies for r in ranks)
    assert "p-1" in pair.prefill.scheduler.requests
    pair.step()  # start_load_kv holds, and the kept notifications are applied: get_finished reports it
    assert [r.outcomes for r in ranks] == [{"read": 1}, {"read": 1}] and not any(r.anomalies for r in ranks)
    assert "p-1" not in pair.prefill.scheduler.requests, "freed in the step of the hold, not at abort_timeout"
    pair.until(lambda: not pair.decode.scheduler.requests)
    assert (pair.prefill.free_blocks(), pair.decode.free_blocks()) == pair.idle and not pair.prefill.connector_holders()


def test_an_abort_mid_read_keeps_the_blocks_until_the_read_stops_then_reports_them() -> None:
    """A released READ is not cancelled (docs/nixl.md §6): vLLM gets the aborted load's blocks back only once
    its READ can no longer write them."""
    pair = Pair()  # embedded: its peers can be stopped
    params = pair.prefill_one("p-1")
    p0 = pair.prefill.workers[0].prefill
    assert p0 is not None
    fabric = embedded_fabric(pair.fabric)
    fabric.stop(p0.agent.name)  # the READ from rank 0 stays PROC
    pair.decode.add("d-1", dict(params), max_tokens=3)
    pair.step()
    assert pair.decode.scheduler.requests["d-1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pair.decode.scheduler.finish_requests("d-1", RequestStatus.FINISHED_ABORTED)
    pair.step(2)
    decode = pair.decode.workers[0].decode
    assert decode is not None and decode.tracker.state("d-1") == "aborting" and decode.agent.live_handles() == 1
    assert pair.decode.free_blocks() != pair.idle[1], "freed while its READ may still write them"
    fabric.resume(p0.agent.name)  # the READ lands, into blocks the aborted load still holds, and notifies rank 0
    pair.step(2)
    assert decode.outcomes == {"aborted": 1} and decode.agent.live_handles() == 0
    assert pair.decode.free_blocks() == pair.idle[1], "finished_recving for the aborted request freed its blocks"
    outcomes = [w.prefill.outcomes for w in pair.prefill.workers if w.prefill is not None]
    assert outcomes == [{"read": 1}, {"read": 1}]
    assert "p-1" not in pair.prefill.scheduler.requests and pair.prefill.free_blocks() == pair.idle[0]
    assert not pair.prefill.connector_holders() and not pair.decode.connector_holders()
    pair.close()


def test_the_seed_shaped_reader_is_caught_where_it_sends_and_where_the_id_is_dropped() -> None:
    pair = Pair(reader="kvfsm.showcase.nixl_seed:LocalIdReader")
    try:
        params = pair.prefill_one("p-1")
        pair.decode.add("d-1", dict(params), max_tokens=1)
        pair.step(5)
        decode = pair.decode.workers[0].decode
        assert decode is not None and decode.outcomes == {"loaded": 1}  # the READ itself was right
        [found] = decode.driver.outbox.misaddressed()
        assert str(found) == (
            "sent read to nixl_prefill with 'd-1', the key (space request_id); "
            "the spec says it carries remote_request_id, linked to 'p-1'"
        )
        ranks = [w.prefill for w in pair.prefill.workers if w.prefill is not None]
        assert [r.outcomes for r in ranks] == [{"read": 1}, {}] and ranks[1].stats()["kept_early"] == 1
        pair.until(lambda: bool(ranks[1].anomalies), steps=int(EARLY_WITHIN) + 2)  # the id never begins there
        assert ranks[1].anomalies == {"early:request_id": 1} and list(ranks[1].anomaly_ids) == ["d-1"]
        assert "p-1" in pair.prefill.scheduler.requests, "the skipped rank holds the blocks until abort_timeout"
        pair.prefill.now = pair.decode.now = ABORT_TIMEOUT + 10
        pair.step()
        assert ranks[1].outcomes == {"expired": 1} and "p-1" not in pair.prefill.scheduler.requests
    finally:
        pair.close()


def test_a_prefill_engine_that_is_gone_fails_the_loads_after_one_bounded_handshake() -> None:
    pair = Pair(handshake_timeout=1.0)
    try:
        params = pair.prefill_one("p-1")
        channel = pair.prefill.scheduler.connector.side_channel
        assert channel is not None and (params["remote_host"], params["remote_port"]) == (channel.host, channel.port)
        channel.close()  # nobody answers on the side channel any more
        pair.decode.add("d-1", dict(params), max_tokens=2)
        pair.decode.add("d-2", dict(params), max_tokens=2)
        t0 = time.monotonic()
        pair.step()
        waited = time.monotonic() - t0
        assert 1.0 <= waited < 2.0, "one handshake timed out; the second load did not wait again"
        worker = pair.decode.workers[0]
        assert worker.handshakes == {"failed": 1, "skipped": 1}
        pair.until(lambda: len(pair.decode.finish_reasons) == 2, steps=20)
        # Both loads reported every block invalid; kv_load_failure_policy 'recompute' (EngineConfig's) ran them here.
        assert pair.decode.finish_reasons == {"d-1": "length", "d-2": "length"}
        assert worker.decode is not None and worker.decode.outcomes == {"failed": 2}
        assert pair.decode.free_blocks() == pair.idle[1] and not pair.decode.connector_holders()
    finally:
        pair.close()


def test_a_request_prefilled_by_an_earlier_start_of_the_prefill_engine_is_not_read_from_the_new_one() -> None:
    pair = Pair()
    try:
        params = pair.prefill_one("p-1")
        pair.decode.add("d-1", {**params, "remote_incarnation": "a-start-long-gone"}, max_tokens=2)
        pair.until(lambda: "d-1" in pair.decode.finish_reasons, steps=20)
        worker = pair.decode.workers[0]
        assert worker.handshakes == {"failed": 1} and pair.decode.finish_reasons == {"d-1": "length"}  # recomputed
        assert worker.decode is not None and worker.decode.driver.stats["reads"] == 0
    finally:
        pair.close()


def test_the_side_channel_refuses_what_is_not_a_handshake_request_and_keeps_serving() -> None:
    import zmq

    peer = PeerInfo("p", 0, "p/prefill-0", b"agent-metadata", 4096, 256)
    with SideChannel(Handshake("p", "start-1", (peer,))) as channel:
        context = zmq.Context()
        try:
            for frames in ([b"kvfsm-nixl/9", GET_META], [PROTOCOL], [PROTOCOL, b"GET_ALL"]):
                sock = context.socket(zmq.REQ)
                sock.setsockopt(zmq.RCVTIMEO, 5000)
                sock.connect(channel.endpoint)
                sock.send_multipart(frames)
                assert sock.recv_multipart()[0] == b"error"
                sock.close(linger=0)
        finally:
            context.term()
        answer = fetch(channel.host, channel.port, timeout=5.0)
        assert answer == Handshake("p", "start-1", (peer,)) and answer.ranks("p", 1) == [peer]
        assert channel.stats.served == 1 and channel.stats.refused == {"protocol": 1, "frames": 1, "request": 1}
        with pytest.raises(ValueError, match="announced ranks \\[0\\]; this side expects prefill TP 2"):
            answer.ranks("p", 2)
    with pytest.raises(HandshakeError, match=r"did not answer within 0\.2 s"):
        fetch(channel.host, channel.port, timeout=0.2)


def test_settings_refuse_what_the_connector_does_not_read() -> None:
    with pytest.raises(ValueError, match=r"'fabric': 'nixl' \(real NIXL agents\) or 'embedded:<name>'"):
        NixlSettings.parse({"prefill_tp": 2})
    with pytest.raises(ValueError, match=r"\['kv_lease_duration'\], which NixlConnector does not read"):
        NixlSettings.parse({"fabric": "embedded:x", "kv_lease_duration": 30})
    with pytest.raises(ValueError, match="'kv_cache' is 'vllm'"):
        NixlSettings.parse({"fabric": "nixl", "kv_cache": "mine"})
    with pytest.raises(ValueError, match="unknown faults"):
        NixlSettings.parse({"fabric": "nixl", "inject": {"rate": 1.0, "faults": ["lost"]}})
    with pytest.raises(ValueError, match="is not a BlockReader subclass"):
        NixlSettings.parse({"fabric": "embedded:x", "reader": "kvfsm.drivers.nixl:Topology"})


def test_each_connector_call_fires_on_each_rank_what_the_table_in_docs_nixl_says() -> None:
    pair = Pair()
    for engine in (pair.prefill, pair.decode):
        engine.record()
    params = pair.prefill_one("p-1")  # P→D, loaded and read
    pair.decode.add("d-1", dict(params), max_tokens=2)
    pair.step(4)
    params = pair.prefill_one("p-2")  # an abort mid-read, then the expiry of the rank never told
    p0 = pair.prefill.workers[0].prefill
    assert p0 is not None
    embedded_fabric(pair.fabric).stop(p0.agent.name)
    pair.decode.add("d-2", dict(params), max_tokens=2)
    pair.step()
    pair.decode.scheduler.finish_requests("d-2", RequestStatus.FINISHED_ABORTED)
    pair.step(2)
    pair.prefill.now = pair.decode.now = ABORT_TIMEOUT + 20
    pair.step()
    embedded_fabric(pair.fabric).resume(p0.agent.name)
    notify_before_the_hold(pair, "p-3", "d-3")
    pair.step()
    assert pair.prefill.fired | pair.decode.fired == {
        ("start_load_kv", "nixl_prefill", "begin"),  # the hold request_finished queued
        ("start_load_kv", "nixl_prefill", "read"),  # notifications that came before the hold, applied at it
        ("get_finished", "nixl_prefill", "read"),  # the step's notifications, by the prefill's own id
        ("get_finished", "nixl_prefill", "expire"),  # the poll
        ("start_load_kv", "nixl_decode", "begin"),
        ("start_load_kv", "nixl_decode", "read"),
        ("start_load_kv", "nixl_decode", "abort"),  # finished_req_ids of a request still reading
        ("get_finished", "nixl_decode", "reads_stopped"),  # the engine, once a request's last READ ended
    }
    pair.close()


def test_the_connector_asks_the_decode_tracker_whether_a_finished_request_still_loads() -> None:
    """vLLM's finish aborts a load the tracker still accepts ``abort`` for; the driver's table of transfer handles is
    the driver's business, not a second record of which loads are live."""
    import ast
    import inspect

    import kvfsm.adapters.vllm_nixl

    source = ast.parse(inspect.getsource(kvfsm.adapters.vllm_nixl))
    handle_tables = [n.lineno for n in ast.walk(source) if isinstance(n, ast.Attribute) and n.attr == "reading"]
    assert handle_tables == []
