"""One request of a composition as a finite transition system, built from the spec model.

A request's *local state* is the state of each role's instance (one per rank
of a role with ranks), the messages of that request in flight, and an int of
bits: the order its deadlines were armed in (:mod:`.clocks`) and the sender
ranks each counted message has been heard from. Requests never share an instance or a
message, so the whole system is N copies of this local system, coupled only by
the channel's capacity. Everything the explorer needs about one request is
computed here once: every reachable local state, every move between them with
what it means (for traces), and what each local state or move violates.

Semantics (the same in the Promela export):

- every role's instance starts in its initial state, nothing in flight;
- a live instance may fire any event it has a transition for, unless that event
  is a message it receives (local work, ``abort``, the ``on_error`` event and
  the events the system file declares the environment's happen whenever their
  state allows; a timeout too, its state's own or a
  phase's while the instance is in one of the phase's states, unless the
  system's relations make another armed deadline fall due first); a role that
  may crash may also ``crash`` from any live state into ``crashed``;
- a transition into a state that counts to 0 on entry (:mod:`.entry`) goes
  on with the counted transition in the same move, as the Tracker fires it
  before the call that entered the state returns (``Move.via``);
- a role whose spec owns instances of another (``owns:``) is the parent of
  every instance of the role that runs that machine, each begun with the
  request. In the move that changes them, as the Tracker does under the
  family's one lock, the parent's ``forward`` events reach every live child,
  a child that ends in a failure state fires the parent's ``failed``, and the
  parent's ``ended`` fires once no child is live, whenever its state takes
  it (``Move.owner``); the explorer never fires those two events otherwise;
- sends, deliveries, loss and duplicates follow the channel's rules
  (:mod:`kvfsm.spec.system.channel`). The receiver of a delivered message
  fires it, ignores it, counts it (a counted message before its last sender
  rank), has its server answer it (``reply_if_finished``, finished or
  crashed-and-restarted instances only), or rejects it; a crashed instance
  drops what it does not answer;
- what a local state or a move breaks is what the properties' evaluator
  (:mod:`kvfsm.spec.system.properties`) says of its snapshot;
- a request whose instances have all finished with nothing in flight is
  *retired*: its final states are forgotten, as the Tracker forgets finished
  instances, unless the finished state itself violates a property.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

from ..errors import KvfsmError
from ..spec.model import ABORT, Edge
from ..spec.system import LastStep, Snapshot, System, violations
from ..spec.system.channel import Flight
from ..spec.system.model import CRASH, CRASHED
from .clocks import Clocks
from .entry import entering
from .limits import ExploreError

LocalState = tuple[tuple[int, ...], tuple[int, ...], int]
"""(state index per role, ids of this request's messages in flight, deadline order bits); ``RETIRED`` once done."""

RETIRED: LocalState = ((), (), 0)

Placed = tuple[tuple[int, ...], tuple[int, ...]]
"""Role states and flight after a move, before its deadline bits are worked out."""


class LocalLimit(KvfsmError):
    """One request's local system outgrew the bound it was built under: nothing can be explored within it.

    ``stopped`` is the bound (``max_states`` or ``time_limit``), ``states`` the local states built by then.
    """

    def __init__(self, message: str, stopped: str, states: int) -> None:
        super().__init__(message)
        self.stopped, self.states = stopped, states


@dataclass(frozen=True, slots=True)
class Move:
    """One step of one request: which role did what, and what it sent."""

    role: int
    cause: str
    """``local`` | ``timeout`` | ``abort`` | ``error`` (the on_error event) | ``environment`` (an event the system
    file declares from outside) | ``crash`` | ``message``."""
    action: str
    """``fire`` (a transition) | ``ignore`` | ``count`` (a counted copy, remembered) | ``reply`` | ``reject``."""
    event: str
    source: int
    target: int
    sent: tuple[tuple[int, bool], ...] = ()
    """(message id, kept) per send, in order; ``kept`` is false for a message the channel lost."""
    message: int = -1
    """The delivered message's id (``cause == "message"``)."""
    duplicate: bool = False
    """A delivered message that stays in flight (the channel duplicated it)."""
    in_flight: int = 0
    """The request's messages in flight after the move."""
    violation: str | None = None
    """The property this move itself breaks (``unexpected_message``, ``late_message``, ``overflow``)."""
    via: tuple[int, ...] = ()
    """States entered and left at once on the way to ``target``: each counts to 0 on entry, so its counted
    transition fires in the same move (empty for a plain transition)."""
    owner: tuple[tuple[int, str, int, int], ...] = ()
    """(role, event, source, target) of each transition the engine fired for a family (``owns:``) in the same
    move, in order: a forwarded event on a child, ``failed`` or ``ended`` on a parent."""


@dataclass(frozen=True, slots=True)
class _Role:
    name: str
    states: tuple[str, ...]
    final: tuple[bool, ...]
    holds: tuple[tuple[str, ...], ...]
    spontaneous: tuple[tuple[tuple[str, int, tuple[int, ...], str, tuple[int, ...]], ...], ...]
    """per state: (event, target, message ids sent, cause, via) for every event that needs no message."""
    on_message: dict[tuple[int, int], tuple[int, tuple[int, ...], tuple[int, ...]] | None]
    """(state, message id) → (target, sends, via) for a transition, ``None`` if ignored; absent: rejected."""
    crashed: int = -1
    """The index of the ``crashed`` state of a role that may crash; -1 for one that may not."""
    restart: bool = True
    """A crashed role's process comes back: its server answers for the lost instance (``reply_if_finished``)."""
    failure: tuple[bool, ...] = ()
    """Per state: a failure final state (``crashed`` included)."""
    edges: dict[tuple[int, str], tuple[int, tuple[int, ...]]] | None = None
    """(state, event) → (target, sends) of every transition: what the engine fires for a family (``owns:``)."""


@dataclass(frozen=True, slots=True)
class _Family:
    """One ``owns:`` entry between roles: the parent role, the roles running the owned machine, its events."""

    parent: int
    children: tuple[int, ...]
    ended: str
    failed: str | None
    forward: frozenset[str]


class LocalSystem:
    """Every reachable local state of one request, the moves between them, and what they violate.

    ``limit`` (local states) and ``deadline`` (a ``time.perf_counter()``
    reading) bound the build: past either it raises :class:`LocalLimit`.
    """

    def __init__(self, system: System, *, limit: int | None = None, deadline: float | None = None) -> None:
        self.system = system
        self.limit = limit
        self.deadline = deadline
        self.channel = system.channel
        self.wire = system.wire
        self.message_names = self.wire.names
        msg_id = self.wire.ids
        role_names = tuple(system.roles)
        role_id = {name: i for i, name in enumerate(role_names)}
        self.receiver = tuple(role_id[system.messages[m].receiver] for m in self.message_names)
        self.reply = tuple(msg_id[r] if (r := system.messages[m].reply_if_finished) else -1 for m in self.message_names)
        self.roles = tuple(self._compile(name, msg_id) for name in role_names)
        self.families = self._families(role_names)
        self.clocks = Clocks(system, [role.states for role in self.roles])
        self._counting(role_id)
        self.properties = system.names
        self.states: list[LocalState] = []
        self.index: dict[LocalState, int] = {}
        self.moves: list[list[tuple[int, Move]]] = []
        """per local id: (target id, move); target -1 for a send that cannot fit (overflow)."""
        self.loops: list[list[Move]] = []
        """per local id: the moves that leave it as it is (the safety search skips them; fairness needs them)."""
        self.violations: list[tuple[tuple[str, str], ...]] = []
        """per local id: (property, what is wrong) for every property the local state breaks."""
        self.nmsg: list[int] = []
        self.passed: set[tuple[str, str]] = set()
        """(role, state) for each state ``begin`` passes through: an initial state that counts to 0 on entry."""
        start = tuple(self._begin(role.name, role.states) for role in self.roles)
        if self.families:  # a parent whose initial state takes ``ended`` and that has no child fires it at begin
            moved = list(start)
            self._owned(start, moved, -1, "", fired=False, begun=True)
            start = tuple(moved)
        self.initial = self._intern(self._normal((start, (), self.clocks.initial(start))))
        self._build()

    # -- compiling the roles -----------------------------------------------------

    def _counting(self, role_id: dict[str, int]) -> None:
        """Where each counted message's sender ranks are remembered: bits above the deadline order's, per receiver."""
        messages = [self.system.messages[m] for m in self.message_names]
        self.count = tuple(m.count for m in messages)
        offsets: dict[tuple[str, str], int] = {}
        width = len(self.clocks.pairs)
        for m in messages:
            if m.count and (m.receiver, m.event) not in offsets:
                offsets[(m.receiver, m.event)] = width
                width += self.system.roles[m.sender].ranks
        self.heard_bit = tuple(1 << (offsets[(m.receiver, m.event)] + m.rank) if m.count else 0 for m in messages)
        self.heard_mask = [0] * len(self.roles)
        for m in messages:
            self.heard_mask[role_id[m.receiver]] |= self.heard_bit[self.wire.ids[m.name]]
        self.heard_of = tuple(
            sum(self.heard_bit[j] for j, o in enumerate(messages) if (o.receiver, o.event) == (m.receiver, m.event))
            for m in messages
        )

    def _begin(self, name: str, states: tuple[str, ...]) -> int:
        """Where ``begin`` leaves a role's instance: its initial state, or past it if that counts to 0 on entry."""
        spec = self.system.roles[name].spec
        chain = entering(spec, spec.initial.name)
        if any(e.transition.sends for e in chain):
            raise ExploreError(
                f"role {name}: its initial state {spec.initial.name!r} counts to 0 on entry, and the transition "
                "that fires at begin sends a message; the explorer cannot send at begin yet"
            )
        self.passed.update((name, e.source) for e in chain)
        return states.index(chain[-1].target if chain else spec.initial.name)

    def _compile(self, name: str, msg_id: dict[str, int]) -> _Role:
        spec = self.system.roles[name].spec
        states = tuple(spec.states)
        sid = {s: i for i, s in enumerate(states)}
        inbox = self.system.inbox(name)
        environment = self.system.environment(name)
        by_event: dict[str, list[int]] = {}
        for msg in inbox.values():
            by_event.setdefault(msg.event, []).append(msg_id[msg.name])
        spontaneous: list[list[tuple[str, int, tuple[int, ...], str, tuple[int, ...]]]] = [[] for _ in states]
        on_message: dict[tuple[int, int], tuple[int, tuple[int, ...], tuple[int, ...]] | None] = {}
        edges: dict[tuple[int, str], tuple[int, tuple[int, ...]]] = {}
        owned = spec.owned_events

        def sent(e: Edge) -> tuple[int, ...]:
            return tuple(msg_id[x] for s in e.transition.sends for x in self.system.outgoing(name, s.message))

        for e in spec.edges():
            if e.source not in sid or e.target not in sid:
                continue
            src, dst = sid[e.source], sid[e.target]
            sends = sent(e)
            via: tuple[int, ...] = ()
            chain = entering(spec, e.target) if e.target != e.source else ()  # a self-loop enters nothing
            if chain:
                sends += tuple(m for then in chain for m in sent(then))
                via, dst = tuple(sid[then.source] for then in chain), sid[chain[-1].target]
            if not via:
                edges[(src, e.event)] = (dst, sends)
            if e.event in owned:  # the engine fires it, for the role's children: never on its own
                if via:
                    raise ExploreError(
                        f"role {name}: {e.event!r} (fired by the engine for its children) enters {e.target!r}, "
                        "which counts to 0 on entry; the explorer cannot follow that yet"
                    )
                continue
            if e.event in by_event:
                for mid in by_event[e.event]:
                    on_message.setdefault((src, mid), (dst, sends, via))
                continue
            if spec.fires_on_timeout(e.source, e.event):
                cause = "timeout"
            elif e.event == ABORT:
                cause = "abort"
            elif e.event == spec.on_error:
                cause = "error"
            elif e.event in environment:
                cause = "environment"
            else:
                cause = "local"
            spontaneous[src].append((e.event, dst, sends, cause, via))
        for state, event, _rule in spec.ignored():
            if state in sid:
                for mid in by_event.get(event, ()):
                    on_message.setdefault((sid[state], mid), None)
        final = [spec.states[s].is_final for s in states]
        failure = [spec.states[s].final == "failure" for s in states]
        holds = [spec.states[s].holds for s in states]
        role = self.system.roles[name]
        crashed = -1
        if role.crash:  # a crash ends any live instance; the lost instance drops what reaches it
            crashed = len(states)
            for src in range(crashed):
                if not final[src]:
                    spontaneous[src].append((CRASH, crashed, (), "crash", ()))
            on_message.update({(crashed, msg_id[m]): None for m in inbox})  # by name: every copy
            states, final, holds = (*states, CRASHED), [*final, True], [*holds, ()]
            failure.append(True)
            spontaneous.append([])
        return _Role(
            name=name,
            states=states,
            final=tuple(final),
            holds=tuple(holds),
            spontaneous=tuple(tuple(x) for x in spontaneous),
            on_message=on_message,
            crashed=crashed,
            restart=role.restart,
            failure=tuple(failure),
            edges=edges,
        )

    def _families(self, role_names: tuple[str, ...]) -> tuple[_Family, ...]:
        """Each ``owns:`` of a role's spec, with the roles (every rank) that run the owned machine."""
        out = []
        for p, name in enumerate(role_names):
            for rule in self.system.roles[name].spec.owns.values():
                kids = tuple(c for c, other in enumerate(role_names) if self.system.roles[other].spec.name == rule.machine)
                out.append(_Family(p, kids, rule.ended, rule.failed, frozenset(rule.forward)))
        return tuple(out)

    def _owned(
        self, before: tuple[int, ...], after: list[int], mover: int, event: str, *, fired: bool, begun: bool = False
    ) -> tuple[tuple[tuple[int, str, int, int], ...], tuple[int, ...]]:
        """What the engine fires for the families when ``mover`` took ``event`` from ``before`` to ``after``
        (changed in place; ``begun``: every role just began): forwarded events, then ``failed`` for each child
        that ended in failure, then ``ended`` while no child is live and the parent's state takes it.
        Returns the transitions fired, in order, and what they sent."""
        effects: list[tuple[int, str, int, int]] = []
        sends: list[int] = []
        roles = self.roles

        def fire(r: int, ev: str) -> bool:
            edges = roles[r].edges
            hit = edges.get((after[r], ev)) if edges is not None else None
            if hit is None:
                return False  # not taken in this state: the engine drops it
            effects.append((r, ev, after[r], hit[0]))
            after[r] = hit[0]
            sends.extend(hit[1])
            return True

        for fam in self.families:
            p = fam.parent
            if fired and mover == p and event in fam.forward:
                for c in fam.children:
                    if not roles[c].final[after[c]]:
                        fire(c, event)  # each live child's state takes it or ignores it (Owner.attach checks)
            ended = [c for c in fam.children if not roles[c].final[before[c]] and roles[c].final[after[c]]]
            if fam.failed is not None:
                for c in ended:
                    if roles[p].final[after[p]]:
                        break  # a parent that has ended no longer hears of its children
                    if roles[c].failure[after[c]]:
                        fire(p, fam.failed)
            changed = begun or bool(ended) or after[p] != before[p]
            for _ in roles[p].states:  # each ``ended`` may enter a state that takes it again
                if not changed or roles[p].final[after[p]] or any(not roles[c].final[after[c]] for c in fam.children):
                    break
                was = after[p]
                changed = fire(p, fam.ended) and after[p] != was
        return tuple(effects), tuple(sends)

    # -- local states --------------------------------------------------------------

    def snapshot(self, at: tuple[int, ...], in_flight: int, last: LastStep | None = None, load: int = 0) -> Snapshot:
        """Role states ``at`` (by index) as the properties see them; ``()`` is a retired request, with no instances."""
        return Snapshot(
            states={role.name: role.states[at[r]] if at else None for r, role in enumerate(self.roles)},
            held={role.name: role.holds[at[r]] if at else () for r, role in enumerate(self.roles)},
            in_flight=in_flight,
            load=load,
            last=last,
        )

    def describe_violations(self, state: LocalState) -> tuple[tuple[str, str], ...]:
        """What a local state breaks: the ``never`` properties, and deadlock or leak when it is stuck."""
        if state == RETIRED:
            return ()
        at, flight, _bits = state
        return tuple(violations(self.system, self.snapshot(at, len(flight))))

    def step_violation(self, at: tuple[int, ...], move: Move, load: int) -> tuple[str, str] | None:
        """The property ``move`` itself breaks, leaving role states ``at`` and ``load`` messages in flight in all."""
        role = self.roles[move.role]
        kept = tuple(self.message_names[m] for m, k in move.sent if k)
        last = LastStep(role.name, move.event, rejected=move.action == "reject", sent=kept)
        return next(violations(self.system, self.snapshot(at, move.in_flight, last, load), on_step=True), None)

    def _normal(self, state: LocalState) -> LocalState:
        """Retire a request whose instances all finished with nothing in flight (unless that breaks a property)."""
        at, flight, _bits = state
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
        self.loops.append([])
        return i

    # -- moves ---------------------------------------------------------------------

    def _sending(
        self, at: tuple[int, ...], role: int, target: int, flight: Flight, sends: tuple[int, ...], event: str = ""
    ) -> Iterator[tuple[Placed, tuple[tuple[int, bool], ...], tuple[tuple[int, str, int, int], ...]]]:
        """The local states after ``role`` fires ``event`` into ``target`` (``""``: stays, a reply) and sends
        ``sends``, one per fate of each message; with what the engine fired for the families in the same move."""
        moved = [*at[:role], target, *at[role + 1 :]]
        owner: tuple[tuple[int, str, int, int], ...] = ()
        if self.families:
            owner, more = self._owned(at, moved, role, event, fired=bool(event))
            sends += more
        placed = tuple(moved)
        for after, sent in self.wire.sends(flight, sends):
            yield (placed, after), sent, owner

    def placed(self, at: tuple[int, ...], move: Move) -> tuple[int, ...]:
        """The role states after ``move`` from ``at``: its role's target, then what the engine fired for it."""
        out = [*at[: move.role], move.target, *at[move.role + 1 :]]
        for r, _event, _source, target in move.owner:
            out[r] = target
        return tuple(out)

    def _successors(self, state: LocalState) -> Iterator[tuple[Placed, Move]]:
        """Every move from ``state`` and where it leaves the roles and the flight (the deadline bits aside)."""
        if state == RETIRED:
            return
        at, flight, bits = state
        clocks = self.clocks
        for r, role in enumerate(self.roles):
            s = at[r]
            if role.final[s]:
                continue
            for event, target, sends, cause, via in role.spontaneous[s]:
                if cause == "timeout" and clocks and clocks.blocked(bits, at, r, event):
                    continue  # a shorter deadline armed no later than this one falls due first
                for nxt, sent, owner in self._sending(at, r, target, flight, sends, event):
                    yield nxt, Move(
                        r, cause, "fire", event, s, target, sent, in_flight=len(nxt[1]), via=via, owner=owner
                    )
        for pos in self.wire.deliverable(flight):
            m = flight[pos]
            r = self.receiver[m]
            role = self.roles[r]
            s = at[r]
            event = self.message_names[m]
            for left, keep in self.wire.deliveries(flight, pos):
                known = (s, m) in role.on_message
                how = role.on_message.get((s, m))
                if role.final[s] and self.reply[m] >= 0 and (s != role.crashed or role.restart):
                    for nxt, sent, _owner in self._sending(at, r, s, left, (self.reply[m],)):
                        yield nxt, Move(r, "message", "reply", event, s, s, sent, m, keep, len(nxt[1]))
                elif known and how is None:
                    yield (at, left), Move(r, "message", "ignore", event, s, s, (), m, keep, len(left))
                elif how is not None and not role.final[s] and self._counts_only(bits, m):
                    yield (at, left), Move(r, "message", "count", event, s, s, (), m, keep, len(left))
                elif how is not None and not role.final[s]:
                    target, sends, via = how
                    for nxt, sent, owner in self._sending(at, r, target, left, sends, event):
                        yield nxt, Move(
                            r, "message", "fire", event, s, target, sent, m, keep, len(nxt[1]), via=via, owner=owner
                        )
                else:
                    yield (at, left), Move(r, "message", "reject", event, s, s, (), m, keep, len(left))

    def _counts_only(self, bits: int, m: int) -> bool:
        """A counted message whose sender is not yet the ``count``-th distinct one: it is remembered, nothing fires."""
        if not self.count[m]:
            return False
        heard = (bits | self.heard_bit[m]) & self.heard_of[m]
        return heard.bit_count() < self.count[m]

    def _after(self, bits: int, move: Move, at: tuple[int, ...]) -> int:
        """The deadline order and counts after ``move``: a fired transition re-arms (each state it passes
        through, in turn); one that leaves its state forgets its counts (a self-loop keeps them, as the engine does)."""
        if move.action == "count":
            return bits | self.heard_bit[move.message]
        if move.action != "fire":
            return bits
        if move.source != move.target or move.via:
            bits &= ~self.heard_mask[move.role]
        for r, _event, source, target in move.owner:
            if source != target:
                bits &= ~self.heard_mask[r]
        if not self.clocks:
            return bits
        r, source = move.role, move.source
        for state in (*move.via, move.target):
            bits = self.clocks.fired(bits, r, source, (*at[:r], state, *at[r + 1 :]))
            source = state
        for r, _event, source, target in move.owner:
            bits = self.clocks.fired(bits, r, source, (*at[:r], target, *at[r + 1 :]))
        return bits

    def _build(self) -> None:
        """Every local state one request can reach with at most ``capacity`` messages in flight."""
        capacity = self.channel.capacity
        todo = [self.initial]
        popped = 0
        while todo:
            i = todo.pop()
            popped += 1
            if not popped % 1024:
                self._within_bounds()
            out = self.moves[i]
            bits = self.states[i][2]
            for (nxt_at, nxt_flight), found in self._successors(self.states[i]):
                broken = self.step_violation(nxt_at, found, found.in_flight)
                move = replace(found, violation=broken[0]) if broken is not None else found
                if found.in_flight > capacity:
                    if broken is not None:  # overflow: the request's own sends do not fit
                        out.append((-1, move))
                    continue
                state = self._normal((nxt_at, nxt_flight, self._after(bits, found, nxt_at)))
                known = state in self.index
                j = self._intern(state)
                if j == i:
                    self.loops[i].append(move)  # a no-op; a rejected duplicate is also caught by its consuming twin
                    continue
                out.append((j, move))
                if not known:
                    todo.append(j)
        self._within_bounds()

    def _within_bounds(self) -> None:
        """Raise :class:`LocalLimit` once the build has more local states than ``limit`` or is past ``deadline``."""
        if self.limit is not None and len(self.states) > self.limit:
            raise LocalLimit(
                f"one request of {self.system.name} alone reaches more than {self.limit:,} local states, the state "
                "bound; raise the bound, or explore fewer ranks or a smaller channel",
                "max_states",
                len(self.states),
            )
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise LocalLimit(
                f"building one request of {self.system.name} ({len(self.states):,} local states so far) ran past "
                "the time bound; raise it, or explore fewer ranks or a smaller channel",
                "time_limit",
                len(self.states),
            )

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
        """(role, state) pairs some request can reach (finished states included, though retired at once, and
        states that count to 0 on entry, though left in the move that enters them)."""
        out: set[tuple[str, str]] = set(self.passed)
        for i, (at, _flight, _bits) in enumerate(self.states):
            for r, s in enumerate(at):
                out.add((self.roles[r].name, self.roles[r].states[s]))
            for j, move in self.moves[i]:
                if j >= 0:
                    role = self.roles[move.role]
                    out.update((role.name, role.states[s]) for s in (*move.via, move.target))
                    out.update((self.roles[r].name, self.roles[r].states[t]) for r, _e, _s, t in move.owner)
        return out
