"""kvfsm watch, the vLLM-free half: the connector contract's two specs run as a watchdog beside a connector.

:class:`Watch` keeps one :class:`~kvfsm.Tracker` per side of vLLM's
``KVConnectorBase_V1`` contract, on the bundled specs
``specs/watch/vllm_send.yaml`` (a ``delay_free`` hold until
``finished_sending``) and ``specs/watch/vllm_load.yaml`` (an asynchronous load
until ``finished_recving``). :class:`~kvfsm.adapters.vllm_watch.WatchConnector`
feeds it from the calls vLLM's scheduler makes on the connector it wraps, and
their results; nothing here imports vLLM, so the watch can be fed by any
harness that sees those calls.

A watchdog must not end a request the connector still holds: a deadline
moves the instance to ``overdue``, which still holds the blocks and is what
the watch reports as dead; a late ``finished_sending`` or ``finished_recving``
still ends it. The watch releases nothing in vLLM: its driver's release only
forgets what it noted about the blocks.

What it reports, all from the specs (docs/watch.md):

- a warning per request and stay on the ``kvfsm.watch`` logger: *slow* once a
  hold or load has lasted its state's ``warn_after`` (``slow_after``), *dead*
  once it is ``overdue`` (and again every ``remind_after``), with the request,
  its state, its age since the hold began and what it holds
  (:attr:`Watch.reports` keeps the latest);
- outcome counts per final state (:meth:`Watch.summary`), and
  ``kvfsm.observe``'s metrics, state dump and debug endpoint on its trackers;
- a JSON-lines journal per tracker that ``kvfsm replay`` checks offline;
- request ids hashed (``hash_ids``) and a deterministic sample of requests
  (``sample``), so a busy engine can be watched at a fraction of the cost.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import time
import zlib
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..engine import Tracker
from ..errors import ActionError
from ..observe.stuck import StuckWatch
from ..spec import Spec, load
from ..spec.bundled import SPECS

SEND_SPEC = SPECS / "watch" / "vllm_send.yaml"
LOAD_SPEC = SPECS / "watch" / "vllm_load.yaml"

LOGGER = logging.getLogger("kvfsm.watch")

_QUIET = logging.Logger("kvfsm.watch.quiet", level=logging.CRITICAL + 1)
"""StuckWatch's own lines are not written: the watch writes its fuller ones from what StuckWatch finds."""


@dataclass(frozen=True)
class WatchSettings:
    """The ``watch`` entry of ``kv_connector_extra_config`` (every key optional)."""

    slow_after: float = 30.0
    """Seconds a hold or load may last before it is reported slow."""
    send_timeout: float = 120.0
    """Seconds from ``request_finished`` (delay_free) to ``finished_sending`` before the hold is overdue (dead)."""
    load_timeout: float = 120.0
    """Seconds from ``update_state_after_alloc`` to ``finished_recving`` before the load is overdue (dead)."""
    remind_after: float = 300.0
    """An overdue request is reported again this often."""
    check_every: float = 1.0
    """Seconds between stuck checks (each reads one copy of the trackers' tables); deadlines are polled every step."""
    journal: str | None = None
    """A folder: each tracker writes ``vllm_send-<pid>.jsonl`` / ``vllm_load-<pid>.jsonl`` there for ``kvfsm replay``."""
    hash_ids: bool = False
    """Track, log and journal a 16-hex-digit BLAKE2b of each request id instead of the id."""
    sample: float = 1.0
    """The share of requests watched, chosen by a hash of the id (all of one request's events or none)."""
    metrics: bool = False
    """Register ``kvfsm.observe`` metrics of both trackers with prometheus_client's default registry."""
    debug_port: int | None = None
    """Serve ``/state``, ``/metrics`` and ``/healthz`` of both trackers on 127.0.0.1 at this port (0: any free one)."""

    @classmethod
    def of(cls, entries: Mapping[str, Any] | None) -> WatchSettings:
        """Settings from the ``watch`` entry; an unknown key or a bad value is a ``ValueError`` naming it."""
        entries = dict(entries or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(entries) - known)
        if unknown:
            raise ValueError(f"kvfsm watch: unknown setting(s) {unknown}; known: {sorted(known)}")
        settings = cls(**entries)
        for name in ("slow_after", "send_timeout", "load_timeout", "remind_after", "check_every"):
            value = getattr(settings, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"kvfsm watch: {name} must be a number of seconds >= 0, not {value!r}")
        if min(settings.send_timeout, settings.load_timeout) <= settings.slow_after:
            raise ValueError("kvfsm watch: send_timeout and load_timeout must exceed slow_after")
        if not 0.0 < settings.sample <= 1.0:
            raise ValueError(f"kvfsm watch: sample must be in (0, 1], not {settings.sample!r}")
        return settings


