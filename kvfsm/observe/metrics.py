"""Prometheus metrics of a tracker, generated from its spec: every state, resource and transition, from zero.

What connector authors write by hand, per connector, comes out of the spec
here: live instances per state, held units per resource, transitions per
(from, event, to), finished instances per final state (expired apart from
failed), anomalies by kind, action and release failures by phase, timeouts,
time spent in each state, and the age of the oldest instance in each live
state. Labels are bounded (machine, state, event, resource, kind): never a
request id. Every series exists at zero from the start, so an alert on a
rate works before the first event.

Counting and timing are taps compiled into the tracker's transitions
(:meth:`kvfsm.Tracker.tap`): a tracker without metrics pays nothing, a
counted transition pays one C call; the gauges are read when Prometheus
scrapes, from one copy of the tracker's tables (its lock taken once). Timing
every state (``state_times=True``) costs a Python call, a clock read and a
dict update per transition, so it is opt-in.

``kvfsm_build_info`` (always 1) names what runs: the kvfsm version and a hash
of the spec, so a fleet that runs two versions of a spec shows it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import threading
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, get_args

from ..errors import AnomalyKind
from .view import View

if TYPE_CHECKING:
    from ..engine import Tracker
    from ..spec.model import Spec

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.registry import REGISTRY, CollectorRegistry
except ImportError as exc:  # pragma: no cover - exercised by the light-install test
    raise ImportError("kvfsm.observe.metrics needs prometheus_client: pip install 'kvfsm[metrics]'") from exc

BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 600.0)
"""Upper bounds (seconds) of the time-in-state histogram: from a copy's milliseconds to NIXL's 480 s expiry."""

ANOMALIES = (*get_args(AnomalyKind), "clock_backwards")
FAILURES = {
    "action_errors": "action",
    "release_errors": "release",
    "observer_errors": "observer",
    "queued_errors": "queued",
}


UNHASHED = frozenset({"doc", "loc", "locs", "path"})
"""Spec fields that do not change what the machine does: where and how it was written."""


def spec_hash(spec: Spec) -> str:
    """12 hex digits of the SHA-256 of what ``spec`` declares: its states, transitions, resources, params and rules.

    Docs, comments, layout and the file's path do not count, so two files
    that declare the same machine have one hash, and an edit that changes a
    transition, a hold or a default changes it.
    """
    return hashlib.sha256(json.dumps(_declared(spec), separators=(",", ":")).encode()).hexdigest()[:12]


def _declared(value: Any) -> Any:
    """``value`` as plain JSON data, dataclass fields by name without :data:`UNHASHED`, in declaration order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _declared(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name not in UNHASHED}
    if isinstance(value, Mapping):
        return [[_declared(k), _declared(v)] for k, v in value.items()]
    if isinstance(value, list | tuple | frozenset | set):
        items = [_declared(v) for v in value]
        return items if isinstance(value, list | tuple) else sorted(items, key=json.dumps)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


class Tally:
    """A counter whose increment is a single C call, ``tally.tap(key)``: a tap as cheap as Python allows.

    ``tap`` is ``next(counter, key)``: the key is a default that an endless
    counter never returns. Reading takes one value too, so reads are counted
    and subtracted.
    """

    __slots__ = ("_counter", "_reads", "tap")
    _reading = threading.Lock()

    def __init__(self) -> None:
        self._counter = itertools.count()
        self._reads = 0
        self.tap: Callable[[Hashable], object] = partial(next, self._counter)

    @property
    def value(self) -> int:
        with self._reading:
            value = next(self._counter) - self._reads
            self._reads += 1
            return value


