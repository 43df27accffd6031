"""Check a transition journal against its spec: where a real deployment left the declared lifecycle.

The checker replays the log line by line on the spec model's own semantics
(``edges()``, ``ignored()``, ``holds()``, the states' timeouts and the params),
keeping for every instance the state its last line put it in, and reports:

- lines that are not journal lines (bad JSON, missing fields, wrong types), and
  a last line cut short;
- events for keys with no instance, a ``begin`` for a key that is still live,
  generations that disagree with the instance's or do not increase at ``begin``;
- a ``from`` that is not the state the instance was in, an event that is not a
  transition from ``from`` (an *ignored* event is one too: the Tracker never
  logs no-ops), a ``to`` that is not the transition's target;
- a state with a timeout held longer than its ``after`` plus a tolerance,
  whether the instance left it late or never left it before the log ends;
- instances that end the log (or a session, when the log restarts) in a state
  that holds resources;
- time that runs backwards (a tracker's clock is monotonic).

Each line gets at most one divergence, the first of the list above that it
shows; after it the checker believes the line (the instance is now in its
``to``), so one missing or edited line is reported once, not on every later
line of the instance.
"""

from __future__ import annotations

import gzip
import os
from collections import Counter, deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from ..errors import BindingError
from ..spec import Spec, load
from ..spec.model import Edge
from .record import BEGIN, Header, Record

DivergenceKind = Literal[
    "malformed",
    "truncated",
    "machine",
    "unknown-instance",
    "duplicate-begin",
    "generation",
    "wrong-source",
    "illegal",
    "wrong-target",
    "overrun",
    "time-backwards",
    "unreleased",
]

DEFAULT_TOLERANCE = 1.0
"""Seconds a deadline may be overrun before it counts: time is stamped after a transition's actions
run, and a poll loop fires timeouts at its own pace."""

KEEP = 1000
"""Divergences kept in a :class:`Replay` (all are counted)."""

RECENT_FINALS = 100_000
"""Finished instances remembered, so a late line for one is judged against its final state; older
ones are forgotten (a line for them then reads as an unknown instance) to keep memory bounded."""


@dataclass(frozen=True, slots=True)
class Divergence:
    """One place the log leaves the spec: which line, what is wrong, and what to look at."""

    kind: DivergenceKind
    path: str
    line: int
    message: str
    fix: str = ""
    key: Any = None
    """The instance's key as the log wrote it (a JSON value), or None for a line with no usable key."""

    def __str__(self) -> str:
        text = f"{self.path}:{self.line}: {self.message} ({self.kind})."
        return f"{text} {self.fix}" if self.fix else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Replay:
    """What checking one log found; ``conforms`` when nothing diverged."""

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
    divergences: tuple[Divergence, ...]
    """The first :data:`KEEP` divergences, in the order the log shows them."""
    total: int
    """Every divergence, kept or not."""
    by_kind: Mapping[str, int] = field(default_factory=dict)

    @property
    def conforms(self) -> bool:
        return self.total == 0

    @property
    def first(self) -> Divergence | None:
        return self.divergences[0] if self.divergences else None

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["divergences"] = [d.as_dict() for d in self.divergences]
        doc["by_kind"] = dict(self.by_kind)
        doc["conforms"] = self.conforms
        return doc


class _Instance:
    """What the log has said about one instance so far."""

    __slots__ = ("begun", "due", "generation", "key", "line", "since", "state")

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