@dataclass(frozen=True)
class StuckReport:
    """One request the watch found slow or dead."""

    machine: str
    request: Hashable
    state: str
    verdict: str
    """``slow`` (past ``slow_after``, still within its deadline) or ``dead`` (overdue)."""
    age: float
    """Seconds since the hold (``request_finished``) or load (``update_state_after_alloc``) began."""
    deadline: float
    holds: tuple[str, ...]
    blocks: int
    """How many of vLLM's blocks the request holds."""

    def line(self, connector: str) -> str:
        what = ", ".join(self.holds) or "nothing"
        owed = "finished_sending" if self.machine == "vllm_send" else "finished_recving"
        since = "request_finished(delay_free=True)" if self.machine == "vllm_send" else "update_state_after_alloc"
        if self.verdict == "dead":
            tail = f"past its {self.deadline:g} s deadline: no {owed} yet (dead, or a reaper still to come)"
        else:
            tail = f"within its {self.deadline:g} s deadline: {owed} is slow"
        return (
            f"kvfsm watch [{connector}] {self.verdict.upper()}: request {self.request!r} in {self.state!r} "
            f"{self.age:.1f} s after {since}, holding {what} ({self.blocks} blocks); {tail}"
        )


class _Holds:
    """The watch's driver: notes, per request, how many blocks it holds and since when; a release forgets it.

    It never frees anything in vLLM: the connector does, and vLLM on ``finished_sending``/``finished_recving``.
    """

    def __init__(self) -> None:
        self.held: dict[Hashable, tuple[int, float]] = {}

    def let_go_blocks(self, key: Hashable) -> None:
        self.held.pop(key, None)


def hash_id(request_id: str) -> str:
    """What the watch logs and journals for ``request_id`` under ``hash_ids``: 16 hex digits of its BLAKE2b."""
    return hashlib.blake2b(request_id.encode(), digest_size=8).hexdigest()


