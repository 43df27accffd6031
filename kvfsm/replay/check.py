"""Check a transition journal against its spec: where a real deployment left the declared lifecycle.

The checker replays the log line by line and keeps, for every instance, the
state its last line put it in. What the machine allows it asks the spec model
once, at the start, and nowhere else: the transition ``table`` (wildcards
expanded), the legal no-ops (``ignores``), what each state holds
(``holds()``), the initial and final states, each state's timeout and each
phase's with its param resolved (``param()``), and which phases a move enters
and leaves (``phase_moves()``). Every result is a :class:`~kvfsm.spec.Finding`
with a KVF3xx code (:mod:`kvfsm.replay.codes`), in the order a line is judged:

- a log that cannot be read past some line (KVF300), a line that is not a
  journal line (KVF301), a last line cut short (KVF302);
- a session header of another machine (KVF303);
- events for keys with no instance (KVF304), a ``begin`` for a key that is
  still live (KVF305), generations that disagree with the instance's or do not
  increase at ``begin`` (KVF306);
- a ``from`` that is not the state the instance was in (KVF307), an event that
  is not a transition from ``from`` (KVF308; an *ignored* event is one too: the
  Tracker never logs no-ops), a ``to`` that is not the transition's target
  (KVF309);
- a state with a timeout held longer than its ``after`` plus a tolerance
  (KVF310), whether the instance left it late or never left it before the log
  ends; likewise a phase (``phases:``), timed from the line that entered it:
  moves among its states and self-loops do not restart it;
- time that runs backwards (KVF311: a tracker's clock is monotonic);
- instances that end the log (or a session, when the log restarts) in a state
  that holds resources (KVF312).

Each line gets at most one finding, the first of the list above that it shows;
after it the checker believes the line (the instance is now in its ``to``, the
clock reads its ``time``), so one missing or edited line is reported once, not
on every later line of the instance. No input makes the checker raise: bytes
that are not a journal line are a finding at their line, and the lines after
them are checked.
"""

from __future__ import annotations

import os
import re
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ..errors import BindingError
from ..spec import Finding, Spec, load
from ..spec.model import Edge
from . import codes
from .read import MAX_LINE, STOPS, log_lines, why_stopped
from .record import BEGIN, AnomalyLine, Header, Record

DEFAULT_TOLERANCE = 1.0
"""Seconds a deadline may be overrun before it counts: time is stamped after a transition's actions
run, and a poll loop fires timeouts at its own pace."""

KEEP = 1000
"""Findings kept in a :class:`LogReport` (all are counted)."""

RECENT_FINALS = 100_000
"""Finished instances remembered, so a late line for one is judged against its final state; older
ones are forgotten (a line for them then reads as an unknown instance) to keep memory bounded."""

KEY_DEPTH = 32
"""Deepest nesting of arrays and objects accepted in a key. Tracker keys are ids, tuples of ids or
small dataclasses; a bound keeps every later step on a key (hashing, quoting) shallow."""

SHOWN = 80
"""Most characters of a value from the log quoted in a message, so a huge field cannot bloat a report."""

UNDECODABLE: tuple[type[BaseException], ...] = (msgspec.MsgspecError, ValueError, RecursionError)
"""What decoding arbitrary bytes can raise: msgspec's errors, UnicodeDecodeError (a ValueError) for a
string that is not UTF-8, RecursionError for nesting deeper than the decoder can follow."""

_AT_BYTE = re.compile(r"\(byte (\d+)\)")


