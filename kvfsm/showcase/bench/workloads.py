"""The four measurements the core issue asks for; each appends rows and targets to a report.

1. ``lifecycle``: N requests through begin, enqueue, start, complete, then one
   drain of ``finished()``, phase by phase as a scheduler would (all N live at
   once), through the Tracker, the hand-written tracker, ``transitions`` and
   python-statemachine.
2. ``scaling``: ``fire`` on a ping-pong spec that keeps instances live, at
   several live counts; keys fired in insertion order, as a scheduler walks its
   running requests (a shuffled order is shown too, for the cache effect).
3. ``memory``: tracemalloc bytes per live instance, keys allocated beforehand.
4. ``poll``: ``poll()`` over many armed deadlines with a virtual clock.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...engine import Tracker
from ...spec import Spec, load, read_text, run_checks
from ...spec.bundled import SPECS
from .handwritten import kv_request_tracker, pingpong_tracker
from .harness import NullBatchDriver, NullDriver, VirtualClock, Workload, interleaved, time_once
from .report import BenchReport, Row, Target
from .rivals import TransitionsTracker, statemachine_tracker

TRANSFER_TIMEOUT = 30.0

PINGPONG = """\
kvfsm: 1
machine: bench_pingpong
doc: Keeps instances live forever; each event takes or gives back one resource.
key: request_id
resources:
  slot: {acquire: take_slot, release: give_slot}
states:
  idle:    {initial: true, waits: local}
  busy:    {holds: [slot], waits: local}
  aborted: {final: failure}
transitions:
  - {event: ping,  from: idle, to: busy}
  - {event: pong,  from: busy, to: idle}
  - {event: abort, from: "*",  to: aborted}
on_error: abort
"""


@dataclass(frozen=True)
class Sizes:
    """How big and how often; the full run's figures are what the targets are judged on."""

    lifecycle_n: int
    transitions_n: int
    statemachine_n: int
    lifecycle_repeats: int
    rival_repeats: int
    live_counts: tuple[int, ...]
    events_per_repeat: int
    scaling_repeats: int
    memory_n: int
    poll_armed: int
    poll_small_armed: int
    poll_repeats: int
    empty_polls: int


FULL = Sizes(
    lifecycle_n=20_000,
    transitions_n=20_000,
    statemachine_n=1_000,
    lifecycle_repeats=15,
    rival_repeats=3,
    live_counts=(1_000, 100_000, 1_000_000),
    events_per_repeat=1_000_000,
    scaling_repeats=7,
    memory_n=100_000,
    poll_armed=100_000,
    poll_small_armed=10_000,
    poll_repeats=5,
    empty_polls=10_000,
)

QUICK = Sizes(
    lifecycle_n=2_000,
    transitions_n=200,
    statemachine_n=20,
    lifecycle_repeats=3,
    rival_repeats=1,
    live_counts=(100, 1_000, 10_000),
    events_per_repeat=20_000,
    scaling_repeats=3,
    memory_n=5_000,
    poll_armed=10_000,
    poll_small_armed=1_000,
    poll_repeats=3,
    empty_polls=1_000,
)


class Lifecycle(Protocol):
    def begin(self, key: Hashable, /) -> object: ...
    def fire(self, key: Hashable, event: str, /) -> object: ...
    def finished(self) -> list[tuple[Hashable, str]]: ...


def keys_for(n: int) -> list[str]:
    """Request ids as a scheduler has them: distinct str objects, hashes already cached."""
    keys = [f"req-{i}" for i in range(n)]
    for k in keys:
        hash(k)
    return keys


def kv_request_spec(path: str | Path | None = None) -> Spec:
    """The canonical spec: ``path``, else the bundled ``specs/kv_request.yaml``."""
    return load(path if path is not None else SPECS / "kv_request.yaml")


def pingpong_spec() -> Spec:
    spec = read_text(PINGPONG, "<bench pingpong>")
    errors = [f for f in run_checks(spec) if f.severity == "error"]
    assert not errors, errors
    return spec


