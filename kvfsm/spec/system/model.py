"""The immutable model of a composition: roles, the messages between them, the channel and the properties.

A system file names its roles (each a machine spec), the messages their
transitions ``send``, what the channel may do to messages, how many requests
to explore, and the properties to check. A message's name is an event of the
role that receives it; that event happens only when the message is delivered.
Facts derived from the roles (each role's inbox, the states local work can
move on) are computed here once, for the checks, the explorer and trace replay.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

from ..model import ABORT, NOWHERE, Loc, Spec
from .channel import Channel, Wire

BUILTINS: Mapping[str, str] = {
    "deadlock": "a live instance that nothing can move on: no local event, no timeout, nothing in flight for its request",
    "leak": "the same, while the stuck instance holds resources: they would stay held forever",
    "late_message": "a message reaches a finished instance whose final state does not ignore it",
    "unexpected_message": "a message reaches a live state that neither handles nor ignores it (IllegalTransition)",
    "overflow": "a send finds the channel full although the channel may not lose messages",
}
"""The properties every exploration checks unless ``properties: builtins:`` narrows them."""

LIVENESS: Mapping[str, str] = {
    "final": "every request eventually has every instance in a final state (under fairness)",
    "released": "every resource an instance holds is eventually released (under fairness)",
}
"""The ``eventually`` properties a system may ask for: checked on infinite runs, broken by a lasso."""

PropertyKind = Literal[
    "never", "deadlock", "leak", "late_message", "unexpected_message", "overflow", "final", "released"
]

ON_STEP: frozenset[str] = frozenset({"late_message", "unexpected_message", "overflow"})
"""Kinds broken by a step itself (a delivery, a send), not by the state a request is in."""


CRASH = "crash"
"""The event of a role whose process crashes: every instance it has is lost at once."""
CRASHED = "crashed"
"""Where a crashed role's instance is: finished, holding nothing; messages for it are dropped (or answered)."""


@dataclass(frozen=True, slots=True)
class Role:
    """One machine of the composition; every request has one instance of every role.

    ``crash``: the role's process may crash at any moment; its instances lose
    their state and what they held (what the other roles hold stays held).
    ``restart``: the process comes back, knowing none of the old requests:
    its server answers a message that has a ``reply_if_finished`` as it
    answers for a finished request. Without restart nothing answers.
    """

    name: str
    spec: Spec
    path: str
    doc: str = ""
    loc: Loc = NOWHERE
    crash: bool = False
    restart: bool = True
    ranks: int = 1
    """Instances of this role per request (one per TP rank); a message to the role goes to each of them."""
    environment: tuple[str, ...] = ()
    """Events of the role that come from outside the composition (``environment: [release]``): like ``abort``,
    they may happen whenever the state has a transition for them, and no fair run owes them."""


@dataclass(frozen=True, slots=True)
class Message:
    """A message ``sender`` sends ``receiver``; its name is an event of ``receiver``.

    ``reply_if_finished`` names the message the receiving *server* answers with
    when the instance has already finished (SGLang's bootstrap thread ACKs an
    ABORT for a completed or unknown room): the instance does not move.
    """

    name: str
    sender: str
    receiver: str
    reply_if_finished: str | None = None
    doc: str = ""
    loc: Loc = NOWHERE
    count: int = 0
    """With ranks: the receiver's transition fires on the copy from the ``count``-th distinct sender rank; the
    copies before it are only counted. 0: every copy fires it; -1 (``count: all``): every sender rank."""
    base: str = ""
    """The declared message this one is a copy of, one per (sender instance, receiver instance); its name is the
    receiver's event. Empty for a declared message (the event is its name)."""
    rank: int = 0
    """The sender instance's rank (what a count tells apart)."""

    @property
    def event(self) -> str:
        """The receiver's event this message fires."""
        return self.base or self.name


