"""Export a composition to Promela so that SPIN can check it independently of the explorer.

The model is written from the spec model, not from the explorer's tables: the
channel rules (loss at send, delivery that may leave a copy, reordering,
capacity), replies for finished instances, retirement and every property are
encoded again here, in Promela, so that SPIN's verdicts and state counts are
a second opinion rather than a replay.

Shape: one process per request (``active [N] proctype request``; ``_pid`` is
the request), each a ``do`` loop whose every option is one ``d_step``, so the
only control location is the loop head and a stored state is exactly the
variables: each role's state per request (one past its last state once the
request retired), the request's messages in flight (counts per message if
the channel reorders, else one queue per direction), and the total in
flight. Compiled
with ``-DNOREDUCE``, ``pan`` stores exactly the states the explorer counts
with ``symmetry=False, merge=False``.

Properties are assertions; ``spin -DONLY=k`` keeps only property k (numbered
in the header). ``-DREPORT`` replaces the assertions by a line
``kvfsm: violated <name>`` printed once per property, so one full run gives
every verdict and the state count.

What the system file adds is encoded too: the deadline order of its
``relations`` (one bit per ordered pair of deadlines, a state's own or a
phase's, guarding each timeout; :mod:`kvfsm.explore.clocks`), one role
variable per rank and one message per (sender, receiver) instance, a byte per
counted message remembering the sender ranks heard, the ``crashed`` state of
a role that may crash, and, under ``-DLIVE``, the fairness bookkeeping and
one LTL formula per ``eventually`` property (``pan -a -N <name>``).

A phase's timeout is a timeout of each of the phase's states: its guard is
the phase's deadline order, and since its firing leaves the phase (KVF118)
it fires once per entry; under ``-DLIVE`` each phase is also an obligation
(a fair run does not stay inside it forever). A transition into a state
that counts to 0 on entry goes on with the counted transition in the same
``d_step`` (:mod:`kvfsm.explore.entry`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from itertools import product

from ..explore.clocks import Clocks
from ..explore.entry import entering
from ..explore.limits import ExploreError
from ..spec.model import Edge, Send, Spec
from ..spec.system import Message, System
from ..spec.system.model import CRASHED


def _ident(name: str) -> str:
    """A name as a Promela identifier: an instance's ``#`` and a copy's ``@`` and ``>`` become ``_``."""
    return re.sub(r"\W", "_", name)


class _Model:
    """Names and expressions shared by every part of the generated model."""

    def __init__(self, system: System, requests: int) -> None:
        system = system.expanded()
        self.system = system
        self.n = requests
        self.cap = system.channel.capacity
        self.roles = list(system.roles)
        self.specs: dict[str, Spec] = {name: r.spec for name, r in system.roles.items()}
        self.messages = list(system.messages)
        directions: dict[tuple[str, str], int] = {}
        for m in system.messages.values():
            directions.setdefault((m.sender, m.receiver), len(directions))
        self.direction = {m.name: directions[(m.sender, m.receiver)] for m in system.messages.values()}
        self.directions = len(directions)
        self.props = list(system.names)
        self.order: dict[str, list[str]] = {
            name: [*r.spec.states, *([CRASHED] if r.crash else [])] for name, r in system.roles.items()
        }
        """Each role's states in value order: the spec's, then ``crashed`` for a role that may crash."""
        self.clocks = Clocks(system, list(self.order.values()))
        self.begin: dict[str, str] = {}
        """Where ``begin`` leaves each role: its initial state, or past it where that counts to 0 on entry."""
        for name, spec in self.specs.items():
            chain = entering(spec, spec.initial.name)
            if any(e.transition.sends for e in chain):
                raise ExploreError(
                    f"role {name}: its initial state {spec.initial.name!r} counts to 0 on entry, and the transition "
                    "that fires at begin sends a message; the export cannot send at begin yet"
                )
            self.begin[name] = chain[-1].target if chain else spec.initial.name
        heard: dict[tuple[str, str], int] = {}
        for msg in system.messages.values():
            if msg.count:
                heard.setdefault((msg.receiver, msg.event), len(heard))
        self.heard = heard
        """(receiver instance, counted event) → the index of the variable remembering which sender ranks it heard."""

    # -- deadline order (the system's relations) -------------------------------------

    def armed(self, slot: int, shorter_than: tuple[str, str] | None = None) -> str:
        """Deadline ``slot`` (a state's own or a phase's) is armed (and declared shorter than ``shorter_than``, if
        given): its role is in one of the states where it is."""
        s = self.clocks.slots[slot]
        name = self.roles[s.role]
        states = [
            state
            for state, p in zip(self.order[name], s.param, strict=True)
            if p is not None and (shorter_than is None or self.system.timing.outlasts(shorter_than, p))
        ]
        return self.is_state(name, states)

    def deadline(self, slot: int, noun: str = " deadline") -> str:
        """Deadline ``slot`` in words: ``decode's deadline``, ``prefill's lease deadline`` (a phase's)."""
        s = self.clocks.slots[slot]
        return f"{self.roles[s.role]}'s{' ' + s.phase + ' deadline' if s.phase else noun}"

    def blocked(self, role: str, state: str, event: str) -> list[str]:
        """Guards that keep ``role``'s timeout ``event`` in ``state`` from firing: for each of its deadlines that
        fires ``event`` there, a shorter deadline armed no later; the event fires if one of them is not held back."""
        r = self.roles.index(role)
        i = self.order[role].index(state)
        options = []
        for b in self.clocks.of_role[r]:
            slot = self.clocks.slots[b]
            if slot.fire[i] != event:
                continue
            guards = []
            for a, bit in self.clocks.shorter[b]:
                shorter = self.armed(a, slot.param[i])
                if shorter != "false":
                    guards.append(f"!(o_{bit.bit_length() - 1}[_pid] && {shorter})")
            if not guards:
                return []  # this deadline is never held back
            options.append(guards)
        if len(options) <= 1:
            return options[0] if options else []
        return ["(" + " || ".join("(" + " && ".join(g) + ")" for g in options) + ")"]

    def counted(self, msg: Message) -> tuple[str, str]:
        """For a counted message: (the ranks heard once it arrives, the guard that this copy is the last one owed)."""
        var = f"h_{self.heard[(msg.receiver, msg.event)]}[_pid]"
        heard = f"({var} | {1 << msg.rank})"
        width = len(self.system.instances_of(self.system.base_of(msg.sender)))
        enough = [x for x in range(1 << width) if x.bit_count() >= msg.count]
        return heard, "(" + " || ".join(f"{heard} == {x}" for x in enough) + ")"

    def rearm(self, role: str, source: str, target: str) -> list[str]:
        """What ``role`` firing from ``source`` into ``target`` does to the deadline order bits and to the counts
        it kept (a count lives for one stay in a state: a self-loop keeps it)."""
        r = self.roles.index(role)
        lines = [
            f"h_{k}[_pid] = 0" for (receiver, _e), k in self.heard.items() if receiver == role and source != target
        ]
        order = self.order[role]
        fresh, gone = self.clocks.moved(r, order.index(source) if source in order else None, order.index(target))
        touched = 0
        for k in (*fresh, *gone):
            touched |= self.clocks.touching[k]
        lines += [f"o_{k}[_pid] = 0" for k in range(len(self.clocks.pairs)) if touched >> k & 1]
        for b in fresh:
            for a, bit in self.clocks.shorter[b]:
                lines.append(f"if :: {self.armed(a)} -> o_{bit.bit_length() - 1}[_pid] = 1 :: else -> skip fi")
        return lines

    def var(self, role: str, who: str = "_pid") -> str:
        return f"r_{_ident(role)}[{who}]"

    def const(self, role: str, state: str) -> str:
        return f"s_{_ident(role)}_{state}"

    def prop(self, name: str) -> int:
        return self.props.index(name) + 1

    def retired(self, role: str) -> int:
        """The value a role's variable takes once its request retired: one past its last state."""
        return len(self.order[role])

    def is_state(self, role: str, states: list[str], who: str = "_pid") -> str:
        """``role`` is in one of ``states``: a bit test (short code, so pan.c compiles fast) where it fits an int."""
        var = self.var(role, who)
        if not states:
            return "false"
        if len(states) == 1:
            return f"({var} == {self.const(role, states[0])})"
        if self.retired(role) < 31:
            order = self.order[role]
            mask = sum(1 << order.index(s) for s in states)
            return f"(((1 << {var}) & {mask}) != 0)"
        return "(" + " || ".join(f"{var} == {self.const(role, s)}" for s in states) + ")"

    # -- messages in flight -------------------------------------------------------

    def in_flight(self) -> str:
        """This request's messages in flight."""
        if self.system.channel.reorder:
            parts = [f"m_{_ident(m)}[_pid]" for m in self.messages]
        else:
            parts = [f"n_{d}[_pid]" for d in range(self.directions)]
        return "(" + " + ".join(parts or ["0"]) + ")"

    def has(self, message: str, who: str = "_pid") -> str:
        """``message`` of request ``who`` may arrive now (in flight; the oldest of its direction without reorder)."""
        if self.system.channel.reorder:
            return f"m_{_ident(message)}[{who}] > 0"
        d = self.direction[message]
        return f"n_{d}[{who}] > 0 && q_{d}[{who} * CAP] == {self.messages.index(message) + 1}"

    def consume(self, message: str) -> list[str]:
        if self.system.channel.reorder:
            return [f"m_{_ident(message)}[_pid]--", "inflight--"]
        d = self.direction[message]
        shift = [f"q_{d}[_pid * CAP + {i}] = q_{d}[_pid * CAP + {i + 1}]" for i in range(self.cap - 1)]
        return [*shift, f"q_{d}[_pid * CAP + {self.cap - 1}] = 0", f"n_{d}[_pid]--", "inflight--"]

    def add(self, message: str) -> list[str]:
        if self.system.channel.reorder:
            return [f"m_{_ident(message)}[_pid]++", "inflight++"]
        d = self.direction[message]
        return [
            f"q_{d}[_pid * CAP + n_{d}[_pid]] = {self.messages.index(message) + 1}",
            f"n_{d}[_pid]++",
            "inflight++",
        ]

    # -- properties ----------------------------------------------------------------

    def never_conditions(self) -> list[tuple[str, str]]:
        """(property, expression over this request's role states) per never property."""
        out = []
        for prop in self.system.never:
            parts = []
            for c in prop.when:
                spec = self.specs[self.system.instances_of(c.role)[0]]
                ok = [
                    s
                    for s, st in spec.states.items()
                    if (not c.states or s in c.states)
                    and set(c.holds) <= set(st.holds)
                    and not set(c.lacks) & set(st.holds)
                ]
                if self.system.roles[self.system.instances_of(c.role)[0]].crash and not c.states and not c.holds:
                    ok.append(CRASHED)  # a lost instance holds nothing
                parts.append("(" + " || ".join(self.is_state(i, ok) for i in self.system.instances_of(c.role)) + ")")
            out.append((prop.name, " && ".join(parts)))
        return out

    def progress(self, role: str) -> list[str]:
        """States where some local event other than abort / on_error can happen."""
        spec = self.specs[role]
        inbox = {m.event for m in self.system.inbox(role).values()}
        env = self.system.environment(role)
        return sorted(
            {e.source for e in spec.edges() if e.event not in inbox and e.event not in env},
            key=list(spec.states).index,
        )

    def live(self, role: str) -> list[str]:
        return [s for s, st in self.specs[role].states.items() if not st.is_final]

    def holding(self, role: str) -> list[str]:
        return [s for s, st in self.specs[role].states.items() if not st.is_final and st.holds]

    def final(self, role: str) -> list[str]:
        crashed = [CRASHED] if self.system.roles[role].crash else []
        return [s for s, st in self.specs[role].states.items() if st.is_final] + crashed

    def owed(self, role: str) -> list[str]:
        """States where the role owes local work or a timeout (weak fairness): live states that progress."""
        return [s for s in self.progress(role) if not self.specs[role].states[s].is_final]

    def enabled(self, obligation: int, who: str) -> str:
        """Obligation ``obligation`` of request ``who`` is enabled: a role's own work, a message's delivery,
        leaving a phase the role is in (time passes: its deadline ends the stay), or a role's progress (its own
        work can take it to another state)."""
        if obligation < len(self.roles):
            role = self.roles[obligation]
            return self.is_state(role, self.owed(role), who)
        if obligation < len(self.roles) + len(self.messages):
            return f"({self.has(self.messages[obligation - len(self.roles)], who)})"
        if obligation >= self.leave:
            role = self.roles[obligation - self.leave]
            return self.is_state(role, [s for s in self.live(role) if self.system.leaves(role, s)], who)
        slot = self.clocks.slots[self.phase_slots[obligation - len(self.roles) - len(self.messages)]]
        role = self.roles[slot.role]
        return self.is_state(role, [s for s, p in zip(self.order[role], slot.param, strict=True) if p is not None], who)

    @property
    def phase_slots(self) -> list[int]:
        """The deadline slots of phases (:class:`~kvfsm.explore.clocks.Slot`), each a fairness obligation."""
        return [k for k, slot in enumerate(self.clocks.slots) if slot.phase]

    @property
    def leave(self) -> int:
        """The first progress obligation: role k's is ``leave + k``."""
        return len(self.roles) + len(self.messages) + len(self.phase_slots)

    @property
    def obligations(self) -> int:
        """Fairness obligations per request: one per role, one per message, one per phase of a role, and one
        per role for its progress (numbered as the explorer's :class:`~kvfsm.explore.liveness.Fairness`)."""
        return self.leave + len(self.roles)


def _fates(m: _Model, sends: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """The messages kept, for each way the channel may treat ``sends``."""
    options = [(True, False) if m.system.channel.loss else (True,) for _ in sends]
    for choice in product(*options):
        yield tuple(msg for msg, kept in zip(sends, choice, strict=True) if kept)


def _option(
    m: _Model,
    comment: str,
    guard: list[str],
    consumed: int,
    kept: tuple[str, ...],
    body: list[str],
    took: tuple[int, bool, int],
) -> list[str]:
    """One d_step: the guard, then the body with the kept sends; plus the overflow twin for a reliable channel.

    ``took``: the fairness obligation the step discharges (``NOBODY`` for the
    environment's), whether the channel misbehaved (lost or duplicated), and
    the role whose instance it takes to another state (``NOBODY`` if none:
    that discharges the role's progress obligation).
    """
    growth = len(kept) - consumed
    lines = [f"  /* {comment}{'; keeps ' + ', '.join(kept) if kept else ''} */"]
    cond = list(guard)
    if growth > 0:
        cond.append(f"inflight + {growth} <= CAP")
    stmts = [*body, *(s for msg in kept for s in m.add(msg)), f"took({took[0]}, {int(took[1])}, {took[2]})", "after()"]
    lines.append(f"  :: d_step {{ {' && '.join(cond)} ->")
    lines += [f"       {s};" for s in stmts[:-1]] + [f"       {stmts[-1]} }}"]
    if growth > 0 and not m.system.channel.loss and "overflow" in m.props:
        lines.append(
            f"  :: d_step {{ {' && '.join([*guard, f'inflight + {growth} > CAP'])} -> violated_{m.prop('overflow')}() }}"
        )
    return lines


def _spontaneous(m: _Model, role: str) -> Iterator[str]:
    spec = m.specs[role]
    inbox = {msg.event for msg in m.system.inbox(role).values()}
    for e in spec.edges():
        if e.event in inbox or e.source not in spec.states or e.target not in spec.states:
            continue
        if spec.states[e.source].is_final:
            continue
        target, sends, body = _enter(m, role, e)
        timeout = spec.fires_on_timeout(e.source, e.event)
        owed = timeout or e.event not in m.system.environment(role)
        moved = m.roles.index(role) if e.target != e.source else NOBODY
        for kept in _fates(m, sends):
            yield from _option(
                m,
                f"{role}: {e.event} in {e.source} -> {target}",
                [
                    f"{m.var(role)} == {m.const(role, e.source)}",
                    *(m.blocked(role, e.source, e.event) if timeout else []),
                ],
                0,
                kept,
                body,
                (m.roles.index(role) if owed else NOBODY, len(kept) < len(sends), moved),
            )
    if m.system.roles[role].crash:
        for state, st in spec.states.items():
            if not st.is_final:
                yield from _option(
                    m,
                    f"{role}: the process crashes in {state}; the instance and what it held are lost",
                    [f"{m.var(role)} == {m.const(role, state)}"],
                    0,
                    (),
                    [f"{m.var(role)} = {m.const(role, CRASHED)}", *m.rearm(role, "", CRASHED)],
                    (NOBODY, False, m.roles.index(role)),
                )


def _enter(m: _Model, role: str, e: Edge) -> tuple[str, tuple[str, ...], list[str]]:
    """Firing ``e``: (where the instance ends, the messages sent, the statements). A target that counts to 0 on
    entry goes on at once with its counted transition, in the same step (:mod:`kvfsm.explore.entry`)."""
    sends = _sends(m, role, e.transition.sends)
    target = e.target
    body = [f"{m.var(role)} = {m.const(role, target)}", *m.rearm(role, e.source, target)]
    for then in entering(m.specs[role], e.target) if e.target != e.source else ():
        sends += _sends(m, role, then.transition.sends)
        target = then.target
        body += [f"{m.var(role)} = {m.const(role, target)}", *m.rearm(role, then.source, target)]
    return target, sends, body


def _sends(m: _Model, role: str, sends: tuple[Send, ...]) -> tuple[str, ...]:
    """The wire messages a transition's sends put in flight from instance ``role``: one per receiving instance."""
    return tuple(x for send in sends for x in m.system.outgoing(role, send.message))


def _deliveries(m: _Model, name: str) -> Iterator[str]:
    msg = m.system.messages[name]
    role = msg.receiver
    spec = m.specs[role]
    targets = {e.source: e for e in spec.edges() if e.event == msg.event}
    ignored = {st for st, ev, _r in spec.ignored() if ev == msg.event}
    keeps = (False, True) if m.system.channel.duplicate else (False,)
    crash = m.system.roles[role]
    for state in m.order[role]:
        guard = [f"{m.var(role)} == {m.const(role, state)}", m.has(name)]
        what: str
        sends: tuple[str, ...]
        target: str | None = None
        moves: list[str] = []
        final = m.system.finished(role, state)
        if state == CRASHED and not (crash.restart and msg.reply_if_finished is not None):
            what, sends = "the instance was lost in a crash: dropped", ()
        elif final and msg.reply_if_finished is not None:
            what, sends = f"finished, its server answers {msg.reply_if_finished}", (msg.reply_if_finished,)
        elif state in ignored and state not in targets:
            what, sends = "ignored", ()
        elif state in targets and not final:
            target, sends, moves = _enter(m, role, targets[state])
            what = f"-> {target}"
        else:
            what, sends = f"rejected ({'late_message' if final else 'unexpected_message'})", ()
        moved = m.roles.index(role) if target is not None and targets[state].target != state else NOBODY
        if target is not None and msg.count:
            heard, last = m.counted(msg)
            yield from _counting(m, msg, state, [*guard, f"!{last}"], keeps, heard)
            guard = [*guard, last]
        for keep in keeps:
            consume = [] if keep else m.consume(name)
            body = list(consume)
            body += moves
            if what.startswith("rejected"):
                kind = "late_message" if final else "unexpected_message"
                if kind in m.props:
                    body.insert(0, f"violated_{m.prop(kind)}()")
            for kept in _fates(m, sends):
                yield from _option(
                    m,
                    f"{name} reaches {role} in {state}: {what}{'; a copy stays' if keep else ''}",
                    guard,
                    0 if keep else 1,
                    kept,
                    body or ["skip"],
                    (len(m.roles) + m.messages.index(name), keep or len(kept) < len(sends), moved),
                )


def _counting(
    m: _Model, msg: Message, state: str, guard: list[str], keeps: tuple[bool, ...], heard: str
) -> Iterator[str]:
    """A counted copy from a sender rank not yet the ``count``-th: remembered in ``h``, the instance stays."""
    for keep in keeps:
        yield from _option(
            m,
            f"{msg.name} reaches {msg.receiver} in {state}: counted{'; a copy stays' if keep else ''}",
            guard,
            0 if keep else 1,
            (),
            [*([] if keep else m.consume(msg.name)), f"h_{m.heard[(msg.receiver, msg.event)]}[_pid] = {heard}"],
            (len(m.roles) + m.messages.index(msg.name), keep, NOBODY),
        )


def _after(m: _Model) -> list[str]:
    """Checks on the request that just moved, then its retirement (never for a state that breaks a property)."""
    lines = ["inline after() {"]
    nevers = m.never_conditions()
    for prop, cond in nevers:
        lines.append(f"  if :: {cond} -> violated_{m.prop(prop)}() :: else -> skip fi;")
    quiet = " && ".join([f"{m.in_flight()} == 0", *(f"!{m.is_state(r, m.progress(r))}" for r in m.roles)])
    live = " || ".join(m.is_state(r, m.live(r)) for r in m.roles)
    holding = " || ".join(m.is_state(r, m.holding(r)) for r in m.roles)
    stuck = []
    if "leak" in m.props:
        stuck.append(f":: {holding} -> violated_{m.prop('leak')}()")
    if "deadlock" in m.props:
        stuck.append(f":: ({live}) && !({holding}) -> violated_{m.prop('deadlock')}()")
    if stuck:
        lines.append(f"  if :: {quiet} -> if {' '.join(stuck)} :: else -> skip fi :: else -> skip fi;")
    done = " && ".join([f"{m.in_flight()} == 0", *(m.is_state(r, m.final(r)) for r in m.roles)])
    clean = "".join(f" && !({cond})" for _p, cond in nevers)
    retire = "; ".join(f"{m.var(r)} = {m.retired(r)}" for r in m.roles)
    lines.append(f"  if :: {done}{clean} -> {retire} :: else -> skip fi;")
    lines.append("  fairness()")
    lines.append("}")
    return lines


NOBODY = 255
"""The obligation an environment move (abort, the on_error event, staying put) discharges: none."""


def _liveness(m: _Model) -> list[str]:
    """With ``-DLIVE``: the fairness bookkeeping, and one LTL formula per ``eventually`` property.

    Fairness (as the explorer assumes it, :mod:`kvfsm.explore.liveness`):
    obligation k of request q (role k's local work and timeouts, the
    delivery of message k - roles, after those leaving a phase, and last
    each role's progress) is weakly fair, checked round-robin by ``wf``: it
    advances past k when k is not enabled or was just discharged (no step
    discharges a phase's: only being outside it does; a role's progress is
    discharged by any step that takes the role to another state, ``lastm``),
    and ``wf == K`` infinitely often means every obligation was honoured. A
    fair run also misbehaves finitely often (``<>[] !chaos``: eventually no
    message is lost or duplicated).
    """
    total = m.n * m.obligations

    def discharged(k: int) -> str:
        return f"lastm == {k - m.leave}" if k >= m.leave else f"lasto == {k}"

    rounds = [  # in order, so that one step may see several honoured
        f"  if :: wf == {q * m.obligations + k} && (!{m.enabled(k, str(q))} || (lastp == {q} && {discharged(k)}))"
        " -> wf++ :: else -> skip fi;"
        for q in range(m.n)
        for k in range(m.obligations)
    ]
    fair = "([]<> (wf == K) && <>[] !chaos)"
    lines = [
        "#ifdef LIVE",
        f"#define K {total}",
        f"{'byte' if total < 255 else 'short'} wf;  /* the next fairness obligation to see honoured */",
        f"byte lastp = {NOBODY}, lasto = {NOBODY};  /* who discharged which obligation in the last step */",
        f"byte lastm = {NOBODY};  /* the role the last step took to another state (its progress) */",
        "bit chaos;                     /* the last step lost or duplicated a message */",
        "inline took(o, c, mv) { lastp = _pid; lasto = o; chaos = c; lastm = mv }",
        "inline fairness() {",
        "  if :: wf == K -> wf = 0 :: else -> skip fi;",
        *rounds,
        "  skip",
        "}",
    ]
    for prop in m.system.eventually:
        goals: list[str] = []
        for q in range(m.n):
            if prop.kind == "final":
                done = " && ".join(m.is_state(r, m.final(r), str(q)) for r in m.roles)
                goals.append(f"<> ({m.var(m.roles[0], str(q))} == {m.retired(m.roles[0])} || ({done}))")
            else:
                for r in m.roles:
                    for x in sorted({x for st in m.specs[r].states.values() for x in st.holds}):
                        held = [s for s, st in m.specs[r].states.items() if x in st.holds]
                        goals.append(f"[]<> !{m.is_state(r, held, str(q))}")
        lines.append(f"ltl {prop.name} {{ {fair} -> ({' && '.join(goals) or 'true'}) }}")
    lines += [
        "#else",
        "inline took(o, c, mv) { skip }",
        "inline fairness() { skip }",
        "#endif",
    ]
    return lines


def _liveness_hint(system: System) -> list[str]:
    """The header line that says how to check the ``eventually`` properties, if there are any."""
    if not system.eventually:
        return []
    names = ", ".join(p.name for p in system.eventually)
    return [
        f" * Liveness ({names}): spin -DLIVE -DONLY={NOBODY} -a model.pml"
        " && gcc -O2 -DNOREDUCE -o pan pan.c && ./pan -a -N <name>"
    ]


def _stutter(m: _Model) -> list[str]:
    """With ``-DLIVE``: a live request that owes nothing may stay as it is forever (abort is never owed)."""
    owes = " || ".join(m.enabled(k, "_pid") for k in range(m.obligations))
    alive = f"{m.var(m.roles[0])} != {m.retired(m.roles[0])}"
    return [
        "#ifdef LIVE",
        "  /* nothing owed: the request may stay as it is forever */",
        f"  :: d_step {{ {alive} && !({owes}) -> took({NOBODY}, 0, {NOBODY}); after() }}",
        "#endif",
    ]


def _initial_violations(m: _Model) -> list[str]:
    """Properties the initial state itself breaks (checked before the loop; rare enough to cost one extra state)."""
    out = []
    init = dict(m.begin)
    first = {c.role: m.system.instances_of(c.role)[0] for p in m.system.never for c in p.when}
    for prop in m.system.never:
        if all(
            (not c.states or init[first[c.role]] in c.states)
            and set(c.holds) <= set(m.specs[first[c.role]].states[init[first[c.role]]].holds)
            and not set(c.lacks) & set(m.specs[first[c.role]].states[init[first[c.role]]].holds)
            for c in prop.when
        ):
            out.append(prop.name)
    if all(init[r] not in m.progress(r) for r in m.roles) and any(init[r] in m.live(r) for r in m.roles):
        held = any(init[r] in m.holding(r) for r in m.roles)
        kind = "leak" if held else "deadlock"
        if kind in m.props:
            out.append(kind)
    return out


def to_promela(system: System, *, requests: int | None = None) -> str:
    """The composition as a Promela model for ``requests`` requests (default: the system's)."""
    n = requests if requests is not None else system.requests
    if n < 1:
        raise ValueError(f"requests must be at least 1, not {n}")
    owners = [name for name, r in system.roles.items() if r.spec.owns]
    if owners:
        raise ExploreError(
            f"{system.name}: role {owners[0]} owns instances of another machine (owns:), which the Promela export "
            "does not model yet; kvfsm explore checks the system"
        )
    m = _Model(system, n)
    c = system.channel
    lines = [
        f"/* kvfsm composition {system.name!s} ({system.path}), exported for SPIN.",
        f" * {n} request(s); channel: loss {str(c.loss).lower()}, duplicate {str(c.duplicate).lower()},"
        f" reorder {str(c.reorder).lower()}, capacity {c.capacity}.",
        " * Properties (spin -DONLY=k checks only k; -DREPORT prints each violated one and explores everything):",
    ]
    for k, prop in enumerate(m.props, start=1):
        lines.append(f" *   {k} {prop}: {system.property_named(prop).describe()}")
    lines += [
        " * Run: spin -a model.pml && gcc -O2 -DSAFETY -DNOREDUCE -o pan pan.c && ./pan -m5000000",
        *_liveness_hint(system),
        " */",
        f"#define N {n}",
        f"#define CAP {c.capacity}",
        "#ifndef ONLY",
        "#define ONLY 0",
        "#endif",
        "#define CHECK(k) (ONLY == 0 || ONLY == k)",
        "#ifdef REPORT",
        f"c_decl {{ int kvfsm_seen[{len(m.props) + 1}]; }}",
        "#endif",
        "",
    ]
    for role in m.roles:
        spec = m.specs[role]
        lines.append(f"/* role {role}: machine {spec.name} ({m.system.roles[role].path}) */")
        for i, state in enumerate(m.order[role]):
            lines.append(f"#define {m.const(role, state)} {i}")
        lines.append(f"byte {m.var(role, '').removesuffix('[]')}[N] = {m.const(role, m.begin[role])};")
        lines.append("")
    lines.append("/* messages in flight, per request */")
    if c.reorder:
        for name in m.messages:
            sent = m.system.messages[name]
            lines.append(f"byte m_{_ident(name)}[N];  /* {name}: {sent.sender} -> {sent.receiver} */")
    else:
        for d in range(m.directions):
            names = [x for x in m.messages if m.direction[x] == d]
            lines.append(f"byte q_{d}[N * CAP];  /* FIFO per request: {', '.join(names)} (message id + 1) */")
            lines.append(f"byte n_{d}[N];")
    lines.append("byte inflight;  /* all requests together: what CAP bounds */")
    for (receiver, event), k in m.heard.items():
        lines.append(f"byte h_{k}[N];  /* the sender ranks {receiver} has heard {event} from */")
    start = [m.order[r].index(m.begin[r]) for r in m.roles]
    begun = m.clocks.initial(start)
    for k, (e, r) in enumerate(m.clocks.pairs):
        lines.append(
            f"bit o_{k}[N] = {(begun >> k) & 1};  /* {m.deadline(e)} armed no later than {m.deadline(r, '')} */"
        )
    lines.append("")
    lines.append("/* always false; hidden (not part of a state), they only name the property in SPIN's report */")
    for prop in m.props:
        lines.append(f"hidden byte holds_{prop} = 0;")
    for k, prop in enumerate(m.props, start=1):
        lines += [
            f"inline violated_{k}() {{  /* {prop} */",
            "#ifdef REPORT",
            f"  c_code {{ if (!kvfsm_seen[{k}]) {{ kvfsm_seen[{k}] = 1;"
            f' printf("kvfsm: violated {prop} after %.0f states\\n", nstates); fflush(stdout); }} }}',
            "#else",
            f"  assert(holds_{prop} || !CHECK({k}))",
            "#endif",
            "}",
        ]
    lines.append("")
    lines += _liveness(m)
    lines.append("")
    lines += _after(m)
    lines.append("")
    lines.append("active [N] proctype request() {")
    for prop in _initial_violations(m):
        lines.append(f"  d_step {{ violated_{m.prop(prop)}() }};")
    lines.append("end:")
    lines.append("  do")
    for role in m.roles:
        lines.extend(_spontaneous(m, role))
    for name in m.messages:
        lines.extend(_deliveries(m, name))
    lines.extend(_stutter(m))
    lines.append("  od")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- checking the export with SPIN -----------------------------------------------------