@dataclass(frozen=True, slots=True)
class LogReport:
    """What checking one log found; ``conforms`` when nothing was found."""

    path: str
    machine: str
    lines: int
    """Lines read, blank and malformed ones included."""
    records: int
    """Transition lines (``begin`` included) that decoded."""
    instances: int
    """``begin`` lines."""
    sessions: int
    """Tracker runs in the log: one per header line (or one, for a log without headers)."""
    live: int
    """Instances not in a final state when the log ends."""
    findings: tuple[Finding, ...]
    """The first :data:`KEEP` findings, in the order the log shows them."""
    total: int
    """Every finding, kept or not."""
    by_code: Mapping[str, int] = field(default_factory=dict)
    outcomes: Mapping[str, int] = field(default_factory=dict)
    """Instances that reached each final state: the outcome mix (expired apart from failed)."""
    anomalies: Mapping[str, int] = field(default_factory=dict)
    """Anomaly lines by kind (unknown, late, stale, forced)."""
    """How many findings of each KVF3xx code, kept or not."""

    @property
    def conforms(self) -> bool:
        return self.total == 0

    @property
    def first(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def as_dict(self) -> dict[str, Any]:
        """The report as plain data; ``findings`` in the shape ``kvfsm check --format json`` prints them."""
        return {
            "path": self.path,
            "machine": self.machine,
            "lines": self.lines,
            "records": self.records,
            "instances": self.instances,
            "sessions": self.sessions,
            "live": self.live,
            "conforms": self.conforms,
            "total": self.total,
            "by_code": dict(self.by_code),
            "findings": [f.as_dict() for f in self.findings],
        }


class _Instance:
    """What the log has said about one instance so far."""

    __slots__ = ("begun", "due", "generation", "key", "line", "phases", "since", "state")

    def __init__(self, key: Any, generation: int, state: str, line: int) -> None:
        self.key = key
        self.generation = generation
        self.state = state
        self.begun = line
        self.line = line
        """The line that put it in ``state``."""
        self.since = 0.0
        """When it entered ``state``."""
        self.due: float | None = None
        """When ``state``'s timeout was due (entry time + after), or None."""
        self.phases: dict[str, tuple[float, float, int]] = {}
        """Phase → (due, when the instance entered it, the line that entered it), while it is in the phase and
        its deadline has not fired."""


class _KeyTooDeep(Exception):
    """A key nested deeper than :data:`KEY_DEPTH`."""


_NOT_A_LINE: tuple[type[BaseException], ...] = (*UNDECODABLE, _KeyTooDeep)
"""Everything that makes a line no journal line, caught where the line is read."""


def _hashable(value: Any, depth: int = 0) -> Hashable:
    """A JSON value as a dict key: arrays become tuples (a tuple key is logged as an array), objects frozensets."""
    if isinstance(value, list):
        if depth >= KEY_DEPTH:
            raise _KeyTooDeep
        return tuple(_hashable(v, depth + 1) for v in value)
    if isinstance(value, dict):
        if depth >= KEY_DEPTH:
            raise _KeyTooDeep
        return frozenset((k, _hashable(v, depth + 1)) for k, v in value.items())
    return value  # type: ignore[no-any-return]


def _clip(text: str) -> str:
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}…({len(text)} characters)"


def _q(text: str) -> str:
    """A name from the log, quoted like ``repr`` and clipped to :data:`SHOWN` characters."""
    return _clip(repr(text))


def _show(key: Any) -> str:
    """``key "req-7"`` or ``key 7``: as logged, so a string key and a number stay apart."""
    return f"key {_clip(msgspec.json.encode(key).decode())}"


def _t(seconds: float) -> str:
    return f"{seconds:.3f}"


def _not_a_line(raw: bytes, exc: BaseException) -> tuple[str, int]:
    """Why ``raw`` did not decode (one of :data:`UNDECODABLE`, or a key too deep), and the column to point at."""
    if isinstance(exc, _KeyTooDeep):
        return f"its key is nested more than {KEY_DEPTH} levels deep, deeper than any key a tracker logs", 1
    if isinstance(exc, RecursionError):
        return "its JSON is nested too deeply to read", 1
    if isinstance(exc, UnicodeDecodeError):
        try:
            raw.decode()
        except UnicodeDecodeError as bad:
            return f"byte 0x{raw[bad.start]:02x} at column {bad.start + 1} is not UTF-8, which JSON text must be", (
                bad.start + 1
            )
        return f"it is not UTF-8 ({exc})", 1
    at = _AT_BYTE.search(str(exc))
    return _clip(str(exc)), int(at.group(1)) + 1 if at else 1


