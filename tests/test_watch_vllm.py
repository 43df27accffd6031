"""kvfsm watch inside vLLM's real ``Scheduler``: seeds 000 and 004 flagged at the spec's deadline, their fixes not.

vLLM builds the ``WatchConnector`` (``kv_connector_module_path="kvfsm.adapters.vllm"``),
which builds the inner connector with vLLM's own factory. The worker half is
modelled here and its outputs handed to ``update_from_output`` as vLLM's
``tests/v1/kv_connector/unit/utils.py`` hands them (a ``ModelRunnerOutput``
carrying a ``KVConnectorOutput`` with ``finished_sending``). One step is one
second of the watch's clock.

- Seed 004 around vLLM's own ``NixlConnector`` (producer): the decode side's
  notification names its own request id, the prefill worker never matches it,
  so ``finished_sending`` never comes (until NIXL's own 480 s expiry).
- Seed 000 around a copy of the Mooncake store connector's shape before vLLM
  #52372 (``request_finished`` hands a computed request's blocks to a store job,
  ``delay_free=True``; the worker reports ``finished_sending`` once the job's
  counter is back to 0): ``batch_is_exist`` raises and the pre-fix job skips
  the decrement.
- The consumer side around ``NixlConnector``: a load whose ``finished_recving`` never comes.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvfsm.adapters.watch import Watch, WatchSettings
from kvfsm.showcase.sim.opt125m import model_dir
from kvfsm.showcase.sim.real import EngineConfig, kv_cache_config, make_request, model_output

pytestmark = pytest.mark.vllm

BLOCK = 16
SEND_TIMEOUT = 10.0
SETTINGS = {"slow_after": 4.0, "send_timeout": SEND_TIMEOUT, "load_timeout": SEND_TIMEOUT, "check_every": 0.0}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def build(inner: str, role: str, *, module_path: str | None = None, **inner_extra: Any) -> tuple[Scheduler, Clock]:
    """vLLM's Scheduler with the WatchConnector around ``inner``, the watch on a clock the test moves."""
    extra = {"inner": inner, "watch": SETTINGS, **inner_extra}
    if module_path:
        extra["inner_module_path"] = module_path
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir()), skip_tokenizer_init=True, dtype="float16", seed=42),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=2048,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="WatchConnector",
            kv_connector_module_path="kvfsm.adapters.vllm",
            kv_role=role,
            kv_connector_extra_config=extra,
        ),
        device_config=DeviceConfig("cpu"),
    )
    cache = kv_cache_config(EngineConfig(num_gpu_blocks=48, block_size=BLOCK))
    config.cache_config.num_gpu_blocks = 48
    scheduler = Scheduler(
        vllm_config=config,
        kv_cache_config=cache,
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )
    connector = scheduler.connector
    assert type(connector).__name__ == "WatchConnector"
    clock = Clock()
    connector.watch = Watch(WatchSettings.of(SETTINGS), connector=type(connector.inner).__name__, clock=clock)
    return scheduler, clock


def step(scheduler: Scheduler, clock: Clock, worker: Any) -> None:
    """One scheduler step, the worker's report on it, the model's output: as vLLM's connector unit tests do it."""
    clock.now += 1.0
    out = scheduler.schedule()
    sending, recving = worker.step(out.kv_connector_metadata, set(out.finished_req_ids))
    ids = list(out.num_scheduled_tokens)
    sampled = [
        [7] if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens else [] for r in ids
    ]
    kv = KVConnectorOutput(finished_sending=sending or None, finished_recving=recving or None)
    scheduler.update_from_output(out, model_output(ids, sampled, kv))


def add(scheduler: Scheduler, n: int, **params: Any) -> list[str]:
    ids = []
    for i in range(n):
        request = make_request(f"req-{i}", [10 + i] * (3 * BLOCK + 4), 1, BLOCK)
        if params:
            request.kv_transfer_params = dict(params)
        scheduler.add_request(request)
        ids.append(request.request_id)
    return ids


# -- seed 004: vLLM's NixlConnector, a notification the producer never matches -----------------------------


