"""kvfsm.observe's parts on real deployments: several trackers of one machine behind one endpoint, metrics,
journal and spans on one tracker, spans that say what failed, and build_info."""

from __future__ import annotations

import io
import json
import urllib.request
from collections.abc import Hashable
from pathlib import Path

import pytest
from drivers import RecordingDriver, recording_driver

import kvfsm
from kvfsm import ActionError, Tracker
from kvfsm.observe import serve
from kvfsm.replay import JsonlJournal, check_log
from kvfsm.spec.bundled import SPECS

pytest.importorskip("prometheus_client", reason="kvfsm[metrics] (prometheus_client) not installed")
pytest.importorskip("opentelemetry.trace", reason="kvfsm[otel] (opentelemetry-api) not installed")
sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk not installed")
from opentelemetry.sdk.trace import ReadableSpan  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode, Tracer  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvfsm.observe.metrics import TrackerMetrics, spec_hash  # noqa: E402
from kvfsm.observe.tracing import LifecycleSpans  # noqa: E402

SPEC = kvfsm.load(SPECS / "kv_request.yaml")


def driver(*broken: Hashable) -> RecordingDriver:
    """kv_request's actions, recorded; ``start_transfer`` raises for the keys in ``broken``."""
    made = recording_driver(SPEC)
    for key in broken:
        made.fail_next("start_transfer", key)
    return made


def tracer_and_exporter() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parsed(text: str) -> Series:
    """Every sample by (name, labels); a series repeated with identical labels fails here."""
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"series repeated: {key}"
            out[key] = s.value
    return out


def run_requests(tracker: Tracker) -> None:
    """ok-1, ok-2 done; bad fails in start_transfer (on_error: failed); gone aborted."""
    for key in ("ok-1", "ok-2", "bad", "gone"):
        tracker.begin(key)
        tracker.fire(key, "enqueue")
    for key in ("ok-1", "ok-2"):
        tracker.fire(key, "start")
        tracker.fire(key, "complete")
    with pytest.raises(ActionError):
        tracker.fire("bad", "start")
    tracker.fire("gone", "abort")


