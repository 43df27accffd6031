"""Transition coverage of a model-based run: which edges, timeouts and refusals the examples exercised.

Counted from the model's outcomes (which the Tracker was checked to agree
with), summed over every example of a run, shrinking included. An edge is a
``(source, event)`` pair of :meth:`Spec.edges`; a timeout counts only when the
deadline fired it, not when the test fired the same event by hand.
:meth:`Coverage.gaps` names what was never exercised, and why, for the
coverage verdict.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..spec.model import Spec
from .cover import routes
from .oracle import How, Outcome

HOWS: tuple[How, ...] = ("fire", "timeout", "on_error", "close")


@dataclass(frozen=True)
class EdgeCount:
    """One spec edge and how often each way of taking it happened."""

    source: str
    event: str
    target: str
    timeout: bool
    """Whether a deadline armed in the source (its own, or a phase's it is in) fires this event."""
    by: dict[How, int]

    @property
    def taken(self) -> int:
        return sum(self.by.values())


@dataclass(frozen=True)
class Gap:
    """Something the spec says a run must exercise that it never did: an edge, a deadline or an ignore rule."""

    kind: Literal["edge", "deadline", "ignored"]
    name: str
    """How an exemption names it: ``queued --start--> transferring``, ``deadline of transferring``,
    ``deadline of phase lease``, ``ignored abort in done``."""
    why: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "name": self.name, "why": self.why}


def edge_name(source: str, event: str, target: str) -> str:
    return f"{source} --{event}--> {target}"


NOT_TAKEN = "never taken, though the path cover plans it; the run ended before its plan"
"""Why, when nothing stops the test from taking it: the run was cut short (a failure, or no cover)."""