def _lifecycle(tracker: Lifecycle, keys: Sequence[Hashable]) -> Workload:
    def workload() -> list[tuple[Hashable, str]]:
        begin, fire = tracker.begin, tracker.fire
        for k in keys:
            begin(k)
        for k in keys:
            fire(k, "enqueue")
        for k in keys:
            fire(k, "start")
        for k in keys:
            fire(k, "complete")
        return tracker.finished()

    return workload


BATCH = 256
"""Keys per ``fire_many`` call in the batch variant: a scheduler step's worth of completions."""


def _lifecycle_batched(tracker: Tracker, keys: Sequence[Hashable]) -> Workload:
    """The same lifecycle with each phase, begin included, done ``BATCH`` keys at a time."""
    chunks = [list(keys[i : i + BATCH]) for i in range(0, len(keys), BATCH)]

    def workload() -> list[tuple[Hashable, str]]:
        fire_many = tracker.fire_many
        for chunk in chunks:
            tracker.begin_many(chunk)
        for event in ("enqueue", "start", "complete"):
            for chunk in chunks:
                fire_many(event, chunk)
        return tracker.finished()

    return workload


def _metered(spec: Spec, driver: Any, params: dict[str, float], state_times: bool = False) -> Tracker:
    """The default Tracker with :class:`~kvfsm.observe.metrics.TrackerMetrics` counting (and timing) it."""
    from ...observe.metrics import TrackerMetrics

    tracker = Tracker(spec, driver, params=params)
    TrackerMetrics(tracker, registry=None, state_times=state_times)
    return tracker


def _have_metrics() -> bool:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def _expect_all_done(n: int) -> Callable[[str, object], None]:
    def check(name: str, result: object) -> None:
        assert isinstance(result, list), name
        if len(result) != n or any(state != "done" for _key, state in result):
            raise AssertionError(f"{name}: lifecycle did not finish all {n} requests in 'done'")

    return check


def make_lifecycle_trackers(spec: Spec, driver: Any) -> dict[str, Callable[[], Lifecycle]]:
    """Every variant of the lifecycle comparison, each bound to ``driver``, by row name."""
    params = {"transfer_timeout": TRANSFER_TIMEOUT}
    return {
        "hand-written": lambda: kv_request_tracker(driver, time.monotonic, TRANSFER_TIMEOUT),
        "Tracker(threadsafe=False)": lambda: Tracker(spec, driver, params=params, threadsafe=False),
        "hand-written + lock": lambda: kv_request_tracker(driver, time.monotonic, TRANSFER_TIMEOUT, threadsafe=True),
        "Tracker": lambda: Tracker(spec, driver, params=params),
        "Tracker + metrics": lambda: _metered(spec, driver, params),
        "Tracker + metrics, states timed": lambda: _metered(spec, driver, params, state_times=True),
        "transitions": lambda: TransitionsTracker(driver, time.monotonic, TRANSFER_TIMEOUT),
        "python-statemachine": lambda: statemachine_tracker(driver, time.monotonic, TRANSFER_TIMEOUT),
    }


def _have_statemachine() -> bool:
    try:
        import statemachine  # noqa: F401
    except ImportError:
        return False
    return True