class LogChecker:
    """Feed it a journal's lines in order (:meth:`feed`), then :meth:`finish`; see the module docstring.

    ``params`` override the spec's, as a deployment's ``Tracker(params=...)``
    did; ``tolerance`` is the slack in seconds before a deadline counts as
    overrun; ``allow_live`` accepts instances still holding resources at the end
    (a log cut from a running process).
    """

    def __init__(
        self,
        spec: Spec,
        *,
        path: str = "<log>",
        params: Mapping[str, float] | None = None,
        tolerance: float = DEFAULT_TOLERANCE,
        allow_live: bool = False,
        keep: int = KEEP,
    ) -> None:
        params = dict(params or {})
        problems = spec.param_problems(params)
        if problems:
            raise BindingError("; ".join(problems))
        self.spec = spec
        self.path = path
        self.tolerance = tolerance
        self.allow_live = allow_live
        self._keep = keep
        # What the machine allows, asked of the spec model here and only here.
        self._edges: Mapping[tuple[str, str], Edge] = spec.table
        self._ignored = spec.ignores
        self._timeouts: dict[str, tuple[float, str, str | None]] = {}
        """state -> (seconds, the event it fires, the param that sets it or None)."""
        for name, state in spec.states.items():
            if state.timeout is not None:
                after = state.timeout.after
                param = after if isinstance(after, str) else None
                self._timeouts[name] = (spec.param(after, params), state.timeout.fire, param)
        self._phases: dict[str, tuple[float, str, str | None]] = {}
        """phase -> (seconds, the event it fires, the param that sets it or None), in declaration order."""
        for name, phase in spec.phases.items():
            after = phase.timeout.after
            self._phases[name] = (
                spec.param(after, params),
                phase.timeout.fire,
                after if isinstance(after, str) else None,
            )
        self._on_error = spec.on_error
        self._finals = frozenset(spec.finals)
        self._initial = spec.initial.name
        # What the log has said so far.
        self._records = msgspec.json.Decoder(Record)
        self._headers = msgspec.json.Decoder(Header)
        self._anomaly_lines = msgspec.json.Decoder(AnomalyLine)
        self._outcomes: Counter[str] = Counter({name: 0 for name in spec.finals})
        self._anomalies: Counter[str] = Counter()
        self._findings: list[Finding] = []
        self._by_code: Counter[str] = Counter()
        self._reported = 0
        """The last line a finding was reported for (each line gets at most one)."""
        self._line = 0
        self._nrecords = 0
        self._ninstances = 0
        self._sessions = 0
        self._open = False
        self._live: dict[Hashable, _Instance] = {}
        self._done: deque[tuple[Hashable, _Instance]] = deque()
        self._time: float | None = None
        self._time_line = 0
        self._generation: int | None = None
        self._generation_line = 0
        self._left_live = 0

    # -- input -----------------------------------------------------------------------

    def feed(self, raw: bytes) -> None:
        """Check the next line (as read, newline included if it had one); any bytes at all.

        A line longer than :data:`~kvfsm.replay.read.MAX_LINE` is reported by its length and not decoded (the
        reader hands on only its head: see :func:`~kvfsm.replay.read.bounded_lines`).
        """
        self._line += 1
        if len(raw) > MAX_LINE:
            self._overlong()
            return
        if not raw.strip():
            return
        try:
            line = self._decode(raw)
            key: Hashable = None
            if type(line) is Record:
                key = line.key
                if type(key) is not str and type(key) is not int:  # the common keys need no conversion
                    key = _hashable(key)
        except _NOT_A_LINE as exc:
            self._malformed(raw, exc)
            return
        if isinstance(line, Header):
            self._session(line)
            return
        if isinstance(line, AnomalyLine):
            self._anomalies[line.anomaly] += 1
            return
        self._nrecords += 1
        if not self._open:
            self._sessions += 1
            self._open = True
        if line.from_ == "":
            self._begin(line, key)
        else:
            self._step(line, key)
        self._clock(line)

    @property
    def lines(self) -> int:
        """Lines fed so far."""
        return self._line

    @property
    def truncated(self) -> bool:
        """Whether the log was found cut short."""
        return self._by_code[codes.TRUNCATED] > 0

    def cut(self, line: int, message: str) -> None:
        """The log ends abruptly at ``line`` (a truncated file or stream): ``message`` says how."""
        self._report(
            codes.TRUNCATED,
            line,
            f"{message}: the transitions after this point are missing",
            "The log was truncated, or is still being written (--allow-live accepts what its tail would release).",
        )

    def unreadable(self, line: int, message: str) -> None:
        """Reading the log stopped at ``line`` for a reason other than its end: ``message`` says which."""
        self._report(
            codes.UNREADABLE,
            line,
            f"{message}: reading stopped, so nothing from this line on is checked",
            "Recover the readable part (gzip -dc LOG > part.jsonl) and check that, or check an intact copy.",
        )

    def finish(self) -> LogReport:
        """End of the log: report what it leaves live, and return everything found."""
        self._end_session(None)
        return LogReport(
            path=self.path,
            machine=self.spec.name,
            lines=self._line,
            records=self._nrecords,
            instances=self._ninstances,
            sessions=self._sessions,
            live=self._left_live,
            findings=tuple(self._findings),
            total=sum(self._by_code.values()),
            by_code=dict(self._by_code),
            outcomes=dict(self._outcomes),
            anomalies=dict(self._anomalies),
        )

    def limit(self, limits: Mapping[str, Limit]) -> None:
        """Report every outcome (final state) or anomaly kind more frequent than its limit allows."""
        finished = sum(self._outcomes.values())
        for name, cap in limits.items():
            count = self._outcomes.get(name, self._anomalies.get(name, 0))
            share = count / finished if finished else 0.0
            over = share > cap.value if cap.share else count > cap.value
            if over:
                seen = f"{count} of {finished} finished ({share:.1%})" if name in self._outcomes else f"{count}"
                self._report(
                    codes.OVER_LIMIT,
                    self._line,
                    f"{name}: {seen}, above the limit --max {name}={cap}",
                    "An expiry or anomaly storm: look at what the peers did (a lost notification, a wrong id space), "
                    "or raise the limit if this mix is expected.",
                )

    # -- one line --------------------------------------------------------------------

    def _decode(self, raw: bytes) -> Record | Header | AnomalyLine:
        try:
            return self._records.decode(raw)
        except msgspec.ValidationError as exc:
            for other in (self._headers, self._anomaly_lines):
                try:
                    line: Header | AnomalyLine = other.decode(raw)
                except msgspec.ValidationError:
                    continue
                return line
            raise exc from None

    def _overlong(self) -> None:
        self._report(
            codes.MALFORMED,
            self._line,
            f"not a journal line: it is longer than {MAX_LINE >> 20} MiB, and a journal line is a few hundred bytes; "
            "it is skipped unread, so what it recorded is missing from the check",
            "Each line is one JSON object with key, generation, event, from, to and time, as JsonlJournal writes "
            "it: was something else (a binary, a dump) written into the log?",
        )

    def _malformed(self, raw: bytes, exc: BaseException) -> None:
        why, col = _not_a_line(raw, exc)
        if not raw.endswith(b"\n"):
            self.cut(self._line, f"the last line is cut short ({why}) and has no newline")
            return
        self._report(
            codes.MALFORMED,
            self._line,
            f"not a journal line: {why}; it is skipped, so what it recorded is missing from the check",
            "Each line is one JSON object with key, generation, event, from, to and time, as JsonlJournal "
            "writes it: was the file edited, or written by something else too?",
            col=col,
        )

    def _session(self, header: Header) -> None:
        """A header: a tracker (re)started writing here; what the previous run left live is judged now."""
        if self._open:
            self._end_session(self._line)
        self._sessions += 1
        self._open = True
        self._live.clear()
        self._done.clear()
        self._time = self._generation = None
        if header.machine is not None and header.machine != self.spec.name:
            self._report(
                codes.WRONG_MACHINE,
                self._line,
                f"this log was written by a tracker of machine {_q(header.machine)}, not {self.spec.name!r}: "
                "its lines will not match this spec's transitions",
                "Check the log against the spec its tracker ran.",
            )

    def _begin(self, rec: Record, key: Hashable) -> None:
        n = self._line
        if rec.event != BEGIN:
            self._report(
                codes.MALFORMED,
                n,
                f"not a journal line: an empty 'from' starts an instance, but its event is {_q(rec.event)}, "
                "not 'begin'; it is skipped",
                "Only begin lines have an empty 'from'; every other line names the state the instance left.",
            )
            return
        old = self._live.get(key)
        if old is not None and old.state not in self._finals:
            self._report(
                codes.DUPLICATE_BEGIN,
                n,
                f"begin for {_show(rec.key)} while its instance from line {old.line} (generation "
                f"{old.generation}) is still live in {old.state!r}: what that instance held is never "
                "released in this log",
                "The Tracker refuses begin for a live key, so a line that finished the earlier instance is "
                "missing, or two trackers wrote this log.",
            )
        if self._generation is not None and rec.generation <= self._generation:
            self._report(
                codes.GENERATION,
                n,
                f"begin for {_show(rec.key)} has generation {rec.generation}, not above {self._generation} "
                f"of the begin at line {self._generation_line}: late events could be applied to the wrong "
                "instance",
                "A tracker numbers instances in begin order, so this line is out of order, duplicated, or "
                "from another tracker.",
            )
        if self._generation is None or rec.generation > self._generation:
            self._generation, self._generation_line = rec.generation, n
        if rec.to != self._initial:
            self._report(
                codes.WRONG_TARGET,
                n,
                f"begin for {_show(rec.key)} entered {_q(rec.to)}, but the initial state of "
                f"{self.spec.name!r} is {self._initial!r}: the instance started outside the declared lifecycle",
                "Check the log against the spec its tracker ran.",
            )
        self._ninstances += 1
        self._enter(key, _Instance(rec.key, rec.generation, rec.to, n), rec.time, None)

    def _step(self, rec: Record, key: Hashable) -> None:
        n, src, event = self._line, rec.from_, rec.event
        who = f"{_q(event)} for {_show(rec.key)}"
        inst = self._live.get(key)
        if inst is None:
            self._report(
                codes.UNKNOWN_INSTANCE,
                n,
                f"{who} ({_clip(src)} → {_clip(rec.to)}) has no instance: no begin line for it"
                + (" since the log restarted" if self._sessions > 1 else "")
                + ", so what it acquired is not accounted for",
                "A log must start where its tracker started; was its head cut off or rotated away?",
            )
            inst = _Instance(rec.key, rec.generation, src, n)
        elif rec.generation != inst.generation:
            self._report(
                codes.GENERATION,
                n,
                f"{who} carries generation {rec.generation}, but the instance begun at line {inst.begun} "
                f"is generation {inst.generation}: an event of another instance was applied to this one",
                "Events of a finished generation are never applied by the Tracker; the log mixes instances.",
            )
        if src != inst.state:
            self._report(
                codes.WRONG_SOURCE,
                n,
                f"{who} leaves {_q(src)}, but the instance is in {inst.state!r} (since line {inst.line}): "
                "a transition in between is unaccounted for",
                "A transition line is missing or out of order before this one.",
            )
            inst.due = None  # when it entered src is unknown: no deadline to judge
            inst.phases.clear()  # nor when it entered the phases src is in
        edge = self._edges.get((src, event))
        if edge is None:
            self._report(
                codes.ILLEGAL,
                n,
                f"{who} in {_q(src)}: {self._why_illegal(src, event)}",
                "A Tracker logs only transitions its spec has: is this the spec the tracker ran?",
            )
        elif edge.target != rec.to:
            loc = edge.transition.loc
            self._report(
                codes.WRONG_TARGET,
                n,
                f"{who} went from {src!r} to {_q(rec.to)}, but the spec's transition ({loc.path}:{loc.line}) goes "
                f"to {edge.target!r}: the instance now holds what {_q(rec.to)} holds, not what the spec says",
                "Check the log against the spec its tracker ran.",
            )
        if inst.due is not None and rec.time > inst.due + self.tolerance:
            self._overrun(inst, rec.time, n, f"to t={_t(rec.time)}", once=True)
        else:
            late = self._late_phase(inst, rec.time)
            if late is not None:
                self._phase_overrun(inst, late, rec.time, n, f"to t={_t(rec.time)}", once=True)
        if event == self._on_error and inst.phases:
            self._spent(inst, rec)
        inst.state, inst.line = rec.to, n
        self._enter(key, inst, rec.time, src)

    def _late_phase(self, inst: _Instance, now: float) -> str | None:
        """The first phase (in declaration order) whose deadline ``inst`` is past at ``now``, beyond the tolerance."""
        return next((p for p, (due, _since, _line) in inst.phases.items() if now > due + self.tolerance), None)

    def _spent(self, inst: _Instance, rec: Record) -> None:
        """An ``on_error`` line at or after a phase's deadline that keeps the instance in the phase: the deadline
        fired and its transition's action raised (the Tracker then took on_error), so it fired once and is gone."""
        kept = set(self.spec.phases_of(rec.from_)) & set(self.spec.phases_of(rec.to))
        for phase, (due, _since, _line) in list(inst.phases.items()):
            if rec.time >= due and phase in kept:
                del inst.phases[phase]

    def _enter(self, key: Hashable, inst: _Instance, now: float, source: str | None) -> None:
        """``inst`` has just moved from ``source`` (None: begun) to ``inst.state`` at ``now``: arm its deadline and
        those of the phases it entered, disarm those of the phases it left, retire it if final."""
        inst.since = now
        timeout = self._timeouts.get(inst.state)
        inst.due = now + timeout[0] if timeout is not None else None
        if self._phases:
            entered, left = self.spec.phase_moves(source, inst.state)
            for phase in left:
                inst.phases.pop(phase, None)
            for phase in entered:
                inst.phases[phase] = (now + self._phases[phase][0], now, self._line)
        self._live[key] = inst
        if inst.state in self._finals:
            self._outcomes[inst.state] += 1
            done = self._done
            done.append((key, inst))
            if len(done) > RECENT_FINALS:
                old_key, old = done.popleft()
                if self._live.get(old_key) is old and old.state in self._finals:
                    del self._live[old_key]

    def _clock(self, rec: Record) -> None:
        last = self._time
        if last is not None and rec.time < last:
            self._report(
                codes.TIME_BACKWARDS,
                self._line,
                f"time runs backwards: t={_t(rec.time)} after t={_t(last)} at line {self._time_line}, so the "
                "deadlines judged around it are measured on a broken clock",
                "A tracker's clock is monotonic, so lines are out of order or from two trackers.",
            )
        self._time, self._time_line = rec.time, self._line

    # -- the end of a session -------------------------------------------------------------

    def _end_session(self, restart: int | None) -> None:
        """Judge the instances a session leaves live: at the end of the log, or at a restart (a header)."""
        live = sorted((i for i in self._live.values() if i.state not in self._finals), key=lambda i: i.line)
        self._left_live = len(live)
        end = "the end of the log" if restart is None else f"the restart at line {restart}"
        for inst in live:
            if inst.due is not None and self._time is not None and self._time > inst.due + self.tolerance:
                self._overrun(
                    inst, self._time, inst.line, f"and is still there at {end} (t={_t(self._time)})", once=False
                )
                continue
            late = self._late_phase(inst, self._time) if self._time is not None else None
            if late is not None and self._time is not None:
                line = inst.phases[late][2]
                self._phase_overrun(
                    inst, late, self._time, line, f"and is still in it at {end} (t={_t(self._time)})", once=False
                )
                continue
            holds = self.spec.holds(inst.state)
            if holds and not self.allow_live:
                self._report(
                    codes.UNRELEASED,
                    inst.line,
                    f"{_show(inst.key)} ends in {inst.state!r} holding {', '.join(holds)} at {end}: no line "
                    "releases them, so they stay held (a leak)",
                    "A path that leaves this state is missing, or the log was cut while the process ran "
                    "(--allow-live accepts that).",
                    once=False,
                )

    # -- reporting ---------------------------------------------------------------------

    def _overrun(self, inst: _Instance, now: float, line: int, until: str, *, once: bool) -> None:
        seconds, fire, param = self._timeouts[inst.state]
        assert inst.due is not None, "only instances with an armed deadline overrun"
        after = f"{param}={seconds:g}s" if param is not None else f"{seconds:g}s"
        fix = "Is the poll loop stalled or slow?"
        if param is not None:
            fix += f" A deployment that overrides {param} is checked with --param {param}=SECONDS."
        self._report(
            codes.OVERRUN,
            line,
            f"{_show(inst.key)} stayed in {inst.state!r} from t={_t(inst.since)} (line {inst.line}) {until}, "
            f"{_t(now - inst.due)}s past its deadline ({after}): {fire!r} was due at t={_t(inst.due)}, and what "
            f"{inst.state!r} holds stayed pinned that long",
            f"{fix} --tolerance (now {self.tolerance:g}s) widens the slack.",
            once=once,
        )

    def _phase_overrun(self, inst: _Instance, phase: str, now: float, line: int, until: str, *, once: bool) -> None:
        seconds, fire, param = self._phases[phase]
        due, since, entered = inst.phases[phase]
        after = f"{param}={seconds:g}s" if param is not None else f"{seconds:g}s"
        fix = "Is the poll loop stalled or slow?"
        if param is not None:
            fix += f" A deployment that overrides {param} is checked with --param {param}=SECONDS."
        states = ", ".join(s for s in self.spec.states if s in self.spec.phase_states[phase])
        self._report(
            codes.OVERRUN,
            line,
            f"{_show(inst.key)} stayed in phase {phase!r} ({states}) from t={_t(since)} (line {entered}) {until}, "
            f"{_t(now - due)}s past its deadline ({after}): {fire!r} was due at t={_t(due)}, measured from "
            f"entering the phase (moves inside it and self-loops do not restart it), and what it holds stayed "
            "pinned that long",
            f"{fix} --tolerance (now {self.tolerance:g}s) widens the slack.",
            once=once,
        )

    def _why_illegal(self, src: str, event: str) -> str:
        if src not in self.spec.states:
            return f"{_q(src)} is not a state of {self.spec.name!r} (states: {', '.join(self.spec.states)})"
        if (src, event) in self._ignored:
            return "the event is ignored there, a legal no-op, which the Tracker never logs"
        accepted = ", ".join(e for s, e in self._edges if s == src) or "nothing"  # a finding's cost only
        return f"not a transition of {self.spec.name!r}; {src!r} accepts {accepted}"

    def _report(self, code: str, line: int, message: str, fix: str, *, col: int = 1, once: bool = True) -> None:
        if once:
            if self._reported == line:
                return
            self._reported = line
        self._by_code[code] += 1
        if len(self._findings) < self._keep:
            self._findings.append(Finding(code, "error", self.path, line, message, fix, col))


