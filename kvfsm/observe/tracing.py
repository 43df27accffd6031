"""OpenTelemetry spans of each instance's lifecycle: one span per instance, a child span per state it passes.

Pass ``LifecycleSpans(spec)`` as the tracker's observer; a tracker without it
creates nothing. Trace context crosses processes the W3C way: prefill puts
:meth:`LifecycleSpans.carrier` of a request into the message it sends, and
decode calls :meth:`LifecycleSpans.adopt` with it before ``begin``, so both
sides' lifecycles land in one trace.

An adopted context waits for its key's ``begin``, which may fail or never
come (the observer hears only of begins that succeed). So the waiting ones
are bounded: ``with spans.adopt(key, carrier): tracker.begin(key)`` drops the
context when the block ends unused; without ``with``, a context waits at most
``ttl`` seconds, and at most ``cap`` of them wait (the oldest go first). Every
one dropped is counted in :attr:`LifecycleSpans.dropped`.

A lifecycle that ends in a final state the spec marks ``failure`` has status
ERROR. Once :meth:`LifecycleSpans.attach` has been given the tracker, a
driver action that raised is recorded on the span of the state it ran from
(an exception event naming the action, and status ERROR on that span).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import Failure
from ..spec.model import Spec

if TYPE_CHECKING:
    from ..engine import Tracker

try:
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Span, Status, StatusCode, Tracer
except ImportError as exc:  # pragma: no cover - exercised by the light-install test
    raise ImportError("kvfsm.observe.tracing needs opentelemetry-api: pip install 'kvfsm[otel]'") from exc

ADOPT_CAP = 10_000
"""Adopted contexts kept waiting for their begin, at most."""

ADOPT_TTL = 60.0
"""Seconds an adopted context waits for its begin (a decode begins within moments of the message it adopts from)."""

RECORDED = frozenset({"do", "acquire", "release", "queued", "link"})
"""The phases of a :class:`~kvfsm.errors.Failure` recorded on a span: the instance's own actions. An observer that
raised, or a queued call the tracker refused, says nothing about the instance's lifecycle."""


class Adopted(NamedTuple):
    """A peer's trace context waiting for its key's ``begin``, and when it was adopted."""

    context: Any
    at: float


class Adoption:
    """What :meth:`LifecycleSpans.adopt` returns: used with ``with`` around ``begin``, it drops its context unused."""

    __slots__ = ("_spans", "key", "adopted")

    def __init__(self, spans: LifecycleSpans, key: Hashable, adopted: Adopted) -> None:
        self._spans, self.key, self.adopted = spans, key, adopted

    def __enter__(self) -> Adoption:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._spans._drop_unused(self.key, self.adopted)