@dataclass(frozen=True, slots=True)
class TimeRelation:
    """``longer > shorter + ...`` between role-qualified params (``prefill.abort_timeout``): which deadline outlasts.

    Params are durations, so ``a > b + c`` implies ``a > b`` and ``a > c``;
    that consequence is all the explorer uses (see :class:`Timing`).
    """

    longer: tuple[str, str]
    """(role, param) on the left."""
    shorter: tuple[tuple[str, str], ...]
    """(role, param) per term on the right."""
    text: str
    loc: Loc = NOWHERE


class Timing:
    """Which armed deadline must expire before which, from the system's relations (transitively closed).

    ``outlasts(a, b)``: param ``a`` (role-qualified) is declared longer than
    ``b``. A deadline armed no later than another and shorter than it expires
    first: :mod:`kvfsm.explore.local` keeps, per pair of roles, whether one's
    deadline was armed no later than the other's, and lets a timeout fire only
    when no such shorter deadline is still armed.
    """

    def __init__(self, relations: tuple[TimeRelation, ...]) -> None:
        longer: dict[tuple[str, str], set[tuple[str, str]]] = {}
        for rel in relations:
            longer.setdefault(rel.longer, set()).update(rel.shorter)
        changed = True
        while changed:
            changed = False
            for small in longer.values():
                more = set().union(*(longer.get(x, set()) for x in small)) - small
                if more:
                    small |= more
                    changed = True
        self._longer = {k: frozenset(v) for k, v in longer.items()}

    def outlasts(self, big: tuple[str, str], small: tuple[str, str]) -> bool:
        return small in self._longer.get(big, frozenset())

    def cycles(self) -> list[tuple[str, str]]:
        """Params declared longer than themselves (through a chain of relations): no timing can satisfy them."""
        return sorted(k for k, v in self._longer.items() if k in v)

    def __bool__(self) -> bool:
        return bool(self._longer)


@dataclass(frozen=True, slots=True)
class Condition:
    """What one role's instance must look like: in one of ``states`` (any if empty), holding and lacking resources."""

    role: str
    states: tuple[str, ...] = ()
    holds: tuple[str, ...] = ()
    lacks: tuple[str, ...] = ()
    loc: Loc = NOWHERE

    def matches(self, state: str | None, held: Collection[str]) -> bool:
        """Whether an instance in ``state`` holding ``held`` meets the condition (no instance meets none)."""
        return (
            state is not None
            and (not self.states or state in self.states)
            and all(r in held for r in self.holds)
            and not any(r in held for r in self.lacks)
        )

    def describe(self, state: str | None = None) -> str:
        """The condition in words; given the ``state`` an instance meets it in, names that state alone."""
        parts = []
        if self.states:
            parts.append(f"is in {state or ' or '.join(self.states)}")
        if self.holds:
            parts.append(f"holds {', '.join(self.holds)}")
        if self.lacks:
            parts.append(f"lacks {', '.join(self.lacks)}")
        return f"{self.role} {' and '.join(parts) or 'exists'}"


@dataclass(frozen=True, slots=True)
class Property:
    """Something no run may do: a built-in (``kind`` is its name), a ``never`` over one request's roles,
    or an ``eventually`` (``kind`` ``final`` or ``released``) that an infinite run breaks.

    A ``never`` property is broken when its request meets every condition in
    ``when`` at once. :func:`kvfsm.spec.system.properties.violation` is the
    one evaluator of every kind.
    """

    name: str
    kind: PropertyKind
    when: tuple[Condition, ...] = ()
    doc: str = ""
    loc: Loc = NOWHERE

    @property
    def builtin(self) -> bool:
        return self.kind in BUILTINS

    @property
    def liveness(self) -> bool:
        """An ``eventually`` property: broken by a fair infinite run (a lasso), not by one state or step."""
        return self.kind in LIVENESS

    @property
    def on_step(self) -> bool:
        """Broken by a step (a rejected delivery, a send that does not fit), not by a state."""
        return self.kind in ON_STEP

    def describe(self) -> str:
        if self.kind == "never":
            return " while ".join(c.describe() for c in self.when)
        return LIVENESS.get(self.kind) or BUILTINS[self.kind]


