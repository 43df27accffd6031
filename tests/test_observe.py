"""Observability generated from the spec: metrics, the bounded dump, stuck warnings, the debug endpoint, kvfsm top."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import Hashable, Iterator
from pathlib import Path

import pytest

import kvfsm
from kvfsm import Tracker
from kvfsm.observe import DebugServer, StuckWatch, state_dump
from kvfsm.spec.bundled import SPECS
from kvfsm.testing import VirtualClock

prometheus_client = pytest.importorskip("prometheus_client", reason="kvfsm[metrics] (prometheus_client) not installed")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvfsm.observe.metrics import TrackerMetrics  # noqa: E402

SPEC = kvfsm.load(SPECS / "kv_request.yaml")


class Driver:
    def enqueue_job(self, key: Hashable) -> None: ...
    def start_transfer(self, key: Hashable) -> None: ...
    def task_done(self, key: Hashable) -> None: ...
    def free_gpu_blocks(self, key: Hashable) -> None: ...


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture(params=[False, True], ids=["counted", "timed"])
def rig(request: pytest.FixtureRequest) -> Iterator[tuple[Tracker, VirtualClock, TrackerMetrics, CollectorRegistry]]:
    clock = VirtualClock()
    tracker = Tracker(SPEC, Driver(), clock=clock)
    registry = CollectorRegistry()
    yield tracker, clock, TrackerMetrics(tracker, registry=registry, state_times=request.param), registry


def test_every_state_resource_and_transition_is_a_series_at_zero_before_any_event(rig) -> None:  # type: ignore[no-untyped-def]
    _t, _c, _m, registry = rig
    got = samples(registry)
    m = ("machine", "kv_request")
    for state in SPEC.states:
        assert got[("kvfsm_instances", tuple(sorted([m, ("state", state)])))] == 0
    for resource in SPEC.resources:
        assert got[("kvfsm_held", tuple(sorted([m, ("resource", resource)])))] == 0
    transitions = {k for k in got if k[0] == "kvfsm_transitions_total"}
    assert len(transitions) == len(list(SPEC.table)) and all(got[k] == 0 for k in transitions)
    for final in SPEC.finals:
        assert any(k[0] == "kvfsm_finished_total" and ("state", final) in k[1] for k in got)


def test_transitions_finals_and_time_in_state_are_counted(rig) -> None:  # type: ignore[no-untyped-def]
    t, clock, metrics, registry = rig
    for key in ("a", "b", "c"):
        t.begin(key)
        t.fire(key, "enqueue")
    clock.advance(2.0)
    t.fire("a", "start")
    t.fire("b", "abort")
    t.fire("c", "start")
    clock.advance(SPEC.params["transfer_timeout"] + 1)
    t.fire("a", "complete")
    t.poll()  # c expires
    got = samples(registry)
    m = ("machine", "kv_request")

    def value(name: str, **labels: str) -> float:
        return got[(name, tuple(sorted([m, *labels.items()])))]

    assert value("kvfsm_transitions_total", **{"from": "queued", "event": "start", "to": "transferring"}) == 2
    assert value("kvfsm_finished_total", state="done", outcome="success") == 1
    assert value("kvfsm_finished_total", state="expired", outcome="failure") == 1
    assert value("kvfsm_finished_total", state="aborted", outcome="failure") == 1
    assert value("kvfsm_timeouts_total") == 1
    assert value("kvfsm_begun_total") == 3
    assert metrics.entered == {}  # every instance finished (or was never timed): nothing left to time
    if metrics.state_times:
        assert value("kvfsm_state_seconds_count", state="queued") == 3
        assert value("kvfsm_state_seconds_sum", state="queued") == pytest.approx(6.0)
    else:
        assert not any(name.startswith("kvfsm_state_seconds") for name, _labels in got)
    assert samples(registry)[("kvfsm_begun_total", (m,))] == 3  # a second scrape reads the same counts


def test_the_oldest_age_per_live_state_is_read_when_scraped(rig) -> None:  # type: ignore[no-untyped-def]
    t, clock, metrics, registry = rig
    t.begin("old")
    clock.advance(7.0)
    t.begin("new")
    for key in ("old", "new"):
        t.fire(key, "enqueue")
    t.fire("old", "start")
    clock.advance(3.0)
    t.fire("new", "start")
    clock.advance(1.0)
    got = samples(registry)

    def oldest(state: str) -> float:
        return got[("kvfsm_oldest_seconds", (("machine", "kv_request"), ("state", state)))]

    assert oldest("transferring") == 4.0  # timed: read off the armed deadline, timed or not
    assert oldest("queued") == 0.0  # nobody is there
    t.begin("waiting")
    clock.advance(2.0)
    pinned = samples(registry)[("kvfsm_oldest_seconds", (("machine", "kv_request"), ("state", "pinned")))]
    assert pinned == (2.0 if metrics.state_times else 0.0)  # untimed: known only when states are timed


def test_a_tracker_without_metrics_runs_no_tap() -> None:
    t = Tracker(SPEC, Driver())
    plain = [len(e.release_fns) for e in t._program.edges()]
    TrackerMetrics(Tracker(SPEC, Driver()), registry=None)
    assert [len(e.release_fns) for e in t._program.edges()] == plain
    assert plain == [len(e.releases) for e in t._program.edges()]


def test_the_dump_is_bounded_sorted_oldest_first_and_says_when_it_cut() -> None:
    clock = VirtualClock()
    t = Tracker(SPEC, Driver(), clock=clock, spaces=["peer"])
    for i in range(5):
        t.begin(i)
        t.fire(i, "enqueue")
        t.fire(i, "start")
        clock.advance(1.0)
    t.link(0, "peer", "decode-0")
    dump = state_dump(t, limit=2)
    transferring = dump["states"]["transferring"]
    assert transferring["count"] == 5 and transferring["truncated"] and dump["truncated"]
    assert [row["key"] for row in transferring["oldest"]] == [0, 1]
    assert transferring["oldest"][0]["age"] == 5.0 and transferring["oldest"][0]["ids"] == {"peer": "decode-0"}
    assert transferring["oldest"][0]["held"] == ["gpu_blocks", "queue_slot"]
    assert dump["live"] == 5 and not dump["states"]["pinned"]["truncated"]


def test_a_stuck_instance_is_logged_once_per_state(caplog: pytest.LogCaptureFixture) -> None:
    clock = VirtualClock()
    t = Tracker(SPEC, Driver(), clock=clock)
    watch = StuckWatch(t, fraction=0.5)
    t.begin("r")
    t.fire("r", "enqueue")
    t.fire("r", "start")
    after = SPEC.params["transfer_timeout"]
    clock.advance(after * 0.4)
    assert watch.check() == []
    clock.advance(after * 0.2)
    with caplog.at_level(logging.WARNING, logger="kvfsm.stuck"):
        assert [(k, s) for k, s, _ in watch.check()] == [("r", "transferring")]
        assert watch.check() == []
    assert len(caplog.records) == 1 and "holding gpu_blocks, queue_slot" in caplog.records[0].getMessage()
    assert t.state("r") == "transferring"  # observe-only


def test_the_endpoint_serves_state_metrics_and_refuses_bad_queries(rig) -> None:  # type: ignore[no-untyped-def]
    t, _clock, _m, registry = rig
    t.begin("r")
    with DebugServer([t], registry=registry) as server:
        assert server.url.startswith("http://127.0.0.1:")
        state = json.load(urllib.request.urlopen(server.url + "/state?limit=1"))
        assert state["trackers"]["kv_request"]["states"]["pinned"]["count"] == 1
        text = urllib.request.urlopen(server.url + "/metrics").read().decode()
        assert 'kvfsm_instances{machine="kv_request",state="pinned"} 1.0' in text
        with pytest.raises(urllib.error.HTTPError) as bad:
            urllib.request.urlopen(server.url + "/state?limit=lots")
        assert bad.value.code == 400


PROCESS = """
import sys, time
import kvfsm
from prometheus_client import CollectorRegistry
from kvfsm.observe import DebugServer
from kvfsm.observe.metrics import TrackerMetrics
from kvfsm.spec.bundled import SPECS