def roots_by_key(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {str((s.attributes or {})["kvfsm.key"]): s for s in spans if s.name == "kv_request lifecycle"}


# -- spans: error status, the failing action, names -------------------------------------------------------------


def test_a_lifecycle_ending_in_a_failure_state_has_error_status_and_a_success_keeps_unset() -> None:
    tracer, exporter = tracer_and_exporter()
    spans = LifecycleSpans(SPEC, tracer)
    tracker = Tracker(SPEC, driver("bad"), observer=spans)
    run_requests(tracker)
    roots = roots_by_key(exporter.get_finished_spans())
    assert roots["ok-1"].status.status_code == StatusCode.UNSET
    for key, final in (("bad", "failed"), ("gone", "aborted")):
        assert roots[key].status.status_code == StatusCode.ERROR and final in (roots[key].status.description or "")
        assert (roots[key].attributes or {})["kvfsm.outcome"] == "failure"


def test_an_action_that_raised_is_an_exception_event_naming_it_on_the_span_of_its_state() -> None:
    tracer, exporter = tracer_and_exporter()
    spans = LifecycleSpans(SPEC, tracer)
    tracker = Tracker(SPEC, driver("bad"), observer=spans)
    spans.attach(tracker)
    run_requests(tracker)
    finished = exporter.get_finished_spans()
    bad = roots_by_key(finished)["bad"]
    (queued,) = [s for s in finished if s.parent is not None and s.parent.span_id == bad.context.span_id and s.events]
    assert queued.name == "kv_request queued" and queued.status.status_code == StatusCode.ERROR
    (event,) = queued.events
    attributes = dict(event.attributes or {})
    assert event.name == "exception" and str(attributes["exception.type"]).endswith("InjectedFault")
    assert attributes["kvfsm.action"] == "start_transfer" and attributes["kvfsm.phase"] == "do"
    assert (bad.attributes or {})["kvfsm.failed_action"] == "start_transfer"
    assert not any(s.events for s in finished if s is not queued)  # recorded once, on its own span only


def test_child_spans_are_named_by_machine_and_state() -> None:
    tracer, exporter = tracer_and_exporter()
    tracker = Tracker(SPEC, driver(), observer=LifecycleSpans(SPEC, tracer))
    tracker.begin("r")
    tracker.fire("r", "enqueue")
    tracker.fire("r", "abort")
    assert [s.name for s in exporter.get_finished_spans()] == [
        "kv_request pinned",
        "kv_request queued",
        "kv_request lifecycle",
    ]


# -- metrics, journal and spans on one tracker -------------------------------------------------------------------


def test_metrics_journal_and_spans_observe_one_tracker_together() -> None:
    tracer, exporter = tracer_and_exporter()
    stream = io.BytesIO()
    journal = JsonlJournal(stream)
    spans = LifecycleSpans(SPEC, tracer)
    tracker = Tracker(
        SPEC,
        driver("bad"),
        params={"transfer_timeout": 45.0},
        observer=[journal, spans],
        on_anomaly=journal.anomaly,
    )
    journal.attach(tracker)
    spans.attach(tracker)
    registry = CollectorRegistry()
    TrackerMetrics(tracker, registry=registry)
    run_requests(tracker)
    tracker.close()
    journal.close()

    series = parsed(generate_latest(registry).decode())
    finished = {
        dict(labels)["state"]: value for (name, labels), value in series.items() if name == "kvfsm_finished_total"
    }
    assert finished == {"done": 2.0, "failed": 1.0, "aborted": 1.0, "expired": 0.0}
    lines = stream.getvalue().splitlines(keepends=True)
    assert json.loads(lines[0])["params"] == {"transfer_timeout": 45.0}
    report = check_log(SPEC, lines, params=json.loads(lines[0])["params"])
    assert report.conforms and dict(report.outcomes) == {"done": 2, "failed": 1, "aborted": 1, "expired": 0}
    roots = roots_by_key(exporter.get_finished_spans())
    assert sorted(roots) == ["bad", "gone", "ok-1", "ok-2"]
    assert (roots["bad"].attributes or {})["kvfsm.failed_action"] == "start_transfer"
    assert tracker.counts["observer_errors"] == 0


# -- several trackers of one machine behind one endpoint --------------------------------------------------------


def test_two_ranks_of_one_machine_behind_one_endpoint_scrape_apart_over_http() -> None:
    ranks = {"rank0": Tracker(SPEC, driver()), "rank1": Tracker(SPEC, driver())}
    with serve(ranks) as server:  # counting starts here
        ranks["rank0"].begin_many(["a", "b", "c"])
        ranks["rank1"].begin("d")
        ranks["rank1"].fire("d", "enqueue")
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
            series = parsed(answer.read().decode())
        with urllib.request.urlopen(f"{server.url}/state", timeout=30) as answer:
            state = json.loads(answer.read())["trackers"]
    assert sorted(state) == ["rank0", "rank1"]
    assert state["rank0"]["states"]["pinned"]["count"] == 3 and state["rank1"]["states"]["queued"]["count"] == 1

    def value(name: str, rank: str, **labels: str) -> float:
        want = tuple(sorted({"machine": "kv_request", "tracker": rank, **labels}.items()))
        return series[name, want]

    assert value("kvfsm_instances", "rank0", state="pinned") == 3.0
    assert value("kvfsm_instances", "rank1", state="pinned") == 0.0
    assert value("kvfsm_instances", "rank1", state="queued") == 1.0
    assert value("kvfsm_begun_total", "rank0") == 3.0 and value("kvfsm_begun_total", "rank1") == 1.0
    assert value("kvfsm_held", "rank1", resource="queue_slot") == 1.0
    builds = {dict(labels)["tracker"] for (name, labels), _v in series.items() if name == "kvfsm_build_info"}
    assert builds == {"rank0", "rank1"}


# -- build_info ---------------------------------------------------------------------------------------------------


def test_build_info_names_the_kvfsm_version_and_a_hash_of_what_the_spec_declares(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    TrackerMetrics(Tracker(SPEC, driver()), registry=registry)
    ((labels, value),) = [
        (dict(k), v)
        for (name, k), v in parsed(generate_latest(registry).decode()).items()
        if name == "kvfsm_build_info"
    ]
    assert value == 1.0 and labels["version"] == kvfsm.__version__ and labels["spec_hash"] == spec_hash(SPEC)
    text = (SPECS / "kv_request.yaml").read_text()
    moved = tmp_path / "kv_request.yaml"
    moved.write_text("# a comment and a new path change nothing\n" + text.replace("doc: ", "doc: Reworded. "))
    assert spec_hash(kvfsm.load(moved)) == spec_hash(SPEC)
    moved.write_text(text.replace("transfer_timeout: 30.0", "transfer_timeout: 31.0"))
    assert spec_hash(kvfsm.load(moved)) != spec_hash(SPEC)