class TrackerMetrics:
    """The metrics of one tracker; register it with a Prometheus registry (the default one unless given).

    >>> metrics = TrackerMetrics(tracker)          # counting starts now
    >>> prometheus_client.start_http_server(9400, addr="127.0.0.1")

    ``state_times=True`` also times every state: the ``kvfsm_state_seconds``
    histogram, and the oldest-age gauge of states without a timeout (timed
    states report it from their armed deadlines either way). It is opt-in
    because it costs several times what counting does (see docs/observability.md).

    ``name`` adds a ``tracker`` label to every series: two trackers of one
    machine in one registry need distinct names (a second one without is refused).
    """

    def __init__(
        self,
        tracker: Tracker,
        *,
        registry: CollectorRegistry | None = REGISTRY,
        state_times: bool = False,
        buckets: Sequence[float] = BUCKETS,
        clock: Callable[[], float] | None = None,
        name: str | None = None,
    ) -> None:
        self.tracker = tracker
        self.machine = tracker.spec.name
        self.name = name
        """With a name, every series carries a ``tracker`` label: how two trackers of one machine share a registry."""
        if registry is not None:
            self._refuse_twin(registry)  # before the taps: a refused one must cost the tracker nothing
        self.buckets = tuple(buckets)
        self.clock = clock if clock is not None else tracker.clock
        """Times states on the tracker's own clock unless told otherwise."""
        spec = tracker.spec
        self.state_times = state_times
        self.edges: list[tuple[str, str, str]] = []
        self.taken: list[Tally] = []
        self.begun = Tally()
        self.entered: dict[Hashable, float] = {}
        """When each live instance entered its current state (only with ``state_times``)."""
        self.spec_hash = spec_hash(spec)
        """What :func:`spec_hash` makes of the tracker's spec: the ``spec_hash`` label of ``kvfsm_build_info``."""
        self.histograms = {name: [0] * (len(self.buckets) + 1) for name in spec.states}
        self.sums = {name: [0.0] for name in spec.states}
        tracker.tap(
            self._edge_tap if state_times else self._count_tap, self._begin_tap if state_times else self.begun.tap
        )
        if registry is not None:
            registry.register(self)

    def _refuse_twin(self, registry: CollectorRegistry) -> None:
        """Two trackers of one machine with the same (or no) name would repeat every series with identical labels."""
        for other in list(getattr(registry, "_collector_to_names", {})):
            if isinstance(other, TrackerMetrics) and (other.machine, other.name) == (self.machine, self.name):
                named = f"named {self.name!r}" if self.name is not None else "without a name"
                raise ValueError(
                    f"this registry already has the metrics of a {self.machine!r} tracker {named}; give each "
                    f"tracker of one machine its own name= (it becomes the series' `tracker` label)"
                )

    # -- taps: run inside the tracker's calls, per key -------------------------------

    def _tally(self, source: str, event: str, target: str) -> Tally:
        self.edges.append((source, event, target))
        self.taken.append(Tally())
        return self.taken[-1]

    def _count_tap(self, source: str, event: str, target: str) -> Callable[[Hashable], object]:
        return self._tally(source, event, target).tap

    def _edge_tap(self, source: str, event: str, target: str) -> Callable[[Hashable], None]:
        tally = self._tally(source, event, target).tap
        entered, clock, bounds = self.entered, self.clock, self.buckets
        counts, total = self.histograms[source], self.sums[source]
        pop = entered.pop
        final = self.tracker.spec.states[target].is_final

        def time_state(key: Hashable) -> None:
            tally(key)
            now = clock()
            since = pop(key, now)
            counts[bisect_left(bounds, now - since)] += 1
            total[0] += now - since
            if not final:
                entered[key] = now

        return time_state

    def _begin_tap(self, key: Hashable) -> None:
        self.begun.tap(key)
        self.entered[key] = self.clock()

    # -- the collector: read when scraped ----------------------------------------------

    def _labels(self, *names: str) -> list[str]:
        return ["machine", *(["tracker"] if self.name is not None else []), *names]

    def _values(self, *values: str) -> list[str]:
        return [self.machine, *([self.name] if self.name is not None else []), *values]

    def collect(self) -> Iterator[Metric]:
        """Every series of this tracker, each state, resource and transition present even at zero.

        The gauges are read from one :class:`~kvfsm.observe.view.View`: the
        tracker's lock is taken once per scrape, however many instances live.
        """
        spec, labels, values = self.tracker.spec, self._labels, self._values
        build = GaugeMetricFamily(
            "kvfsm_build_info", "The kvfsm version and the hash of the spec it runs (always 1)",
            labels=labels("version", "spec_hash"),
        )  # fmt: skip
        build.add_metric(values(_version(), self.spec_hash), 1)
        yield build
        view = View.take(self.tracker, self.entered if self.state_times else None)
        census, holding, counts = view.census(), view.holding(), view.counts
        live = GaugeMetricFamily(
            "kvfsm_instances", "Instances per state (final ones until drained)", labels=labels("state")
        )
        for state in spec.states:
            live.add_metric(values(state), census.get(state, 0))
        yield live
        held = GaugeMetricFamily("kvfsm_held", "Instances holding each resource", labels=labels("resource"))
        for resource in spec.resources:
            held.add_metric(values(resource), holding.get(resource, 0))
        yield held
        begun = CounterMetricFamily("kvfsm_begun", "Instances begun", labels=labels())
        begun.add_metric(values(), self.begun.value)
        yield begun
        moved = CounterMetricFamily("kvfsm_transitions", "Transitions taken", labels=labels("from", "event", "to"))
        finished: dict[str, int] = dict.fromkeys(spec.finals, 0)
        for (source, event, target), tally in zip(self.edges, self.taken, strict=True):
            n = tally.value
            moved.add_metric(values(source, event, target), n)
            if target in finished:
                finished[target] += n
        yield moved
        ended = CounterMetricFamily(
            "kvfsm_finished", "Instances that reached each final state", labels=labels("state", "outcome")
        )
        for state, n in finished.items():
            ended.add_metric(values(state, spec.states[state].final or ""), n)
        yield ended
        anomalies = CounterMetricFamily("kvfsm_anomalies", "Events dropped or forced, by kind", labels=labels("kind"))
        for kind in ANOMALIES:
            anomalies.add_metric(values(kind), counts.get(kind, 0))
        yield anomalies
        failures = CounterMetricFamily("kvfsm_failures", "Driver action failures, by phase", labels=labels("phase"))
        for count, phase in FAILURES.items():
            failures.add_metric(values(phase), counts.get(count, 0))
        yield failures
        timeouts = CounterMetricFamily("kvfsm_timeouts", "Deadlines that fired", labels=labels())
        timeouts.add_metric(values(), counts.get("timeouts", 0))
        yield timeouts
        if self.state_times:
            yield self._histogram()
        oldest = GaugeMetricFamily(
            "kvfsm_oldest_seconds", "Age in its state of the oldest instance of each live state", labels=labels("state")
        )
        for state, age in self._oldest(view).items():
            oldest.add_metric(values(state), age)
        yield oldest

    def _histogram(self) -> Metric:
        seconds = HistogramMetricFamily(
            "kvfsm_state_seconds", "Time spent in each state, observed on leaving it", labels=self._labels("state")
        )
        for state, counts in self.histograms.items():
            cumulative, running = [], 0
            for bound, n in zip([*map(str, self.buckets), "+Inf"], counts, strict=True):
                running += n
                cumulative.append((bound, running))
            seconds.add_metric(self._values(state), cumulative, self.sums[state][0])
        return seconds

    def oldest(self) -> dict[str, float]:
        """Seconds the oldest instance of each live state has been in it.

        0 where none is; without ``state_times``, also for a state without a
        timeout (a timed one is read off its armed deadlines).
        """
        return self._oldest(View.take(self.tracker, self.entered if self.state_times else None))

    def _oldest(self, view: View) -> dict[str, float]:
        now = self.clock() if self.clock is not self.tracker.clock else view.now
        out = dict.fromkeys(self.tracker.spec.live, 0.0)
        for state, since in view.oldest_since().items():
            out[state] = max(0.0, now - since)
        return out

    def describe(self) -> list[Any]:
        """No description up front: the collector's series are only known from the spec, at collection."""
        return []


def _version() -> str:
    from .. import __version__

    return __version__