def lifecycle(report: BenchReport, sizes: Sizes, spec: Spec) -> None:
    """Tracker against the hand-written tracker, interleaved, at the same N, in both threading modes.

    Single-thread: ``Tracker(threadsafe=False)`` against the plain hand-written
    tracker. Thread-safe: the default ``Tracker`` (one lock per call) against
    the hand-written tracker with the ``RLock`` its author would take. The
    default Tracker against the lock-free hand-written one is
    ``lifecycle_vs_handwritten``.
    """
    n = sizes.lifecycle_n
    keys = keys_for(n)
    makers = make_lifecycle_trackers(spec, NullDriver())
    names = ["hand-written", "Tracker(threadsafe=False)", "hand-written + lock", "Tracker"]
    baselines = ["hand-written", "hand-written", "hand-written", "hand-written + lock"]
    setups: dict[str, Callable[[], Workload]] = {}
    for name in names:
        make = makers[name]
        setups[name] = lambda make=make: _lifecycle(make(), keys)  # type: ignore[misc]
    batched = f"Tracker.fire_many (batch {BATCH})"
    params = {"transfer_timeout": TRANSFER_TIMEOUT}
    setups[batched] = lambda: _lifecycle_batched(Tracker(spec, NullBatchDriver(), params=params), keys)
    names.append(batched)
    baselines.append("hand-written")
    if _have_metrics():
        for metered in ("Tracker + metrics", "Tracker + metrics, states timed"):
            setups[metered] = lambda metered=metered: _lifecycle(makers[metered](), keys)  # type: ignore[misc]
            names.append(metered)
            baselines.append("Tracker")
    else:
        report.notes.append("prometheus_client is not installed (pip install 'kvfsm[metrics]'): no metrics row")
    median = interleaved(setups, sizes.lifecycle_repeats, _expect_all_done(n))
    per = {name: median[name] / n * 1e6 for name in names}
    section = f"lifecycle: begin + enqueue + start + complete + drain, per request (N={n:,})"
    for name, baseline in zip(names, baselines, strict=True):
        report.rows.append(Row(section, name, per[name], "µs/request", per[name] / per[baseline], baseline))
    report.figures["lifecycle_vs_handwritten"] = per["Tracker"] / per["hand-written"]
    report.figures["lifecycle_unlocked_vs_handwritten"] = per["Tracker(threadsafe=False)"] / per["hand-written"]
    report.figures["batch_vs_handwritten"] = per[batched] / per["hand-written"]
    if "Tracker + metrics" in per:
        report.figures["metrics_overhead"] = per["Tracker + metrics"] / per["Tracker"]
        report.figures["metrics_timed_overhead"] = per["Tracker + metrics, states timed"] / per["Tracker"]
    single = per["Tracker(threadsafe=False)"] / per["hand-written"]
    locked = per["Tracker"] / per["hand-written + lock"]
    figures = report.figures
    report.targets += [
        Target.at_most(f"lifecycle, one thread: Tracker(threadsafe=False) / hand-written ≤ 1.5 (N={n:,})", single, 1.5),
        Target.at_most(f"lifecycle, thread-safe: Tracker / hand-written + lock ≤ 1.5 (N={n:,})", locked, 1.5),
        Target.at_most(
            "lifecycle: default (locked) Tracker / lock-free hand-written ≤ 1.5",
            figures["lifecycle_vs_handwritten"],
            1.5,
        ),
        Target.at_most(
            f"batch: fire_many (batch {BATCH}) / lock-free hand-written per key ≤ 0.6",
            figures["batch_vs_handwritten"],
            0.6,
        ),
    ]
    if "metrics_overhead" in figures:
        report.targets.append(
            Target.at_most("metrics: Tracker + metrics (counting) / Tracker ≤ 1.15", figures["metrics_overhead"], 1.15)
        )


def rival_lifecycle(report: BenchReport, sizes: Sizes, spec: Spec, name: str) -> None:
    """One general-purpose library through the same lifecycle, at its own (stated) N."""
    n = sizes.transitions_n if name == "transitions" else sizes.statemachine_n
    tracker_row = report.row("Tracker")
    section = tracker_row.section
    if name == "python-statemachine" and not _have_statemachine():
        report.notes.append("python-statemachine is not installed (pip install 'kvfsm[dev]'); its row is skipped")
        return
    keys = keys_for(n)
    maker = make_lifecycle_trackers(spec, NullDriver())[name]
    median = interleaved({name: lambda: _lifecycle(maker(), keys)}, sizes.rival_repeats, _expect_all_done(n))
    per = median[name] / n * 1e6
    note = (
        "" if n == sizes.lifecycle_n else f"N={n:,} (add_model/instantiation cost grows with N; smaller N favours it)"
    )
    report.rows.append(Row(section, name, per, "µs/request", per / tracker_row.value, "Tracker", note))
    if name == "transitions":
        ratio = per / tracker_row.value
        report.figures["vs_transitions"] = ratio
        report.targets.append(
            Target(
                f"lifecycle transitions (N={n:,}) / Tracker (N={sizes.lifecycle_n:,}) ≥ 20", ratio, 20.0, ratio >= 20
            )
        )