class Watch:
    """Both sides of the connector contract for one scheduler; call it as the connector's calls return.

    Every method is cheap on the step path and is meant to be called through a
    guard that catches what it raises (the connector's ``_guarded``): the
    watch must never break the engine.
    """

    def __init__(
        self,
        settings: WatchSettings = WatchSettings(),
        *,
        connector: str = "connector",
        clock: Callable[[], float] = time.monotonic,
        send_spec: Spec | None = None,
        load_spec: Spec | None = None,
    ) -> None:
        self.settings = settings
        self.connector = connector
        self.clock = clock
        threadsafe = settings.debug_port is not None  # only the endpoint's threads read the trackers besides ours
        self._send_holds = _Holds()
        self._load_holds = _Holds()
        self._load_blocks: dict[Hashable, set[int]] = {}
        """Each load's block ids, to find the loads invalid blocks belong to."""
        self.journals: list[Any] = []
        send_params = {
            "slow_after": settings.slow_after,
            "send_timeout": settings.send_timeout,
            "remind_after": settings.remind_after,
        }
        load_params = {
            "slow_after": settings.slow_after,
            "load_timeout": settings.load_timeout,
            "remind_after": settings.remind_after,
        }
        self.send = self._tracker(send_spec or load(SEND_SPEC), self._send_holds, send_params, threadsafe)
        self.load = self._tracker(load_spec or load(LOAD_SPEC), self._load_holds, load_params, threadsafe)
        self._stuck = [
            (StuckWatch(t, logger=_QUIET), holds, self._dead_states(t.spec), deadline)
            for t, holds, deadline in (
                (self.send, self._send_holds, settings.send_timeout),
                (self.load, self._load_holds, settings.load_timeout),
            )
        ]
        self._next_check = -math.inf
        self.reports: deque[StuckReport] = deque(maxlen=1000)
        """The latest slow and dead findings, oldest first (at most 1,000)."""
        self.outcomes: Counter[tuple[str, str]] = Counter()
        """``(machine, final state)`` → requests that ended there."""
        self.violations: Counter[str] = Counter()
        """Events the contract does not allow in the state the request was in (e.g. a load reported before phase B)."""
        self.metrics: list[Any] = []
        self.server: Any = None
        if settings.metrics:
            self._register_metrics()
        if settings.debug_port is not None:
            from ..observe import serve

            self.server = serve({"vllm_send": self.send, "vllm_load": self.load}, port=settings.debug_port)
            LOGGER.info("kvfsm watch [%s]: debug endpoint %s", connector, self.server.url)
        self._key: Callable[[str], Hashable | None] = self._key_function(settings)

    # -- construction ------------------------------------------------------------------

    def _tracker(self, spec: Spec, holds: _Holds, params: dict[str, float], threadsafe: bool) -> Tracker:
        observer = on_anomaly = None
        if self.settings.journal is not None:
            from ..replay import JsonlJournal

            folder = Path(self.settings.journal)
            folder.mkdir(parents=True, exist_ok=True)
            journal = JsonlJournal(folder / f"{spec.name}-{os.getpid()}.jsonl", machine=spec.name)
            self.journals.append(journal)
            observer, on_anomaly = journal, journal.anomaly
        tracker = Tracker(
            spec,
            holds,
            clock=self.clock,
            params=params,
            observer=observer,
            on_anomaly=on_anomaly,
            threadsafe=threadsafe,
        )
        if observer is not None:
            observer.attach(tracker)  # the header records the params the watch runs with, for kvfsm replay
        return tracker

    @staticmethod
    def _dead_states(spec: Spec) -> frozenset[str]:
        """The states a deadline of the spec leads to that still hold something: where a request is reported dead."""
        timed = {s.timeout.fire for s in spec.states.values() if s.timeout is not None and s.holds}
        return frozenset(
            t.target for t in spec.transitions if t.event in timed and spec.states[t.target].holds
        ) - frozenset(s.name for s in spec.states.values() if s.initial)

    def _register_metrics(self) -> None:
        try:
            from ..observe.metrics import TrackerMetrics
        except ImportError:
            LOGGER.warning("kvfsm watch: metrics asked for but prometheus_client is not installed (kvfsm[metrics])")
            return
        for tracker in (self.send, self.load):
            try:
                self.metrics.append(TrackerMetrics(tracker, name=f"{self.connector}-{os.getpid()}-{id(self):x}"))
            except ValueError as exc:
                LOGGER.warning("kvfsm watch: metrics of %s not registered: %s", tracker.spec.name, exc)

    @staticmethod
    def _key_function(settings: WatchSettings) -> Callable[[str], Hashable | None]:
        hash_ids, sample = settings.hash_ids, settings.sample
        if sample >= 1.0:
            return hash_id if hash_ids else _same
        cut = int(sample * 2**32)

        def sampled(request_id: str) -> Hashable | None:
            if zlib.crc32(request_id.encode()) >= cut:
                return None
            return hash_id(request_id) if hash_ids else request_id

        return sampled

    # -- what the scheduler's calls tell ---------------------------------------------------

    def matched(self, request_id: str, tokens: int | None, load_async: bool) -> None:
        """``get_num_new_matched_tokens`` answered ``(tokens, load_async)``."""
        key = self._key(request_id)
        if key is None:
            return
        load = self.load
        state = load.state(key)
        if tokens and load_async:
            if state is None:
                load.begin(key)
            elif load.accepts(key, "match"):
                load.fire(key, "match")
            elif state not in load.spec.live:
                self._retire()
                load.begin(key)
        elif tokens is not None and state is not None and load.accepts(key, "skip"):
            load.fire(key, "skip")  # asked again, and this time no asynchronous load

    def allocated(self, request_id: str, block_ids: Iterable[Iterable[int]], external_tokens: int) -> None:
        """``update_state_after_alloc(request, blocks, external_tokens)`` returned."""
        key = self._key(request_id)
        if key is None or not self.load.accepts(key, "alloc"):
            return
        if external_tokens > 0:
            blocks = {b for group in block_ids for b in group}
            self._load_holds.held[key] = (len(blocks), self.clock())
            self._load_blocks[key] = blocks
            self.load.fire(key, "alloc")
        else:
            self.load.fire(key, "skip")

    def finished(self, request_id: str, block_ids: Iterable[Iterable[int]], delay_free: bool) -> None:
        """``request_finished`` (or ``request_finished_all_groups``) returned ``delay_free``."""
        key = self._key(request_id)
        if key is None:
            return
        if self.load.accepts(key, "finish"):
            self.load.fire(key, "finish")
        if delay_free:
            send = self.send
            state = send.state(key)
            if state is not None and state not in send.spec.live:
                self._retire()
            blocks = sum(1 for group in block_ids for _ in group)
            self._send_holds.held[key] = (blocks, self.clock())
            send.begin(key)

    def output(
        self, finished_sending: Iterable[str] | None, finished_recving: Iterable[str] | None, invalid: Iterable[int]
    ) -> None:
        """``update_connector_output(output)`` returned: what the worker reported, as vLLM will act on it."""
        key = self._key
        if finished_sending:
            self._fire_many(self.send, "sent", [k for k in map(key, finished_sending) if k is not None])
        if invalid:
            bad = set(invalid)
            hit = [k for k, blocks in self._load_blocks.items() if not bad.isdisjoint(blocks)]
            live = self.load.spec.live
            self._fire_many(self.load, "invalid", [k for k in hit if self.load.state(k) in live])
        if finished_recving:
            self._fire_many(self.load, "recved", [k for k in map(key, finished_recving) if k is not None])

    def _fire_many(self, tracker: Tracker, event: str, keys: list[Hashable]) -> None:
        if not keys:
            return
        try:
            tracker.fire_many(event, keys)
        except ActionError as exc:  # an event the state neither takes nor ignores: the connector broke the contract
            self.violations[f"{tracker.spec.name}:{event}"] += 1
            LOGGER.warning("kvfsm watch [%s]: %s", self.connector, exc)

    # -- once per step -----------------------------------------------------------------------

    def step(self) -> None:
        """Once per scheduler step (``build_connector_meta``): fire due deadlines, check for stuck requests, drain."""
        now = self.clock()
        self.send.poll(now)
        self.load.poll(now)
        if now >= self._next_check:
            self._next_check = now + self.settings.check_every
            self.check(now)
        self._retire()

    def check(self, now: float | None = None) -> list[StuckReport]:
        """Report every request newly found slow or dead (logged on ``kvfsm.watch``); returns the new reports."""
        now = self.clock() if now is None else now
        found: list[StuckReport] = []
        for watch, holds, dead, deadline in self._stuck:
            machine = watch.tracker.spec.name
            for key, state, _seconds in watch.check(now):
                blocks, since = holds.held.get(key, (0, now))
                report = StuckReport(
                    machine=machine,
                    request=key,
                    state=state,
                    verdict="dead" if state in dead else "slow",
                    age=now - since,
                    deadline=deadline,
                    holds=tuple(watch.tracker.spec.states[state].holds),
                    blocks=blocks,
                )
                found.append(report)
                self.reports.append(report)
                LOGGER.warning("%s", report.line(self.connector))
        return found

    def _retire(self) -> None:
        for tracker in (self.send, self.load):
            for _key, final in tracker.finished():
                self.outcomes[tracker.spec.name, final] += 1
        blocks = self._load_blocks
        if blocks:
            held = self._load_holds.held
            for k in [k for k in blocks if k not in held]:
                del blocks[k]

    # -- what it tells ------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Outcomes per machine and final state, what is live (by state), violations, and the latest findings."""
        self._retire()
        return {
            "outcomes": {f"{m}:{s}": n for (m, s), n in sorted(self.outcomes.items())},
            "live": {
                t.spec.name: {s: n for s, n in t.census().items() if n and s in t.spec.live}
                for t in (self.send, self.load)
            },
            "held": sum(len(h.held) for h in (self._send_holds, self._load_holds)),
            "anomalies": {t.spec.name: {k: n for k, n in t.counts.items() if n} for t in (self.send, self.load)},
            "violations": dict(self.violations),
            "stuck": [r.__dict__ | {"request": str(r.request)} for r in list(self.reports)[-20:]],
        }

    def dump(self, limit: int = 10) -> dict[str, Any]:
        """``kvfsm.observe.state_dump`` of both trackers."""
        from ..observe import state_dump

        return {t.spec.name: state_dump(t, limit=limit) for t in (self.send, self.load)}

    def close(self) -> dict[str, Any]:
        """Shut down: what was still held is reported (``closed``), journals flushed, the endpoint closed."""
        for tracker in (self.send, self.load):
            live = {s: n for s, n in tracker.census().items() if n and s in tracker.spec.live}
            if live:
                LOGGER.warning("kvfsm watch [%s]: at shutdown %s still had %s", self.connector, tracker.spec.name, live)
            tracker.close()
        summary = self.summary()
        for journal in self.journals:
            journal.close()
        if self.server is not None:
            self.server.close()
        return summary


def _same(request_id: str) -> Hashable | None:
    return request_id