BUILTIN_PROPERTIES: tuple[Property, ...] = tuple(
    Property(name, name)  # type: ignore[arg-type]  # BUILTINS' keys are the built-in kinds
    for name in BUILTINS
)


@dataclass(frozen=True)
class System:
    """A composition: roles, the messages between them, the channel, the bounds and the properties."""

    name: str
    roles: Mapping[str, Role]
    messages: Mapping[str, Message]
    channel: Channel
    requests: int
    properties: tuple[Property, ...] = BUILTIN_PROPERTIES
    """Every property checked, built-ins first, in a stable order."""
    doc: str = ""
    path: str = "<memory>"
    locs: Mapping[str, Loc] = field(default_factory=dict)
    relations: tuple[TimeRelation, ...] = ()
    """Declared orders between the roles' timeouts; none: any timeout may fire at any time."""
    instances: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Once ranks are expanded (:meth:`expanded`): declared role → its instances (``prefill#0``, ...)."""

    def base_of(self, role: str) -> str:
        """The declared role an instance belongs to (itself when ranks are not expanded or it has one)."""
        return self._base.get(role, role)

    @cached_property
    def _base(self) -> Mapping[str, str]:
        return {inst: base for base, insts in self.instances.items() for inst in insts}

    def instances_of(self, role: str) -> tuple[str, ...]:
        """The instances of a declared role (the role itself when it has one)."""
        return self.instances.get(role, (role,))

    def outgoing(self, role: str, message: str) -> tuple[str, ...]:
        """The messages a send of declared ``message`` by instance ``role`` puts on the wire: one per receiver."""
        return self._outgoing.get((role, message), ())

    @cached_property
    def _outgoing(self) -> Mapping[tuple[str, str], tuple[str, ...]]:
        out: dict[tuple[str, str], list[str]] = {}
        for m in self.messages.values():
            out.setdefault((m.sender, m.event), []).append(m.name)
        return {k: tuple(v) for k, v in out.items()}

    def expanded(self) -> System:
        """The system with one role per instance and one message per (sender instance, receiver instance).

        A role with ``ranks: n`` becomes ``role#0`` .. ``role#n-1``; a declared
        message ``m`` becomes ``m@sender#k>receiver#j`` (each part only where
        that side has ranks), so a send reaches every instance of the receiving
        role: a broadcast. Properties keep naming declared roles (a condition
        on a role with ranks holds when one of its instances meets it). A
        system without ranks is returned as it is.
        """
        if all(r.ranks == 1 for r in self.roles.values()):
            return self
        insts = {
            name: tuple(f"{name}#{k}" for k in range(r.ranks)) if r.ranks > 1 else (name,)
            for name, r in self.roles.items()
        }
        roles = {inst: replace(r, name=inst) for name, r in self.roles.items() for inst in insts[name]}

        def copy(base: str, sender: str, receiver: str) -> str:
            msg = self.messages[base]
            return (
                base
                + (f"@{sender}" if self.roles[msg.sender].ranks > 1 else "")
                + (f">{receiver}" if self.roles[msg.receiver].ranks > 1 else "")
            )

        messages: dict[str, Message] = {}
        for m in self.messages.values():
            for k, si in enumerate(insts[m.sender]):
                for ri in insts[m.receiver]:
                    answer = m.reply_if_finished
                    reply = copy(answer, ri, si) if answer is not None and answer in self.messages else None
                    name = copy(m.name, si, ri)
                    count = self.roles[m.sender].ranks if m.count < 0 else m.count
                    messages[name] = replace(
                        m, name=name, sender=si, receiver=ri, reply_if_finished=reply, base=m.name, rank=k, count=count
                    )
        return replace(self, roles=roles, messages=messages, instances=insts)

    @cached_property
    def timing(self) -> Timing:
        return Timing(self.relations)

    @cached_property
    def names(self) -> tuple[str, ...]:
        """The properties' names, in order."""
        return tuple(p.name for p in self.properties)

    def property_named(self, name: str) -> Property:
        """The property called ``name``; raises ``KeyError`` if the system checks none by that name."""
        return self._by_name[name]

    @cached_property
    def _by_name(self) -> Mapping[str, Property]:
        return {p.name: p for p in self.properties}

    @property
    def never(self) -> tuple[Property, ...]:
        """The ``never`` properties, in order."""
        return tuple(p for p in self.properties if p.kind == "never")

    @property
    def eventually(self) -> tuple[Property, ...]:
        """The ``eventually`` (liveness) properties, in order."""
        return tuple(p for p in self.properties if p.liveness)

    @property
    def builtins(self) -> tuple[str, ...]:
        """The names of the built-in properties checked."""
        return tuple(p.name for p in self.properties if p.builtin)

    @cached_property
    def wire(self) -> Wire:
        """The channel's rules over this system's messages (message ids in declaration order)."""
        return Wire(self.channel, tuple(self.messages.values()))

    def inbox(self, role: str) -> Mapping[str, Message]:
        """The messages ``role`` receives, by name."""
        return self._inboxes.get(role, {})

    @cached_property
    def _inboxes(self) -> Mapping[str, Mapping[str, Message]]:
        out: dict[str, dict[str, Message]] = {}
        for m in self.messages.values():
            out.setdefault(m.receiver, {})[m.name] = m
        return out

    def finished(self, role: str, state: str) -> bool:
        """Whether ``role``'s instance in ``state`` has ended: a final state, or lost in a crash."""
        return state == CRASHED or self.roles[role].spec.states[state].is_final

    def environment(self, role: str) -> frozenset[str]:
        """Events of ``role`` that can always happen but are no progress: abort, the on_error event, and the
        events the system file declares the environment's (``environment:`` on the role)."""
        r = self.roles[role]
        return frozenset({ABORT, *r.environment} | ({r.spec.on_error} if r.spec.on_error else set()))

    def undelivered(self, role: str) -> tuple[str, ...]:
        """Events ``role``'s spec declares ``remote: true`` and has a transition for that no message of the system
        delivers and that are not the environment's: who sends them is unsaid (KVF217)."""
        spec = self.roles[role].spec
        inbox = {m.event for m in self.inbox(role).values()}
        env = self.environment(role)
        fired = {e.event for e in spec.edges()}
        return tuple(
            d.name for d in spec.event_decls.values() if d.remote and d.name in fired and d.name not in inbox | env
        )

    def leaves(self, role: str, state: str) -> bool:
        """Whether ``role``'s own work can take its instance in ``state`` to another state: a transition to a
        different state on a local event or a deadline of the state (no message, nothing of the environment's).
        A fair run does not keep such an instance in ``state`` forever (the explorer's progress fairness)."""
        return state in self._leaving[role]

    @cached_property
    def _leaving(self) -> Mapping[str, frozenset[str]]:
        out: dict[str, frozenset[str]] = {}
        for name, role in self.roles.items():
            spec = role.spec
            inbox = {m.event for m in self.inbox(name).values()}
            env = self.environment(name)
            out[name] = frozenset(
                e.source
                for e in spec.edges()
                if e.target != e.source
                and e.source in spec.states
                and e.target in spec.states
                and not spec.states[e.source].is_final
                and e.event not in inbox
                and (e.event not in env or spec.fires_on_timeout(e.source, e.event))
            )
        return out

    def moves_on(self, role: str, state: str) -> bool:
        """Whether local work can move ``role`` on from ``state``: an event that is no message, abort or on_error."""
        return state in self._progress[role]

    @cached_property
    def _progress(self) -> Mapping[str, frozenset[str]]:
        out: dict[str, frozenset[str]] = {}
        for name, role in self.roles.items():
            passive = self.environment(name) | {m.event for m in self.inbox(name).values()}
            out[name] = frozenset(
                e.source
                for e in role.spec.edges()
                if e.event not in passive and e.source in role.spec.states and e.target in role.spec.states
            )
        return out
