"""LifecycleSpans.adopt keeps a bounded number of trace contexts: a begin that fails or never comes leaks none."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

import kvfsm
from kvfsm import Tracker
from kvfsm.spec.bundled import SPECS
from kvfsm.testing import VirtualClock

pytest.importorskip("opentelemetry.trace", reason="kvfsm[otel] (opentelemetry-api) not installed")
sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk not installed")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import Tracer  # noqa: E402

from kvfsm.observe.tracing import LifecycleSpans  # noqa: E402

SPEC = kvfsm.load(SPECS / "kv_request.yaml")
CARRIER = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


class Driver:
    def enqueue_job(self, key: Hashable) -> None: ...
    def start_transfer(self, key: Hashable) -> None: ...
    def task_done(self, key: Hashable) -> None: ...
    def free_gpu_blocks(self, key: Hashable) -> None: ...


def tracer_and_exporter() -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_contexts_adopted_for_begins_that_never_come_are_capped_and_counted() -> None:
    spans = LifecycleSpans(SPEC, cap=1_000)
    for i in range(20_000):
        spans.adopt(i, CARRIER)
    assert len(spans.parents) == 1_000
    assert spans.dropped["evicted"] == 19_000
    assert 19_999 in spans.parents and 0 not in spans.parents  # the newest are kept: their begin is likeliest


def test_contexts_adopted_long_ago_expire() -> None:
    clock = VirtualClock()
    spans = LifecycleSpans(SPEC, ttl=30.0, clock=clock)
    spans.adopt("gone", CARRIER)
    clock.advance(31.0)
    spans.adopt("fresh", CARRIER)
    assert list(spans.parents) == ["fresh"] and spans.dropped["expired"] == 1


def test_a_begin_that_fails_drops_its_adopted_context() -> None:
    tracer, exporter = tracer_and_exporter()
    spans = LifecycleSpans(SPEC, tracer)
    tracker = Tracker(SPEC, Driver(), observer=spans)
    tracker.begin("dup")
    with pytest.raises(kvfsm.DuplicateKey), spans.adopt("dup", CARRIER):
        tracker.begin("dup")  # fails: its context must not wait for some later begin of "dup"
    assert "dup" not in spans.parents and spans.dropped["unused"] == 1
    with pytest.raises(RuntimeError), spans.adopt("never", CARRIER):
        raise RuntimeError("the caller failed before it could begin")
    assert "never" not in spans.parents and spans.dropped["unused"] == 2
    with spans.adopt("ok", CARRIER):
        tracker.begin("ok")
    assert spans.parents == {} and spans.dropped["unused"] == 2
    tracker.fire("ok", "abort")
    root = next(s for s in exporter.get_finished_spans() if s.attributes and s.attributes.get("kvfsm.key") == "ok")
    assert f"{root.context.trace_id:032x}" == CARRIER["traceparent"].split("-")[1]  # begun in the adopted trace


def test_carrier_names_the_live_lifecycle_of_a_key_and_nothing_else() -> None:
    tracer, _exporter = tracer_and_exporter()
    spans = LifecycleSpans(SPEC, tracer)
    tracker = Tracker(SPEC, Driver(), observer=spans)
    tracker.begin_many(range(2_000))
    assert "traceparent" in spans.carrier(1_999) and spans.carrier("never") == {}
    tracker.fire(7, "abort")
    assert spans.carrier(7) == {}
