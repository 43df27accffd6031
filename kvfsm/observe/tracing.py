"""OpenTelemetry spans of each instance's lifecycle: one span per instance, a child span per state it passes.

Pass ``LifecycleSpans(spec)`` as the tracker's observer; a tracker without it
creates nothing. Trace context crosses processes the W3C way: prefill puts
:meth:`LifecycleSpans.carrier` of a request into the message it sends, and
decode calls :meth:`LifecycleSpans.adopt` with it before ``begin``, so both
sides' lifecycles land in one trace.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from ..spec.model import Spec

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Span, Tracer
except ImportError as exc:  # pragma: no cover - exercised by the light-install test
    raise ImportError("kvfsm.observe.tracing needs opentelemetry-api: pip install 'kvfsm[otel]'") from exc


class LifecycleSpans:
    """A tracker observer: ``begin`` opens the instance's span and its first state's; each transition ends the
    state's span (with the event) and opens the next; a final state ends the instance's span with its outcome."""

    def __init__(self, spec: Spec, tracer: Tracer | None = None) -> None:
        self.machine = spec.name
        self.finals = frozenset(spec.finals)
        self.tracer = tracer if tracer is not None else trace.get_tracer("kvfsm")
        self.lifecycles: dict[tuple[Hashable, int], tuple[Span, Span]] = {}
        """(key, generation) → (the instance's span, its current state's span)."""
        self.parents: dict[Hashable, Any] = {}
        """key → the context its next ``begin`` continues (from :meth:`adopt`)."""

    def adopt(self, key: Hashable, carrier: Mapping[str, str]) -> None:
        """Continue the trace ``carrier`` names (a peer's :meth:`carrier`) when ``key`` is next begun."""
        self.parents[key] = propagate.extract(dict(carrier))

    def carrier(self, key: Hashable) -> dict[str, str]:
        """The W3C trace context of ``key``'s live lifecycle, to send to a peer (empty if it has none)."""
        out: dict[str, str] = {}
        for (k, _gen), (span, _state) in self.lifecycles.items():
            if k == key:
                propagate.inject(out, context=trace.set_span_in_context(span))
        return out

    def __call__(self, key: Hashable, gen: int, event: str, source: str, target: str, _now: float) -> None:
        if event == "begin":
            root = self.tracer.start_span(
                f"{self.machine} lifecycle",
                context=self.parents.pop(key, None),
                attributes={"kvfsm.machine": self.machine, "kvfsm.key": str(key), "kvfsm.generation": gen},
            )
            self.lifecycles[key, gen] = (root, self._state_span(root, target))
            return
        entry = self.lifecycles.get((key, gen))
        if entry is None:
            return
        root, state = entry
        state.set_attribute("kvfsm.event", event)
        state.set_attribute("kvfsm.next", target)
        state.end()
        if target in self.finals:
            root.set_attribute("kvfsm.final", target)
            root.end()
            del self.lifecycles[key, gen]
        else:
            self.lifecycles[key, gen] = (root, self._state_span(root, target))

    def _state_span(self, root: Span, state: str) -> Span:
        return self.tracer.start_span(state, context=trace.set_span_in_context(root), attributes={"kvfsm.state": state})