def _hashable(value: Any) -> Hashable:
    """A JSON value as a dict key: arrays become tuples (a tuple key is logged as an array)."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value  # type: ignore[no-any-return]


def _show(key: Any) -> str:
    """``key "req-7"`` or ``key 7``: as logged, so a string key and a number stay apart."""
    return f"key {msgspec.json.encode(key).decode()}"


def _t(seconds: float) -> str:
    return f"{seconds:.3f}"


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
        self._edges: dict[tuple[str, str], Edge] = {}
        accepts: dict[str, list[str]] = {name: [] for name in spec.states}
        for edge in spec.edges():
            self._edges.setdefault((edge.source, edge.event), edge)
            accepts.setdefault(edge.source, []).append(edge.event)
        self._accepts = {s: ", ".join(dict.fromkeys(evs)) or "nothing" for s, evs in accepts.items()}
        self._ignored = {(state, event) for state, event, _rule in spec.ignored()}
        self._timeouts: dict[str, tuple[float, str, str | None]] = {}
        """state -> (seconds, the event it fires, the param that sets it or None)."""
        for name, state in spec.states.items():
            if state.timeout is not None:
                after = state.timeout.after
                param = after if isinstance(after, str) else None
                self._timeouts[name] = (spec.param(after, params), state.timeout.fire, param)
        self._finals = frozenset(spec.finals)
        self._initial = spec.initial.name
        self._records = msgspec.json.Decoder(Record)
        self._headers = msgspec.json.Decoder(Header)
        self._divergences: list[Divergence] = []
        self._by_kind: Counter[str] = Counter()
        self._reported = 0
        """The last line a divergence was reported for (each line gets at most one)."""
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
        """Check the next line (as read, newline included if it had one)."""
        self._line += 1
        if not raw.strip():
            return
        try:
            line = self._decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if raw.endswith(b"\n"):
                self._report(
                    "malformed",
                    self._line,
                    f"not a journal line: {exc}",
                    "Each line is one JSON object with key, generation, event, from, to and time.",
                )
            else:
                self.cut(self._line, f"the last line is cut short ({exc}) and has no newline")
            return
        if isinstance(line, Header):
            self._session(line)
            return
        self._nrecords += 1
        if not self._open:
            self._sessions += 1
            self._open = True
        if line.from_ == "":
            self._begin(line)
        else:
            self._step(line)
        self._clock(line)

    @property
    def lines(self) -> int:
        """Lines fed so far."""
        return self._line

    @property
    def truncated(self) -> bool:
        """Whether the log was found cut short."""
        return self._by_kind["truncated"] > 0

    def cut(self, line: int, message: str) -> None:
        """The log ends abruptly at ``line`` (a truncated file or stream)."""
        self._report(
            "truncated",
            line,
            message,
            "The log was truncated or is still being written; its tail is missing.",
        )

    def finish(self) -> Replay:
        """End of the log: report what it leaves live, and return everything found."""
        self._end_session(None)
        return Replay(
            path=self.path,
            machine=self.spec.name,
            lines=self._line,
            records=self._nrecords,
            instances=self._ninstances,
            sessions=self._sessions,
            live=self._left_live,
            divergences=tuple(self._divergences),
            total=sum(self._by_kind.values()),
            by_kind=dict(self._by_kind),
        )

    # -- one line --------------------------------------------------------------------

    def _decode(self, raw: bytes) -> Record | Header:
        try:
            return self._records.decode(raw)
        except msgspec.ValidationError as exc:
            try:
                return self._headers.decode(raw)
            except msgspec.ValidationError:
                raise exc from None

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
                "machine",
                self._line,
                f"this log was written by a tracker of machine {header.machine!r}, not {self.spec.name!r}",
                "Check the log against the spec its tracker ran.",
            )

    def _begin(self, rec: Record) -> None:
        n, key = self._line, _hashable(rec.key)
        if rec.event != BEGIN:
            self._report(
                "malformed",
                n,
                f"a line with an empty 'from' starts an instance, but its event is {rec.event!r}",
                "Only begin lines have an empty 'from'; every other line names the state the instance left.",
                rec.key,
            )
            return
        old = self._live.get(key)
        if old is not None and old.state not in self._finals:
            self._report(
                "duplicate-begin",
                n,
                f"begin for {_show(rec.key)} while its instance from line {old.line} (generation "
                f"{old.generation}) is still live in {old.state!r}",
                "The Tracker refuses begin for a live key, so a line that finished the earlier instance is "
                "missing, or two trackers wrote this log.",
                rec.key,
            )
        if self._generation is not None and rec.generation <= self._generation:
            self._report(
                "generation",
                n,
                f"begin for {_show(rec.key)} has generation {rec.generation}, not above {self._generation} "
                f"of the begin at line {self._generation_line}",
                "A tracker numbers instances in begin order, so this line is out of order, duplicated, or "
                "from another tracker.",
                rec.key,
            )
        if self._generation is None or rec.generation > self._generation:
            self._generation, self._generation_line = rec.generation, n
        if rec.to != self._initial:
            self._report(
                "wrong-target",
                n,
                f"begin for {_show(rec.key)} entered {rec.to!r}, but the initial state of "
                f"{self.spec.name!r} is {self._initial!r}",
                "Check the log against the spec its tracker ran.",
                rec.key,
            )
        self._ninstances += 1
        self._enter(key, _Instance(rec.key, rec.generation, rec.to, n), rec.time)

    def _step(self, rec: Record) -> None:
        n, key, src, event = self._line, _hashable(rec.key), rec.from_, rec.event
        who = f"{event!r} for {_show(rec.key)}"
        inst = self._live.get(key)
        if inst is None:
            self._report(
                "unknown-instance",
                n,
                f"{who} ({src} → {rec.to}), which has no instance: no begin line for it"
                + (" since the log restarted" if self._sessions > 1 else ""),
                "A log must start where its tracker started; was its head cut off or rotated away?",
                rec.key,
            )
            inst = _Instance(rec.key, rec.generation, src, n)
        elif rec.generation != inst.generation:
            self._report(
                "generation",
                n,
                f"{who} carries generation {rec.generation}, but the instance begun at line {inst.begun} "
                f"is generation {inst.generation}",
                "Events of a finished generation are never applied by the Tracker; the log mixes instances.",
                rec.key,
            )
        if src != inst.state:
            self._report(
                "wrong-source",
                n,
                f"{who} leaves {src!r}, but the instance is in {inst.state!r} (since line {inst.line})",
                "A transition line is missing or out of order before this one.",
                rec.key,
            )
            inst.due = None  # when it entered src is unknown: no deadline to judge
        edge = self._edges.get((src, event))
        if edge is None:
            self._report(
                "illegal",
                n,
                f"{who} in {src!r}: {self._why_illegal(src, event)}",
                "A Tracker logs only transitions its spec has: is this the spec the tracker ran?",
                rec.key,
            )
        elif edge.target != rec.to:
            loc = edge.transition.loc
            self._report(
                "wrong-target",
                n,
                f"{who} went from {src!r} to {rec.to!r}, but the spec's transition ({loc.path}:{loc.line}) goes to "
                f"{edge.target!r}",
                "Check the log against the spec its tracker ran.",
                rec.key,
            )
        if inst.due is not None and rec.time > inst.due + self.tolerance:
            self._overrun(inst, rec.time, n, f"to t={_t(rec.time)}", once=True)
        inst.state, inst.line = rec.to, n
        self._enter(key, inst, rec.time)

    def _enter(self, key: Hashable, inst: _Instance, now: float) -> None:
        """``inst`` has just entered ``inst.state`` at ``now``: arm its deadline, retire it if final."""
        inst.since = now
        timeout = self._timeouts.get(inst.state)
        inst.due = now + timeout[0] if timeout is not None else None
        self._live[key] = inst
        if inst.state in self._finals:
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
                "time-backwards",
                self._line,
                f"time runs backwards: t={_t(rec.time)} after t={_t(last)} at line {self._time_line}",
                "A tracker's clock is monotonic, so lines are out of order or from two trackers.",
                rec.key,
            )
            return
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
            holds = self.spec.holds(inst.state)
            if holds and not self.allow_live:
                self._report(
                    "unreleased",
                    inst.line,
                    f"{_show(inst.key)} ends in {inst.state!r} holding {', '.join(holds)} at {end}: no line "
                    f"releases them",
                    "A path that leaves this state is missing (a leak), or the log was cut while the process "
                    "ran (--allow-live accepts that).",
                    inst.key,
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
            "overrun",
            line,
            f"{_show(inst.key)} stayed in {inst.state!r} from t={_t(inst.since)} (line {inst.line}) {until}, "
            f"{_t(now - inst.due)}s past its deadline ({after}): {fire!r} was due at t={_t(inst.due)}",
            f"{fix} --tolerance (now {self.tolerance:g}s) widens the slack.",
            inst.key,
            once=once,
        )

    def _why_illegal(self, src: str, event: str) -> str:
        if src not in self.spec.states:
            return f"{src!r} is not a state of {self.spec.name!r} (states: {', '.join(self.spec.states)})"
        if (src, event) in self._ignored:
            return "the event is ignored there, a legal no-op, which the Tracker never logs"
        return f"not a transition of {self.spec.name!r}; {src!r} accepts {self._accepts.get(src, 'nothing')}"

    def _report(
        self, kind: DivergenceKind, line: int, message: str, fix: str = "", key: Any = None, *, once: bool = True
    ) -> None:
        if once:
            if self._reported == line:
                return
            self._reported = line
        self._by_kind[kind] += 1
        if len(self._divergences) < self._keep:
            self._divergences.append(Divergence(kind, self.path, line, message, fix, key))


def check_log(
    spec: Spec | str | os.PathLike[str],
    log: str | os.PathLike[str] | Iterable[bytes],
    *,
    name: str | None = None,
    params: Mapping[str, float] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    allow_live: bool = False,
    keep: int = KEEP,
) -> Replay:
    """Check a journal (a path, ``.gz`` read as gzip, or an iterable of byte lines) against ``spec``.

    Raises OSError when the log cannot be read, :class:`~kvfsm.SpecError` for a
    spec path that does not load, and :class:`~kvfsm.BindingError` for params
    the spec does not declare.
    """
    if not isinstance(spec, Spec):
        spec = load(Path(spec))
    if isinstance(log, str | os.PathLike):
        path = Path(log)
        checker = LogChecker(
            spec, path=name or str(path), params=params, tolerance=tolerance, allow_live=allow_live, keep=keep
        )
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as stream:
            _feed(checker, stream)
    else:
        checker = LogChecker(
            spec, path=name or "<stream>", params=params, tolerance=tolerance, allow_live=allow_live, keep=keep
        )
        _feed(checker, log)
    return checker.finish()


def _feed(checker: LogChecker, lines: Iterable[bytes]) -> None:
    try:
        for raw in lines:
            checker.feed(raw)
    except EOFError as exc:  # a gzip stream cut short
        if not checker.truncated:
            checker.cut(checker.lines + 1, f"the compressed log ends abruptly ({exc})")