def scaling(report: BenchReport, sizes: Sizes) -> None:
    """Cost per ``fire`` with N instances live, for each N.

    Every size is built up front and all variants run interleaved round by
    round, so load on the machine that drifts during the run hits each N alike
    and the ratio between sizes stays honest.
    """
    spec = pingpong_spec()
    section = "fire() with N live instances (ping-pong spec, keys in scheduler order), per event"
    largest, smallest = max(sizes.live_counts), min(sizes.live_counts)
    setups: dict[str, Callable[[], Workload]] = {}
    events: dict[str, int] = {}
    baseline: dict[str, str] = {}
    floors: list[str] = []
    census: list[tuple[Tracker, int]] = []
    for n in sizes.live_counts:
        driver = NullDriver()
        keys = keys_for(n)
        tracker = Tracker(spec, driver)
        hand = pingpong_tracker(driver, time.monotonic)
        for k in keys:
            tracker.begin(k)
            hand.begin(k)
        census.append((tracker, n))
        passes = max(1, sizes.events_per_repeat // (2 * n))
        orders = [("", keys)]
        if n == largest:
            shuffled = list(keys)
            random.Random(0).shuffle(shuffled)
            orders.append((", shuffled keys", shuffled))
        for suffix, ks in orders:
            mine, theirs = f"Tracker, N={n:,}{suffix}", f"hand-written, N={n:,}{suffix}"
            setups[mine] = _pingpong(tracker.fire, ks, passes)
            setups[theirs] = _pingpong(hand.fire, ks, passes)
            events[mine] = events[theirs] = passes * 2 * n
            baseline[mine] = theirs
        floors.append(f"dict.get alone, N={n:,}")
        setups[floors[-1]] = _lookups(dict.fromkeys(keys, 0), keys, passes)
        events[floors[-1]] = passes * 2 * n
        floors.append(f"dict.get + store, N={n:,}")
        setups[floors[-1]] = _lookups(dict.fromkeys(keys, 0), keys, passes, store=True)
        events[floors[-1]] = passes * 2 * n
    median = interleaved(setups, sizes.scaling_repeats)
    per_event = {name: median[name] / events[name] * 1e9 for name in setups}
    for name in setups:
        if name in baseline:
            theirs = baseline[name]
            report.rows.append(
                Row(section, name, per_event[name], "ns/event", per_event[name] / per_event[theirs], theirs)
            )
            report.rows.append(Row(section, theirs, per_event[theirs], "ns/event"))
    notes = {
        "dict.get alone": "the floor: one bare lookup of the key in a dict of N entries, which every key→state "
        "tracker pays",
        "dict.get + store": "a step's floor: the state looked up and the next one stored, in a loop with nothing "
        "else to do",
    }
    for floor in floors:
        kind = floor.split(",")[0]
        unit = "ns/lookup" if kind == "dict.get alone" else "ns/event"
        report.rows.append(Row(section, floor, per_event[floor], unit, note=notes.pop(kind, "")))
    for tracker, n in census:
        assert tracker.census()["idle"] == n, "every ping was matched by a pong"
    del census, setups
    gc.collect()
    top, bottom = f"Tracker, N={largest:,}", f"Tracker, N={smallest:,}"
    ratio = per_event[top] / per_event[bottom]
    named = largest == 1_000_000 and smallest == 1_000
    report.figures["scaling_1m_vs_1k" if named else "scaling"] = ratio
    growth = {
        who: per_event[f"{who}, N={largest:,}"] - per_event[f"{who}, N={smallest:,}"]
        for who in ("Tracker", "hand-written", "dict.get + store")
    }
    # What fire() adds per event that grows with N, against the same layout by hand: the growth itself is the
    # memory hierarchy's (benchmarks/README.md), so a ratio of costs would judge fire()'s base, not its growth.
    relative = growth["Tracker"] / max(growth["hand-written"], 1.0)  # a growth under 1 ns counts as 1 ns
    report.figures["scaling_growth_vs_handwritten" if named else "scaling_growth"] = relative
    row = report.row(top)
    report.rows[report.rows.index(row)] = row._replace(
        note=f"{ratio:.2f}x the cost at N={smallest:,}: +{growth['Tracker']:.0f} ns/event, hand-written "
        f"+{growth['hand-written']:.0f}, dict.get + store +{growth['dict.get + store']:.0f}"
    )
    report.targets.append(
        Target.at_most(
            f"fire() growth in ns/event, Tracker / hand-written (same layout), {smallest:,} to {largest:,} live ≤ 1.3",
            relative,
            1.3,
        )
    )


def _lookups(table: dict[str, int], keys: Sequence[str], passes: int, store: bool = False) -> Callable[[], Workload]:
    """Setup for a floor: as many bare ``dict.get`` calls as the ping-pong round fires events (each value
    stored back, as a step stores the next state, if ``store``)."""

    def workload() -> None:
        get = table.get
        for _ in range(passes):
            for k in keys:
                get(k)
            for k in keys:
                get(k)

    def stores() -> None:
        get = table.get
        for _ in range(passes):
            for k in keys:
                table[k] = get(k)  # type: ignore[assignment]
            for k in keys:
                table[k] = get(k)  # type: ignore[assignment]

    return lambda: stores if store else workload


def _pingpong(fire: Callable[[Hashable, str], object], keys: Sequence[Hashable], passes: int) -> Callable[[], Workload]:
    """Setup for one ping-pong round: the instances already exist, so it only hands out the workload."""

    def workload() -> None:
        for _ in range(passes):
            for k in keys:
                fire(k, "ping")
            for k in keys:
                fire(k, "pong")

    return lambda: workload


def _traced_bytes(build: Callable[[], object], n: int) -> float:
    """tracemalloc bytes per instance that ``build()`` leaves allocated."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        keep = build()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del keep
    return (after - before) / n


def memory(report: BenchReport, sizes: Sizes, spec: Spec) -> None:
    """Bytes per live instance, pinned (no deadline) and transferring (deadline armed), key excluded."""
    n = sizes.memory_n
    section = f"memory per live instance, key excluded (tracemalloc, N={n:,})"
    driver = NullDriver()
    params = {"transfer_timeout": TRANSFER_TIMEOUT}
    for stage, events in (("pinned, no deadline", ()), ("transferring, deadline armed", ("enqueue", "start"))):
        keys = keys_for(n)
        figures = {}
        for name, make in (
            ("Tracker", lambda: Tracker(spec, driver, params=params)),
            ("hand-written", lambda: kv_request_tracker(driver, time.monotonic, TRANSFER_TIMEOUT)),
        ):
            subject: Any = make()

            def build(subject: Any = subject, events: tuple[str, ...] = events, keys: list[str] = keys) -> object:
                for k in keys:
                    subject.begin(k)
                for event in events:
                    for k in keys:
                        subject.fire(k, event)
                return subject

            figures[name] = _traced_bytes(build, n)
            del subject
        t, h = figures["Tracker"], figures["hand-written"]
        report.rows.append(Row(section, f"Tracker, {stage}", t, "B/instance", t / h, f"hand-written, {stage}"))
        report.rows.append(Row(section, f"hand-written, {stage}", h, "B/instance"))
        report.targets.append(Target(f"bytes per live instance, {stage} ≤ 250", t, 250.0, t <= 250))
        if events:
            report.figures["bytes_per_instance"] = t


def _armed(spec: Spec, n: int) -> tuple[Tracker, VirtualClock]:
    """A tracker with ``n`` instances in ``transferring``; instance i's deadline is at 30 + i."""
    clock = VirtualClock()
    tracker = Tracker(spec, NullDriver(), clock=clock, params={"transfer_timeout": TRANSFER_TIMEOUT})
    for i, k in enumerate(keys_for(n)):
        tracker.begin(k)
        tracker.fire(k, "enqueue")
        clock.now = float(i)
        tracker.fire(k, "start")
    return tracker, clock


def _armed_hand(n: int) -> Any:
    clock = VirtualClock()
    hand = kv_request_tracker(NullDriver(), clock, TRANSFER_TIMEOUT)
    for i, k in enumerate(keys_for(n)):
        hand.begin(k)
        hand.fire(k, "enqueue")
        clock.now = float(i)
        hand.fire(k, "start")
    return hand


def _due_at(count: int) -> float:
    """The virtual time at which exactly ``count`` of the deadlines from :func:`_armed` are due."""
    return TRANSFER_TIMEOUT + count - 0.5


def poll(report: BenchReport, sizes: Sizes, spec: Spec) -> None:
    """``poll()`` cost against the number due, with the number armed held fixed (and vice versa)."""
    armed, small = sizes.poll_armed, sizes.poll_small_armed
    section = f"poll() with {armed:,} armed deadlines (virtual clock), each due one fires expire"
    one_pct, ten_pct = armed // 100, armed // 10

    cases = {
        f"Tracker, {one_pct:,} due (1%)": (armed, one_pct),
        f"Tracker, {ten_pct:,} due (10%)": (armed, ten_pct),
        f"Tracker, {one_pct:,} due of only {small:,} armed": (small, one_pct),
    }
    hand_name = f"hand-written, {one_pct:,} due (1%)"
    expected = {name: due for name, (_n, due) in cases.items()} | {hand_name: one_pct}

    def tracker_setup(n: int, due: int) -> Callable[[], Workload]:
        def setup() -> Workload:
            tracker, _clock = _armed(spec, n)
            return lambda: tracker.poll(_due_at(due))

        return setup

    def hand_setup() -> Workload:
        hand = _armed_hand(armed)
        return lambda: hand.poll(_due_at(one_pct))

    def check(name: str, result: object) -> None:
        got = len(result) if isinstance(result, list) else result
        if got != expected[name]:
            raise AssertionError(f"{name}: poll fired {got}, expected {expected[name]}")

    setups = {name: tracker_setup(n, due) for name, (n, due) in cases.items()} | {hand_name: hand_setup}
    median = interleaved(setups, sizes.poll_repeats, check)
    per_due = {name: median[name] / expected[name] * 1e6 for name in setups}
    hand_per_due = per_due[hand_name]

    tracker, _clock = _armed(spec, armed)
    loops = sizes.empty_polls
    now = _due_at(0)

    def empty() -> int:
        for _ in range(loops):
            tracker.poll(now)
        return len(tracker.poll(now))

    empty_us = statistics.median(time_once(empty)[0] for _ in range(sizes.poll_repeats)) / (loops + 1) * 1e6
    assert tracker.census()["transferring"] == armed

    first, second, third = cases
    report.rows.append(Row(section, first, per_due[first], "µs/due", per_due[first] / hand_per_due, hand_name))
    report.rows.append(Row(section, second, per_due[second], "µs/due", per_due[second] / per_due[first], first))
    report.rows.append(
        Row(
            section,
            third,
            per_due[third],
            "µs/due",
            per_due[third] / per_due[first],
            first,
            f"{armed // small}x fewer armed, same due: what differs is only how much of the table stays in cache",
        )
    )
    report.rows.append(Row(section, hand_name, hand_per_due, "µs/due"))
    whole = per_due[first] * one_pct
    whole_name = f"{first}, whole poll"
    report.rows.append(Row(section, whole_name, whole, "µs/poll"))
    report.rows.append(Row(section, "Tracker, 0 due", empty_us, "µs/poll", empty_us / whole, whole_name))
    r10 = per_due[second] / per_due[first]
    r_empty = empty_us / whole
    report.targets.append(Target("poll µs per due deadline, 10% due / 1% due ≤ 1.5", r10, 1.5, r10 <= 1.5))
    report.targets.append(Target("poll with 0 due / poll with 1% due ≤ 0.01", r_empty, 0.01, r_empty <= 0.01))