class Driver:
    def enqueue_job(self, key): pass
    def start_transfer(self, key): pass
    def task_done(self, key): pass
    def free_gpu_blocks(self, key): pass

registry = CollectorRegistry()
trackers = [kvfsm.Tracker(SPECS / name, Driver()) for name in ("kv_request.yaml",)]
for t in trackers:
    TrackerMetrics(t, registry=registry)
    for i in range(20):
        t.begin(i)
        t.fire(i, "enqueue")
server = DebugServer(trackers, registry=registry)
print(server.url, flush=True)
sys.stdin.read()
server.close()
"""


def test_metrics_scraped_from_a_running_process_show_every_state_of_its_specs(tmp_path: Path) -> None:
    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(PROCESS))
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        seen = {
            s.labels["state"]: s.value
            for family in text_string_to_metric_families(text)
            if family.name == "kvfsm_instances"
            for s in family.samples
        }
        assert set(seen) == set(SPEC.states) and all(v >= 0 for v in seen.values()) and seen["queued"] == 20
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=10)


def test_kvfsm_top_once_renders_every_state_of_a_running_tracker(rig, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from kvfsm.cli import main

    t, _clock, _m, _registry = rig
    t.begin("r")
    with DebugServer([t]) as server:
        assert main(["top", server.url, "--once"]) == 0
    out = capsys.readouterr().out
    assert "kv_request" in out and all(state in out for state in SPEC.states)


def test_a_declared_warn_after_watches_a_state_without_a_timeout(caplog: pytest.LogCaptureFixture) -> None:
    text = (
        (SPECS / "kv_request.yaml")
        .read_text()
        .replace(
            "    doc: Blocks pinned, waiting to be queued by the scheduler.",
            "    doc: Blocks pinned, waiting to be queued by the scheduler.\n    warn_after: 3",
        )
    )
    assert "warn_after: 3" in text
    clock = VirtualClock()
    t = Tracker(kvfsm.parse(text, "warned.yaml"), Driver(), clock=clock)
    metrics = TrackerMetrics(t, registry=None, state_times=True)
    watch = StuckWatch(t, entered=metrics.entered)
    t.begin("r")
    clock.advance(2.0)
    assert watch.check() == []
    clock.advance(2.0)
    with caplog.at_level(logging.WARNING, logger="kvfsm.stuck"):
        assert watch.check() == [("r", "pinned", 4.0)]
    assert "warned after 3.0 s" in caplog.records[0].getMessage()


def test_each_lifecycle_is_a_span_with_a_child_per_state_and_crosses_processes_by_carrier() -> None:
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk not installed")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvfsm.observe.tracing import LifecycleSpans

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    prefill_spans, decode_spans = LifecycleSpans(SPEC, tracer), LifecycleSpans(SPEC, tracer)
    prefill = Tracker(SPEC, Driver(), observer=prefill_spans)
    decode = Tracker(SPEC, Driver(), observer=decode_spans)
    prefill.begin("r1")
    decode_spans.adopt("r1", prefill_spans.carrier("r1"))
    decode.begin("r1")
    for event in ("enqueue", "start", "complete"):
        prefill.fire("r1", event)
    decode.fire("r1", "abort")
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "kv_request lifecycle"]
    assert len(roots) == 2 and roots[0].context.trace_id == roots[1].context.trace_id
    prefill_root = next(s for s in roots if (s.attributes or {}).get("kvfsm.final") == "done")
    children = [s.name for s in spans if s.parent is not None and s.parent.span_id == prefill_root.context.span_id]
    assert children == [
        "kv_request pinned",
        "kv_request queued",
        "kv_request transferring",
        "kv_request lifecycle",
    ]  # decode's continues prefill's
    assert prefill_spans.lifecycles == {} and decode_spans.lifecycles == {}


def test_the_pd_jobs_processes_serve_metrics_for_every_state_of_their_role_specs() -> None:
    pytest.importorskip("torch", reason="the P/D job needs kvfsm[torch]")
    pytest.importorskip("zmq", reason="the P/D job needs kvfsm[zmq]")
    from kvfsm.harness.pd import JobConfig, run_job
    from kvfsm.harness.pd.role import system

    roles = system("corrected").roles
    seen: dict[str, set[str]] = {}

    def scrape(role: str, url: str) -> None:
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        seen[role] = {
            s.labels["state"]
            for family in text_string_to_metric_families(text)
            if family.name == "kvfsm_instances"
            for s in family.samples
            if s.value >= 0
        }

    ledger = run_job(
        JobConfig(requests=60, concurrency=8, fault_rate=0.0, metrics=True), on_endpoint=scrape, kill_prefill=False
    )
    assert ledger.clean, ledger.as_dict()
    assert set(seen) == {"prefill", "decode"}
    for role, states in seen.items():
        assert states == set(roles[role].spec.states), role