@dataclass(frozen=True)
class Limit:
    """``--max NAME=VALUE``: at most ``value`` occurrences, or with ``share`` at most that fraction of finished."""

    value: float
    share: bool = False

    def __str__(self) -> str:
        return f"{self.value * 100:g}%" if self.share else f"{self.value:g}"

    @classmethod
    def parse(cls, text: str) -> Limit:
        """``"1%"`` or ``"0"``; raises ValueError saying what was expected."""
        share = text.endswith("%")
        try:
            value = float(text[:-1] if share else text)
        except ValueError:
            raise ValueError(f"limit {text!r} is not a count (0, 12) or a share (1%, 0.5%)") from None
        if value < 0 or value != value:
            raise ValueError(f"limit {text!r} must be zero or more")
        return cls(value / 100 if share else value, share)


def check_log(
    spec: Spec | str | os.PathLike[str],
    log: str | os.PathLike[str] | Iterable[bytes],
    *,
    name: str | None = None,
    params: Mapping[str, float] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    allow_live: bool = False,
    keep: int = KEEP,
    limits: Mapping[str, Limit] | None = None,
) -> LogReport:
    """Check a journal (a path or binary stream, plain or gzip, or an iterable of byte lines) against ``spec``.

    Raises OSError when a log path cannot be opened (a log that stops being
    readable partway is a KVF300 finding instead), :class:`~kvfsm.SpecError`
    for a spec path that does not load, and :class:`~kvfsm.BindingError` for
    params the spec does not declare.
    """
    if not isinstance(spec, Spec):
        spec = load(Path(spec))
    if name is None:
        name = str(log) if isinstance(log, str | os.PathLike) else str(getattr(log, "name", "<stream>"))
    checker = LogChecker(spec, path=name, params=params, tolerance=tolerance, allow_live=allow_live, keep=keep)
    with log_lines(log) as lines:
        try:
            for raw in lines:
                checker.feed(raw)
        except STOPS as exc:  # raised by the reading, never by feed()
            stop = why_stopped(exc)
            if stop.cut and not checker.truncated:
                checker.cut(checker.lines + 1, stop.why)
            elif not stop.cut:
                checker.unreadable(checker.lines + 1, stop.why)
    if limits:
        checker.limit(limits)
    return checker.finish()
