"""One request of a composition as a finite transition system, built from the spec model.

A request's *local state* is the state of each role's instance plus the
messages of that request in flight. Requests never share an instance or a
message, so the whole system is N copies of this local system, coupled only by
the channel's capacity. Everything the explorer needs about one request is
computed here once: every reachable local state, every move between them with
what it means (for traces), and what each local state or move violates.

Semantics (the same in the Promela export):

- every role's instance starts in its initial state, nothing in flight;
- a live instance may fire any event it has a transition for, unless that event
  is a message it receives (local work, timeouts, ``abort`` and the
  ``on_error`` event all happen whenever their state allows);
- each message sent is kept or, if the channel may lose messages, lost;
- a message in flight may be delivered (any of them if the channel reorders,
  else the oldest per direction); delivery consumes it or, if the channel may
  duplicate, leaves a copy in flight. The receiver fires it, ignores it, has
  its server answer it (``reply_if_finished``, finished instances only), or
  rejects it: ``unexpected_message`` in a live state, ``late_message`` in a
  final one;
- a request whose instances have all finished with nothing in flight is
  *retired*: its final states are forgotten, as the Tracker forgets finished
  instances, unless the finished state itself violates a property.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import product

from ..spec.model import ABORT
from ..spec.system import System

LocalState = tuple[tuple[int, ...], tuple[int, ...]]
"""(state index per role, ids of this request's messages in flight); ``RETIRED`` once done."""

RETIRED: LocalState = ((), ())


@dataclass(frozen=True, slots=True)
class Move:
    """One step of one request: which role did what, and what it sent."""

    role: int
    cause: str
    """``local`` | ``timeout`` | ``abort`` | ``error`` (the on_error event) | ``message``."""
    action: str
    """``fire`` (a transition) | ``ignore`` | ``reply`` (a finished instance's server answers) | ``reject``."""
    event: str
    source: int
    target: int
    sent: tuple[tuple[int, bool], ...] = ()
    """(message id, kept) per send, in order; ``kept`` is false for a message the channel lost."""
    message: int = -1
    """The delivered message's id (``cause == "message"``)."""
    duplicate: bool = False
    """A delivered message that stays in flight (the channel duplicated it)."""
    violation: str | None = None
    """The property this move itself breaks (``unexpected_message``, ``late_message``, ``overflow``)."""


@dataclass(frozen=True, slots=True)
class _Role:
    name: str
    states: tuple[str, ...]
    final: tuple[bool, ...]
    holds: tuple[tuple[str, ...], ...]
    spontaneous: tuple[tuple[tuple[str, int, tuple[int, ...], str], ...], ...]
    """per state: (event, target, message ids sent, cause) for every event that needs no message."""
    progress: tuple[bool, ...]
    """per state: some spontaneous event other than abort / on_error can move it."""
    on_message: dict[tuple[int, int], tuple[int, tuple[int, ...]] | None]
    """(state, message id) → (target, sends) for a transition, ``None`` if ignored; absent: rejected."""


_Condition = tuple[int, frozenset[int] | None, frozenset[str], frozenset[str]]


class LocalSystem:
    """Every reachable local state of one request, the moves between them, and what they violate."""

    def __init__(self, system: System) -> None:
        self.system = system
        self.channel = system.channel
        self.message_names = tuple(system.messages)
        msg_id = {name: i for i, name in enumerate(self.message_names)}
        role_names = tuple(system.roles)
        role_id = {name: i for i, name in enumerate(role_names)}
        messages = [system.messages[m] for m in self.message_names]
        self.receiver = tuple(role_id[m.receiver] for m in messages)
        directions: dict[tuple[str, str], int] = {}
        for m in messages:
            directions.setdefault((m.sender, m.receiver), len(directions))
        self.direction = tuple(directions[(m.sender, m.receiver)] for m in messages)
        self.reply = tuple(msg_id[m.reply_if_finished] if m.reply_if_finished else -1 for m in messages)
        self.roles = tuple(self._compile(name, msg_id) for name in role_names)
        self.properties = system.properties
        self._enabled = set(self.properties)
        self._never: list[tuple[str, str, list[_Condition]]] = []
        for prop in system.never:
            conds: list[_Condition] = []
            for c in prop.when:
                role = self.roles[role_id[c.role]]
                states = frozenset(role.states.index(s) for s in c.states) or None
                conds.append((role_id[c.role], states, frozenset(c.holds), frozenset(c.lacks)))
            self._never.append((prop.name, prop.describe(), conds))
        self.states: list[LocalState] = []
        self.index: dict[LocalState, int] = {}
        self.moves: list[list[tuple[int, Move]]] = []
        """per local id: (target id, move); target -1 for a send that cannot fit (overflow)."""
        self.violations: list[tuple[tuple[str, str], ...]] = []
        """per local id: (property, what is wrong) for every property the local state breaks."""
        self.nmsg: list[int] = []
        start = tuple(role.states.index(system.roles[role.name].spec.initial.name) for role in self.roles)
        self.initial = self._intern(self._normal((start, ())))
        self._build()

    # -- compiling the roles -----------------------------------------------------

    def _compile(self, name: str, msg_id: dict[str, int]) -> _Role:
        spec = self.system.roles[name].spec
        states = tuple(spec.states)
        sid = {s: i for i, s in enumerate(states)}
        inbox = set(self.system.inbox(name))
        env = {ABORT} | ({spec.on_error} if spec.on_error else set())
        spontaneous: list[list[tuple[str, int, tuple[int, ...], str]]] = [[] for _ in states]
        on_message: dict[tuple[int, int], tuple[int, tuple[int, ...]] | None] = {}
        for e in spec.edges():
            if e.source not in sid or e.target not in sid:
                continue
            src, dst = sid[e.source], sid[e.target]
            sends = tuple(msg_id[s.message] for s in e.transition.sends if s.message in msg_id)
            if e.event in inbox:
                on_message.setdefault((src, msg_id[e.event]), (dst, sends))
                continue
            timeout = spec.states[e.source].timeout
            if timeout is not None and timeout.fire == e.event:
                cause = "timeout"
            elif e.event == ABORT:
                cause = "abort"
            elif e.event == spec.on_error:
                cause = "error"
            else:
                cause = "local"
            spontaneous[src].append((e.event, dst, sends, cause))
        for state, event, _rule in spec.ignored():
            if event in inbox and state in sid:
                on_message.setdefault((sid[state], msg_id[event]), None)
        return _Role(
            name=name,
            states=states,
            final=tuple(spec.states[s].is_final for s in states),
            holds=tuple(spec.states[s].holds for s in states),
            spontaneous=tuple(tuple(x) for x in spontaneous),
            progress=tuple(any(ev not in env for ev, _t, _s, _c in row) for row in spontaneous),
            on_message=on_message,
        )

    # -- local states --------------------------------------------------------------

    def _add(self, flight: tuple[int, ...], m: int) -> tuple[int, ...]:
        """In flight plus ``m``: a sorted multiset if the channel reorders, else send order per direction."""
        if self.channel.reorder:
            return tuple(sorted((*flight, m)))
        d = self.direction[m]
        at = len(flight)
        while at > 0 and self.direction[flight[at - 1]] > d:
            at -= 1
        return (*flight[:at], m, *flight[at:])

    def _deliverable(self, flight: tuple[int, ...]) -> Iterator[int]:
        """Positions of the messages that may arrive next."""
        seen: set[int] = set()
        for pos, m in enumerate(flight):
            key = m if self.channel.reorder else self.direction[m]
            if key not in seen:
                seen.add(key)
                yield pos

    def describe_violations(self, state: LocalState) -> tuple[tuple[str, str], ...]:
        """What a local state breaks: the ``never`` properties, and deadlock or leak when it is stuck."""
        if state == RETIRED:
            return ()
        at, flight = state
        roles = self.roles
        out: list[tuple[str, str]] = []
        for name, text, conds in self._never:
            if name in self._enabled and all(
                (states is None or at[r] in states)
                and holds <= set(roles[r].holds[at[r]])
                and not lacks & set(roles[r].holds[at[r]])
                for r, states, holds, lacks in conds
            ):
                out.append((name, text))
        if flight or any(role.progress[at[r]] for r, role in enumerate(roles)):
            return tuple(out)
        stuck = [r for r, role in enumerate(roles) if not role.final[at[r]]]
        if not stuck:
            return tuple(out)
        where = ", ".join(f"{roles[r].name} in {roles[r].states[at[r]]}" for r in stuck)
        held = [f"{roles[r].name}: {', '.join(roles[r].holds[at[r]])}" for r in stuck if roles[r].holds[at[r]]]
        if held:
            kind, text = "leak", f"nothing can move {where} and nothing is in flight; it keeps {'; '.join(held)}"
        else:
            kind, text = "deadlock", f"nothing can move {where} and nothing is in flight (only an abort would end it)"
        if kind in self._enabled:
            out.append((kind, text))
        return tuple(out)

    def _normal(self, state: LocalState) -> LocalState:
        """Retire a request whose instances all finished with nothing in flight (unless that breaks a property)."""
        at, flight = state
        if flight or not all(role.final[at[r]] for r, role in enumerate(self.roles)):
            return state
        return state if self.describe_violations(state) else RETIRED

    def _intern(self, state: LocalState) -> int:
        found = self.index.get(state)
        if found is not None:
            return found
        i = len(self.states)
        self.index[state] = i
        self.states.append(state)
        self.nmsg.append(len(state[1]))
        self.violations.append(self.describe_violations(state))
        self.moves.append([])
        return i

    # -- moves ---------------------------------------------------------------------

    def _sending(
        self, at: tuple[int, ...], role: int, target: int, flight: tuple[int, ...], sends: tuple[int, ...]
    ) -> Iterator[tuple[LocalState, tuple[tuple[int, bool], ...]]]:
        """The local states after ``role`` moves to ``target`` and sends ``sends``, one per fate of each message."""
        moved = (*at[:role], target, *at[role + 1 :])
        fates = [(True, False) if self.channel.loss else (True,) for _ in sends]
        for choice in product(*fates):
            f = flight
            for m, kept in zip(sends, choice, strict=True):
                if kept:
                    f = self._add(f, m)
            yield (moved, f), tuple(zip(sends, choice, strict=True))

    def _successors(self, state: LocalState) -> Iterator[tuple[LocalState, Move]]:
        if state == RETIRED:
            return
        at, flight = state
        for r, role in enumerate(self.roles):
            s = at[r]
            if role.final[s]:
                continue
            for event, target, sends, cause in role.spontaneous[s]:
                for nxt, sent in self._sending(at, r, target, flight, sends):
                    yield nxt, Move(r, cause, "fire", event, s, target, sent)
        for pos in self._deliverable(flight):
            m = flight[pos]
            r = self.receiver[m]
            role = self.roles[r]
            s = at[r]
            event = self.message_names[m]
            for keep in (False, True) if self.channel.duplicate else (False,):
                left = flight if keep else (*flight[:pos], *flight[pos + 1 :])
                known = (s, m) in role.on_message
                how = role.on_message.get((s, m))
                if role.final[s] and self.reply[m] >= 0:
                    for nxt, sent in self._sending(at, r, s, left, (self.reply[m],)):
                        yield nxt, Move(r, "message", "reply", event, s, s, sent, m, keep)
                elif known and how is None:
                    yield (at, left), Move(r, "message", "ignore", event, s, s, (), m, keep)
                elif how is not None and not role.final[s]:
                    target, sends = how
                    for nxt, sent in self._sending(at, r, target, left, sends):
                        yield nxt, Move(r, "message", "fire", event, s, target, sent, m, keep)
                else:
                    why = "late_message" if role.final[s] else "unexpected_message"
                    yield (at, left), Move(r, "message", "reject", event, s, s, (), m, keep, why)

    def _build(self) -> None:
        """Every local state one request can reach with at most ``capacity`` messages in flight."""
        capacity = self.channel.capacity
        todo = [self.initial]
        while todo:
            i = todo.pop()
            out = self.moves[i]
            for nxt, found in self._successors(self.states[i]):
                move = found if found.violation in self._enabled else replace(found, violation=None)
                if len(nxt[1]) > capacity:
                    if not self.channel.loss and "overflow" in self._enabled:
                        out.append((-1, replace(move, violation="overflow")))
                    continue
                state = self._normal(nxt)
                known = state in self.index
                j = self._intern(state)
                if j == i:
                    continue  # a no-op; a rejected duplicate is also caught by its consuming twin
                out.append((j, move))
                if not known:
                    todo.append(j)

    # -- reading back ----------------------------------------------------------------

    def role_state(self, local: int, role: int) -> str | None:
        """The role's state name in a local state (``None`` once the request is retired)."""
        at = self.states[local][0]
        return self.roles[role].states[at[role]] if at else None

    def in_flight(self, local: int) -> tuple[str, ...]:
        return tuple(self.message_names[m] for m in self.states[local][1])

    def holds(self, role: int, state: int) -> tuple[str, ...]:
        return self.roles[role].holds[state]

    def reached(self) -> set[tuple[str, str]]:
        """(role, state) pairs some request can reach (finished states included, though retired at once)."""
        out: set[tuple[str, str]] = set()
        for i, (at, _flight) in enumerate(self.states):
            for r, s in enumerate(at):
                out.add((self.roles[r].name, self.roles[r].states[s]))
            for j, move in self.moves[i]:
                if j >= 0:
                    out.add((self.roles[move.role].name, self.roles[move.role].states[move.target]))
        return out