class NixlPrefillWorker:
    """The prefill worker's side of NIXL as the scheduler sees it: blocks held per request until a decode
    notification ``"<request id>:<world size>"`` names it (``_get_new_notifs``); unknown ids are logged and dropped.

    The decode side reads two steps after the prefill finished, and its notification names the prefill's
    request id (``meta.remote.request_id``, the fix) or its own (seed 004, vLLM #41974).
    """

    def __init__(self, *, seed_004: bool) -> None:
        self.seed_004 = seed_004
        self.step_no = 0
        self.to_send: set[str] = set()
        self.notifs: deque[tuple[int, bytes]] = deque()
        self.unrecognized: list[str] = []

    def step(self, _meta: Any, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self.step_no += 1
        for rid in finished_req_ids:
            self.to_send.add(rid)
            named = f"decode-{rid}" if self.seed_004 else rid
            self.notifs.append((self.step_no + 2, f"{named}:1".encode()))
        done: set[str] = set()
        while self.notifs and self.notifs[0][0] <= self.step_no:
            rid = self.notifs.popleft()[1].decode().rsplit(":", 1)[0]
            if rid in self.to_send:
                self.to_send.discard(rid)
                done.add(rid)
            else:
                self.unrecognized.append(rid)  # "Potentially invalid KV blocks for unrecognized request"
        return done, set()


@pytest.mark.parametrize("seed_004", [True, False], ids=["seed_004", "fixed"])
def test_nixl_producer_whose_notification_is_never_matched_is_flagged_dead_at_the_deadline(
    seed_004: bool, caplog: pytest.LogCaptureFixture
) -> None:
    scheduler, clock = build("NixlConnector", "kv_producer")
    ids = add(scheduler, 3, do_remote_decode=True)
    worker = NixlPrefillWorker(seed_004=seed_004)
    with caplog.at_level(logging.WARNING, logger="kvfsm.watch"):
        for _ in range(int(SEND_TIMEOUT) + 6):
            step(scheduler, clock, worker)
    watch = scheduler.connector.watch
    dead = [r for r in watch.reports if r.verdict == "dead"]
    if not seed_004:
        assert not watch.reports and not scheduler.requests
        assert watch.summary()["outcomes"] == {"vllm_send:sent": 3}
        return
    assert worker.unrecognized == [f"decode-{rid}" for rid in ids]
    assert sorted(r.request for r in dead) == ids
    for report in dead:
        assert report.state == "overdue" and report.holds == ("gpu_blocks",) and report.blocks == 4
        assert report.age == SEND_TIMEOUT  # flagged at the spec's deadline, not later
        assert report.request in scheduler.requests  # vLLM still keeps the blocks: the watch ended nothing
    assert {r.request for r in watch.reports if r.verdict == "slow"} == set(ids)
    assert f"DEAD: request '{ids[0]}' in 'overdue' 10.0 s after request_finished(delay_free=True)" in caplog.text
    dump = watch.dump()["vllm_send"]["states"]["overdue"]
    assert dump["count"] == 3 and dump["oldest"][0]["held"] == ["gpu_blocks"]


# -- seed 000: a store job whose exception path never reports finished_sending ------------------------------


@dataclass
class StoreMeta(KVConnectorMetadata):  # type: ignore[misc]
    stores: list[str] = field(default_factory=list)


class StoreShapeConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """The scheduler half of vLLM's MooncakeStoreConnector before #52372, reduced to its lifecycle: a finished
    request's computed blocks go to a store job and stay with the connector (``delay_free=True``) until the
    worker reports the request in ``finished_sending``."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._stores: list[str] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> StoreMeta:
        meta, self._stores = StoreMeta(self._stores), []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if not block_ids or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        self._stores.append(request.request_id)
        return True, None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


class StoreError(RuntimeError):
    pass


class StoreSendingWorker:
    """The Mooncake store worker's sending thread (``KVCacheStoreSendingThread``) and its finished_sending, as in
    seed 000: each store job counts its request in ``stored_requests`` and must count it down when done.
    ``batch_is_exist`` raises for the requests in ``failing``; before the fix (PR #43742) the decrement ran
    only on the success path."""

    def __init__(self, failing: set[str], *, fixed: bool) -> None:
        self.failing = failing
        self.fixed = fixed
        self.stored_requests: Counter[str] = Counter()
        self.finished_store_req: set[str] = set()
        self.errors: list[str] = []

    def batch_is_exist(self, rid: str) -> list[int]:
        if rid in self.failing:
            raise StoreError("mooncake down")
        return [0, 0, 0]

    def _handle_request(self, rid: str) -> None:
        if self.fixed:
            try:
                self.batch_is_exist(rid)
            finally:
                self.stored_requests[rid] -= 1
            return
        self.batch_is_exist(rid)  # raises: the decrement below never runs
        self.stored_requests[rid] -= 1

    def step(self, meta: StoreMeta, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for rid in meta.stores:
            self.stored_requests[rid] += 1
            try:
                self._handle_request(rid)
            except StoreError as exc:  # KVTransferThread.run logs it
                self.errors.append(f"{rid}: {exc}")
        done = {rid for rid in self.finished_store_req if self.stored_requests[rid] == 0}
        self.finished_store_req -= done
        for rid in finished_req_ids:
            if self.stored_requests[rid] == 0:
                done.add(rid)
            else:
                self.finished_store_req.add(rid)
        return done, set()


@pytest.mark.parametrize("fixed", [False, True], ids=["seed_000", "fixed"])
def test_store_job_whose_exception_path_never_reports_finished_sending_is_flagged_dead(fixed: bool) -> None:
    scheduler, clock = build("StoreShapeConnector", "kv_both", module_path=__name__)
    ids = add(scheduler, 4)
    failing = {ids[1], ids[3]}
    worker = StoreSendingWorker(failing, fixed=fixed)
    for _ in range(int(SEND_TIMEOUT) + 8):
        step(scheduler, clock, worker)
    watch = scheduler.connector.watch
    assert len(worker.errors) == 2
    if fixed:
        assert not watch.reports and not scheduler.requests
        assert watch.summary()["outcomes"] == {"vllm_send:sent": 4}
        return
    dead = {r.request: r for r in watch.reports if r.verdict == "dead"}
    assert set(dead) == failing
    for rid, report in dead.items():
        assert (report.state, report.age, report.holds, report.blocks) == ("overdue", SEND_TIMEOUT, ("gpu_blocks",), 4)
        assert rid in scheduler.requests and worker.stored_requests[rid] == 1
    summary = watch.summary()
    assert summary["outcomes"] == {"vllm_send:sent": 2} and summary["live"]["vllm_send"] == {"overdue": 2}


def test_a_watch_that_raises_never_changes_what_the_engine_does(caplog: pytest.LogCaptureFixture) -> None:
    scheduler, clock = build("NixlConnector", "kv_producer")
    watch = scheduler.connector.watch

    def broken(*_args: Any) -> None:
        raise RuntimeError("watch bug")

    watch.finished = broken  # type: ignore[method-assign]
    add(scheduler, 3, do_remote_decode=True)
    worker = NixlPrefillWorker(seed_004=False)
    with caplog.at_level(logging.ERROR, logger="kvfsm.watch"):
        for _ in range(6):
            step(scheduler, clock, worker)
    assert not scheduler.requests  # every request served and freed as without the watch
    assert scheduler.connector.watch_errors == 3
    assert caplog.text.count("the watch failed") == 1


# -- the consumer side: an async load whose finished_recving never comes -------------------------------------


class NixlDecodeWorker:
    """The decode worker's READs as the scheduler sees them: each load the metadata names is reported in
    ``finished_recving`` a step later, or never (a READ whose completion is lost, seed 001's shape)."""

    def __init__(self, *, lost: bool) -> None:
        self.lost = lost
        self.pending: set[str] = set()

    def step(self, meta: Any, _finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done, self.pending = self.pending, set(getattr(meta, "reqs_to_recv", {}) or {})
        return set(), set() if self.lost else done


@pytest.mark.parametrize("lost", [True, False], ids=["lost", "reported"])
def test_a_load_never_reported_in_finished_recving_is_flagged_dead_and_vllm_still_waits(lost: bool) -> None:
    scheduler, clock = build("NixlConnector", "kv_consumer")
    remote = {
        "do_remote_prefill": True,
        "remote_engine_id": "prefill-0",
        "remote_block_ids": [1, 2, 3, 4],
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
    }
    ids = add(scheduler, 2, **remote)
    for rid in ids:
        scheduler.requests[rid].kv_transfer_params["remote_request_id"] = f"p-{rid}"
    worker = NixlDecodeWorker(lost=lost)
    for _ in range(int(SEND_TIMEOUT) + 4):
        step(scheduler, clock, worker)
    watch = scheduler.connector.watch
    if not lost:
        assert not watch.reports and not scheduler.requests
        assert watch.summary()["outcomes"] == {"vllm_load:loaded": 2}
        return
    dead = {r.request: r for r in watch.reports if r.verdict == "dead"}
    assert set(dead) == set(ids)
    for rid, report in dead.items():
        assert (report.machine, report.state, report.age, report.holds) == (
            "vllm_load",
            "overdue",
            SEND_TIMEOUT,
            ("gpu_blocks",),
        )
        assert report.blocks > 0 and scheduler.requests[rid].status == RequestStatus.WAITING_FOR_REMOTE_KVS