class LifecycleSpans:
    """A tracker observer: ``begin`` opens the instance's span and its first state's; each transition ends the
    state's span (with the event) and opens the next; a final state ends the instance's span with its outcome.

    Spans are named after the machine: ``kv_request lifecycle`` for the
    instance, ``kv_request transferring`` for its stay in a state. A failure
    final state sets the lifecycle's status to ERROR; after :meth:`attach`,
    an action that raised is an exception event on its state's span.
    """

    def __init__(
        self,
        spec: Spec,
        tracer: Tracer | None = None,
        *,
        cap: int = ADOPT_CAP,
        ttl: float = ADOPT_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cap < 1 or not ttl > 0:
            raise ValueError(f"cap must be >= 1 and ttl > 0 (got cap={cap}, ttl={ttl})")
        self.machine = spec.name
        self.finals = frozenset(spec.finals)
        self.outcomes = {name: spec.states[name].final for name in spec.finals}
        """Final state → ``success`` or ``failure``, as the spec declares it."""
        self.names = {name: f"{spec.name} {name}" for name in spec.states}
        """State → the name of the span of a stay in it."""
        self.tracer = tracer if tracer is not None else trace.get_tracer("kvfsm")
        self.cap, self.ttl, self.clock = cap, ttl, clock
        self.lifecycles: dict[tuple[Hashable, int], tuple[Span, Span]] = {}
        """(key, generation) → (the instance's span, its current state's span)."""
        self.current: dict[Hashable, int] = {}
        """key → the generation of its live lifecycle, so :meth:`carrier` finds it without a scan."""
        self.parents: dict[Hashable, Adopted] = {}
        """key → the context its next ``begin`` continues (from :meth:`adopt`), oldest adoption first."""
        self.dropped: dict[str, int] = {"unused": 0, "expired": 0, "evicted": 0}
        """Adopted contexts dropped: ``unused`` when an ``adopt`` block ended without a begin, ``expired`` after
        ``ttl``, ``evicted`` beyond ``cap``."""
        self._lock = threading.Lock()
        """Guards ``parents``: a listener thread adopts while the tracker's owner begins."""
        self._tracker: Tracker | None = None
        self._seen: tuple[list[Failure], set[int]] = ([], set())
        """The tracker's list of failures last read, and which of them are on a span already."""

    def attach(self, tracker: Tracker) -> None:
        """Record the failures of ``tracker``'s actions on the spans: ``tracker`` is the one this observes.

        The observer is told of a transition, not of the action that raised
        before it; so it reads the failures the tracker keeps for the call it
        is running (each one, once) when it is told of the key's next
        transition, the on_error one. Without it, failed actions show only
        as the on_error event and a failure final state.
        """
        if tracker.spec.name != self.machine:
            raise ValueError(f"these spans are of machine {self.machine!r}, not {tracker.spec.name!r}")
        self._tracker = tracker

    def _failures(self, key: Hashable) -> list[Failure]:
        """The failures of ``key``'s actions the tracker has kept since they were last read (each returned once).

        Reads the tracker's private list of the running call's failures: a
        ``Tracker`` hook that told observers of each failure would replace it.
        """
        assert self._tracker is not None
        failures = self._tracker._failures
        if not failures:
            return []
        seen_list, seen = self._seen
        if failures is not seen_list:  # a new call: the tracker hands its list to the ActionError and starts anew
            seen = set()
            self._seen = (failures, seen)
        out = []
        for index, failure in enumerate(failures):
            if index not in seen and failure.key == key and failure.phase in RECORDED:
                seen.add(index)
                out.append(failure)
        return out

    def adopt(self, key: Hashable, carrier: Mapping[str, str]) -> Adoption:
        """Continue the trace ``carrier`` names (a peer's :meth:`carrier`) when ``key`` is next begun.

        Use it as ``with spans.adopt(key, carrier): tracker.begin(key)`` so a
        begin that fails leaves nothing behind; called alone, the context
        waits at most ``ttl`` seconds, among at most ``cap``.
        """
        context = propagate.extract(dict(carrier))
        with self._lock:
            now = self.clock()
            parents = self.parents
            while parents:  # adoption order is time order: the oldest are in front
                first = next(iter(parents))
                if parents[first].at + self.ttl > now:
                    break
                del parents[first]
                self.dropped["expired"] += 1
            parents.pop(key, None)  # adopted again: the newer context replaces it, at the back
            adopted = parents[key] = Adopted(context, now)
            while len(parents) > self.cap:
                del parents[next(iter(parents))]
                self.dropped["evicted"] += 1
        return Adoption(self, key, adopted)

    def _drop_unused(self, key: Hashable, adopted: Adopted) -> None:
        with self._lock:
            if self.parents.get(key) is adopted:
                del self.parents[key]
                self.dropped["unused"] += 1

    def carrier(self, key: Hashable) -> dict[str, str]:
        """The W3C trace context of ``key``'s live lifecycle, to send to a peer (empty if it has none)."""
        out: dict[str, str] = {}
        gen = self.current.get(key)
        entry = None if gen is None else self.lifecycles.get((key, gen))
        if entry is not None:
            propagate.inject(out, context=trace.set_span_in_context(entry[0]))
        return out

    def __call__(self, key: Hashable, gen: int, event: str, source: str, target: str, _now: float) -> None:
        if event == "begin":
            adopted = None
            if self.parents:
                with self._lock:
                    adopted = self.parents.pop(key, None)
            root = self.tracer.start_span(
                f"{self.machine} lifecycle",
                context=None if adopted is None else adopted.context,
                attributes={"kvfsm.machine": self.machine, "kvfsm.key": str(key), "kvfsm.generation": gen},
            )
            self.lifecycles[key, gen] = (root, self._state_span(root, target))
            self.current[key] = gen
            return
        entry = self.lifecycles.get((key, gen))
        if entry is None:
            return
        root, state = entry
        state.set_attribute("kvfsm.event", event)
        state.set_attribute("kvfsm.next", target)
        failed = self._failures(key) if self._tracker is not None else ()
        for failure in failed:
            state.record_exception(
                failure.error,
                attributes={"kvfsm.action": failure.action, "kvfsm.phase": failure.phase, "kvfsm.event": failure.event},
            )
            state.set_status(Status(StatusCode.ERROR, f"{failure.phase} action {failure.action!r} raised"))
            root.set_attribute("kvfsm.failed_action", failure.action)
        state.end()
        if target in self.finals:
            outcome = self.outcomes[target]
            root.set_attribute("kvfsm.final", target)
            root.set_attribute("kvfsm.outcome", outcome or "")
            if outcome == "failure":
                root.set_status(Status(StatusCode.ERROR, f"ended in {target!r}, a failure final state"))
            root.end()
            del self.lifecycles[key, gen]
            if self.current.get(key) == gen:
                del self.current[key]
        else:
            self.lifecycles[key, gen] = (root, self._state_span(root, target))

    def _state_span(self, root: Span, state: str) -> Span:
        return self.tracer.start_span(
            self.names[state],
            context=trace.set_span_in_context(root),
            attributes={"kvfsm.machine": self.machine, "kvfsm.state": state},
        )