class Coverage:
    """Counts per spec edge, timed state, ignored pair and injected fault."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.edges: Counter[tuple[str, str, How]] = Counter()
        self.ignored: Counter[tuple[str, str]] = Counter()
        self.illegal: Counter[tuple[str, str]] = Counter()
        self.unknown = 0
        self.begins = 0
        self.faults: Counter[str] = Counter()
        """Injected faults that made an action raise, per action."""
        self.closes = 0
        self.mid_example_closes = 0
        """Closes by the rule that closes mid-example (the rest are the end of an example)."""
        self.refused_closed = 0
        """Begins and fires refused with TrackerClosed after a mid-example close."""
        self.forced = 0
        """Instances close() had to release without a transition (abort could not finish them)."""
        self.examples = 0
        self.steps = 0
        self.arrivals: Counter[str] = Counter()
        """Counted and early messages by what became of them: ``counted`` (the count not complete), ``duplicate``
        (a sender heard before), ``kept`` (an id not yet known), ``early`` (dropped unapplied)."""
        self.fired: Counter[str] = Counter()
        """States' own deadlines that fired, per state (a phase's firing in the state is an expiry, below)."""
        self.expiries: Counter[str] = Counter()
        """Phase deadlines that fired, per phase."""
        self.expiries_after_moves: Counter[str] = Counter()
        """Of those, the ones that fired after the instance moved inside the phase or took a self-loop since
        entering it: the deadline still ran from the entry."""

    def record(self, outcome: Outcome) -> None:
        for move in outcome.moves:
            if move.how == "begin":
                self.begins += 1
            else:
                self.edges[move.source, move.event, move.how] += 1
                if move.how == "timeout" and not move.phase:
                    self.fired[move.source] += 1
        self.forced += len(outcome.forced)
        for expiry in outcome.expired:
            self.expiries[expiry.phase] += 1
            self.expiries_after_moves[expiry.phase] += expiry.moves > 0
        for failure in outcome.failures:
            self.faults[failure.action] += 1
        if outcome.refused in ("counted", "kept"):
            self.arrivals[outcome.anomaly or outcome.refused] += 1
        elif outcome.anomaly == "early":
            self.arrivals["early"] += 1
        if outcome.refused == "closed":
            self.refused_closed += 1
        elif outcome.refused == "unknown":
            self.unknown += 1
        elif outcome.refused in ("ignored", "illegal") and outcome.state is not None:
            table = self.ignored if outcome.refused == "ignored" else self.illegal
            table[outcome.state, outcome.event] += 1

    # -- views -------------------------------------------------------------------

    def edge_counts(self) -> list[EdgeCount]:
        """Every spec edge in declaration order, with its counts (zero when never taken)."""
        rows = []
        for e in self.spec.edges():
            timed = self.spec.fires_on_timeout(e.source, e.event)
            by: dict[How, int] = {how: self.edges[e.source, e.event, how] for how in HOWS}
            rows.append(EdgeCount(e.source, e.event, e.target, timed, by))
        return rows

    def taken(self) -> dict[tuple[str, str], int]:
        """``(source, event) → times taken``, every spec edge present: what the diagram overlay reads."""
        return {(r.source, r.event): r.taken for r in self.edge_counts()}

    def timeouts(self) -> list[tuple[str, str, int]]:
        """``(state, event, times its deadline fired)`` for every state with a timeout."""
        return [
            (name, st.timeout.fire, self.fired[name]) for name, st in self.spec.states.items() if st.timeout is not None
        ]

    def phase_timeouts(self) -> list[tuple[str, str, int, int]]:
        """``(phase, event, times its deadline fired, of those after moves inside it)`` for every phase."""
        return [
            (name, phase.timeout.fire, self.expiries[name], self.expiries_after_moves[name])
            for name, phase in self.spec.phases.items()
        ]

    def ignored_pairs(self) -> list[tuple[str, str, int]]:
        pairs = sorted({(s, e) for s, e, _r in self.spec.ignored()}, key=self._order)
        return [(s, e, self.ignored[s, e]) for s, e in pairs]

    def summary(self) -> dict[str, tuple[int, int]]:
        """``name → (exercised, total)`` for edges, timeouts (the states' and the phases' deadlines) and ignored
        pairs."""
        edges = self.edge_counts()
        fired = [n for _s, _e, n in self.timeouts()] + [n for _p, _e, n, _m in self.phase_timeouts()]
        ignored = self.ignored_pairs()
        return {
            "edges": (sum(r.taken > 0 for r in edges), len(edges)),
            "timeouts": (sum(n > 0 for n in fired), len(fired)),
            "ignored": (sum(n > 0 for _s, _e, n in ignored), len(ignored)),
        }

    def gaps(self, blocked: Mapping[tuple[str, str], str] | None = None) -> list[Gap]:
        """Every edge, deadline and ignored pair never exercised, with why (``blocked``: edges the driver
        cannot take, and why; a state reachable only through them cannot be reached either)."""
        blocked = blocked or {}
        reachable = routes(self.spec, blocked)

        def why(state: str, pair: tuple[str, str]) -> str:
            if pair in blocked:
                return blocked[pair]
            if state not in reachable:
                return f"{state} is reachable only through edges the driver cannot take (see those)"
            return NOT_TAKEN

        out = [
            Gap("edge", edge_name(r.source, r.event, r.target), why(r.source, (r.source, r.event)))
            for r in self.edge_counts()
            if not r.taken
        ]
        out += [Gap("deadline", f"deadline of {s}", why(s, (s, e))) for s, e, n in self.timeouts() if not n]
        out += [
            Gap("deadline", f"deadline of phase {p}", self._phase_why(p, e, why))
            for p, e, n, _m in self.phase_timeouts()
            if not n
        ]
        out += [Gap("ignored", f"ignored {e} in {s}", why(s, ("", ""))) for s, e, n in self.ignored_pairs() if not n]
        return out

    def names(self) -> list[str]:
        """What :meth:`gaps` may name: every edge, deadline and ignored pair, as an exemption names it."""
        return [
            *(edge_name(r.source, r.event, r.target) for r in self.edge_counts()),
            *(f"deadline of {s}" for s, _e, _n in self.timeouts()),
            *(f"deadline of phase {p}" for p, _e, _n, _m in self.phase_timeouts()),
            *(f"ignored {e} in {s}" for s, e, _n in self.ignored_pairs()),
        ]

    def ratio(self) -> float:
        """Exercised over total, edges, deadlines and ignored pairs together (1.0 for a spec with none)."""
        done = sum(a for a, _b in self.summary().values())
        total = sum(b for _a, b in self.summary().values())
        return done / total if total else 1.0

    def as_dict(self) -> dict[str, Any]:
        """Everything, for ``--format json``."""
        return {
            "summary": {k: {"exercised": a, "total": b} for k, (a, b) in self.summary().items()},
            "examples": self.examples,
            "steps": self.steps,
            "begins": self.begins,
            "closes": self.closes,
            "mid_example_closes": self.mid_example_closes,
            "refused_closed": self.refused_closed,
            "forced": self.forced,
            "arrivals": dict(self.arrivals),
            "edges": [
                {
                    "source": r.source,
                    "event": r.event,
                    "target": r.target,
                    "timeout": r.timeout,
                    "taken": r.taken,
                    "by": dict(r.by),
                }
                for r in self.edge_counts()
            ],
            "timeouts": [{"state": s, "event": e, "fired": n} for s, e, n in self.timeouts()],
            "phases": [
                {"phase": p, "event": e, "fired": n, "after_moves_inside": m} for p, e, n, m in self.phase_timeouts()
            ],
            "ignored": [{"state": s, "event": e, "hit": n} for s, e, n in self.ignored_pairs()],
            "illegal": [
                {"state": s, "event": e, "tried": n} for (s, e), n in sorted(self.illegal.items(), key=self._by_key)
            ],
            "unknown_key_events": self.unknown,
            "faults": dict(sorted(self.faults.items())),
        }

    def _phase_why(self, phase: str, event: str, why: Any) -> str:
        """Why a phase's deadline never fired: as for its states' edges, or NOT_TAKEN if one could be reached."""
        reasons = [why(s, (s, event)) for s in self.spec.states if s in self.spec.phase_states[phase]]
        return next((r for r in reasons if r == NOT_TAKEN), reasons[0] if reasons else NOT_TAKEN)

    def _order(self, pair: tuple[str, str]) -> tuple[int, str]:
        return (list(self.spec.states).index(pair[0]), pair[1])

    def _by_key(self, item: tuple[tuple[str, str], int]) -> tuple[int, str]:
        return self._order(item[0])
