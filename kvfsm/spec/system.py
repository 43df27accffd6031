"""Compositions: several machine specs (roles) exchanging declared messages over a channel.

A system file names its roles (each a machine spec, path relative to the
system file), the messages their transitions ``send``, what the channel may do
to messages (lose, duplicate, reorder; how many it holds), how many requests
to explore, and the properties to check. A message's name is an event of the
role that receives it; that event happens only when the message is delivered.

This module reads a system file into an immutable :class:`System` (schema
errors are KVF001, as for machines) and runs the composition checks
KVF200–KVF212 over it. It knows nothing of the explorer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .checks import run_checks
from .findings import READ_ERROR, Finding, Severity, SpecError
from .loader import _INT, _LOADER, _NULL, _kind, _Schema
from .loader import read as read_machine
from .model import ABORT, NOWHERE, Loc, Spec

BUILTINS: Mapping[str, str] = {
    "deadlock": "a live instance that nothing can move on: no local event, no timeout, nothing in flight for its request",
    "leak": "the same, while the stuck instance holds resources: they would stay held forever",
    "late_message": "a message reaches a finished instance whose final state does not ignore it",
    "unexpected_message": "a message reaches a live state that neither handles nor ignores it (IllegalTransition)",
    "overflow": "a send finds the channel full although the channel may not lose messages",
}
"""The properties every exploration checks unless ``properties: builtins:`` narrows them."""

TOP_KEYS = {
    "kvfsm": "schema version (required, 1)",
    "system": "system name (required)",
    "doc": "description",
    "roles": "the machines that take part (required)",
    "messages": "what the roles send each other (required)",
    "channel": "what the channel may do to messages",
    "requests": "how many requests to explore",
    "properties": "what must never happen",
}
ROLE_KEYS = ("spec", "doc")
MESSAGE_KEYS = ("from", "to", "reply_if_finished", "doc")
CHANNEL_KEYS = ("loss", "duplicate", "reorder", "capacity")
PROPERTY_KEYS = ("never", "builtins")
NEVER_KEYS = ("name", "when", "doc")
CONDITION_KEYS = ("in", "holds", "lacks")


@dataclass(frozen=True, slots=True)
class Role:
    """One machine of the composition; every request has one instance of every role."""

    name: str
    spec: Spec
    path: str
    doc: str = ""
    loc: Loc = NOWHERE


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


@dataclass(frozen=True, slots=True)
class Channel:
    """What may happen to a message between send and delivery.

    ``capacity`` bounds the messages in flight at once, all requests and both
    directions together. A send that does not fit is lost when ``loss`` is
    allowed and an ``overflow`` violation otherwise. ``duplicate`` lets a
    delivered message stay in flight (it may arrive again); without
    ``reorder`` each request's messages arrive in send order per direction.
    """

    loss: bool = True
    duplicate: bool = True
    reorder: bool = True
    capacity: int = 2
    loc: Loc = NOWHERE


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

    def describe(self) -> str:
        parts = []
        if self.states:
            parts.append(f"is in {' or '.join(self.states)}")
        if self.holds:
            parts.append(f"holds {', '.join(self.holds)}")
        if self.lacks:
            parts.append(f"lacks {', '.join(self.lacks)}")
        return f"{self.role} {' and '.join(parts) or 'exists'}"


@dataclass(frozen=True, slots=True)
class Never:
    """A safety property: no request may ever satisfy every condition at once."""

    name: str
    when: tuple[Condition, ...]
    doc: str = ""
    loc: Loc = NOWHERE

    def describe(self) -> str:
        return " while ".join(c.describe() for c in self.when)


@dataclass(frozen=True)
class System:
    """A composition: roles, the messages between them, the channel, the bounds and the properties."""

    name: str
    roles: Mapping[str, Role]
    messages: Mapping[str, Message]
    channel: Channel
    requests: int
    never: tuple[Never, ...] = ()
    builtins: tuple[str, ...] = tuple(BUILTINS)
    doc: str = ""
    path: str = "<memory>"
    locs: Mapping[str, Loc] = field(default_factory=dict)

    @property
    def properties(self) -> tuple[str, ...]:
        """Every property checked, built-ins first, in a stable order."""
        return (*self.builtins, *(n.name for n in self.never))

    def inbox(self, role: str) -> dict[str, Message]:
        """The messages ``role`` receives, by name."""
        return {m.name: m for m in self.messages.values() if m.receiver == role}


# -- loading -------------------------------------------------------------------


def is_system_text(text: str) -> bool:
    """Whether YAML text is a system file (its top-level mapping has ``system``), not a machine spec."""
    try:
        root = yaml.compose(text, Loader=_LOADER)
    except (yaml.YAMLError, RecursionError):
        return False
    return isinstance(root, MappingNode) and any(
        isinstance(k, ScalarNode) and k.value == "system" for k, _v in root.value
    )


def is_system_file(path: str | Path) -> bool:
    """Whether ``path`` holds a system file; ``False`` for a machine spec or an unreadable file."""
    try:
        return is_system_text(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return False


@dataclass
class _Draft:
    """What the loader could read, errors and all, for the checks to work on."""

    system: System
    findings: list[Finding]


def _condition(s: _Schema, role: str, knode: Node, node: Node) -> Condition | None:
    what = f"condition on {role!r}"
    loc = s.loc(knode)
    if isinstance(node, (ScalarNode, SequenceNode)):
        states = s.names(node, f"{what}: state")
        return Condition(role, states, loc=loc) if states else None
    items = s.mapping(node, what, CONDITION_KEYS)
    if items is None:
        return None
    if not items:
        s.error(node, f"{what} is empty", "Write a state, a list of states, or '{in: ..., holds: ..., lacks: ...}'.")
        return None
    states = s.names(items["in"][1], f"{what}: in") if "in" in items else ()
    holds = s.names(items["holds"][1], f"{what}: holds") if "holds" in items else ()
    lacks = s.names(items["lacks"][1], f"{what}: lacks") if "lacks" in items else ()
    return Condition(role, states, holds, lacks, loc)


def _never(s: _Schema, node: Node) -> Never | None:
    items = s.mapping(node, "never property", NEVER_KEYS)
    if items is None:
        return None
    fix = "Write '- {name: <name>, when: {<role>: <state or {in, holds, lacks}>, ...}}'."
    name = s.required_name(items, "name", node, "never property", fix, "property name")
    when_node = s.require(items, "when", node, "never property", fix)
    conditions: list[Condition] = []
    if when_node is not None:
        for role, knode, cnode in s.named_mapping(when_node, "when", "role"):
            cond = _condition(s, role, knode, cnode)
            if cond is not None:
                conditions.append(cond)
        if isinstance(when_node, MappingNode) and not when_node.value:
            s.error(when_node, "when is empty", "Name at least one role and the state it must not be in.")
    doc = s.text(items["doc"][1], "property doc") if "doc" in items else ""
    if name is None or not conditions:
        return None
    return Never(name, tuple(conditions), doc, s.loc(node))


def _count(s: _Schema, node: Node, what: str, fix: str) -> int | None:
    value = s.scalar(node, what)
    if value is None:
        return None
    if node.tag != _INT:
        s.error(node, f"{what} must be a whole number, not {_kind(node)}", fix)
        return None
    number = int(value, 0)
    if number < 1:
        s.error(node, f"{what} must be at least 1, not {number}", fix)
        return None
    return number


def _read_role(s: _Schema, base: Path, name: str, knode: Node, node: Node, out: list[Finding]) -> Role | None:
    what = f"role {name!r}"
    if isinstance(node, ScalarNode) and node.tag != _NULL:
        spec_node: Node | None = node  # `prefill: prefill.yaml`
        doc = ""
    else:
        items = s.mapping(node, what, ROLE_KEYS)
        if items is None:
            return None
        spec_node = s.require(items, "spec", knode, what, "Write '{spec: <machine spec file>}', relative to this file.")
        doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
    if spec_node is None:
        return None
    rel = s.scalar(spec_node, f"{what}: spec")
    if rel is None:
        return None
    path = base / rel
    shown = str(path)
    try:
        spec = read_machine(path)
    except SpecError as exc:
        if any(f.code == READ_ERROR for f in exc.findings):
            loc = s.loc(spec_node)
            out.append(
                Finding(
                    "KVF200",
                    "error",
                    s.path,
                    loc.line,
                    f"{what}: cannot read its spec {shown}: {exc.findings[0].message}",
                    "The path is relative to the system file; check the name.",
                    loc.col,
                )
            )
        else:
            out.extend(exc.findings)
        return None
    out.extend(run_checks(spec))
    return Role(name, spec, shown, doc, s.loc(knode))


def _parse(text: str, path: str) -> _Draft:
    """Read a system file as far as possible: schema errors and the roles' own findings included."""
    s = _Schema(path)
    role_findings: list[Finding] = []
    root, top = s.top(
        text,
        "the system",
        "system",
        TOP_KEYS,
        "'kvfsm: 1', 'system: <name>', 'roles:' and 'messages:'",
        "A system file names its roles: 'system: <name>', 'roles: {<role>: {spec: <machine file>}}', "
        "'messages:'. Check a machine spec with 'kvfsm check'.",
    )
    name = s.header(top, root, "the system", "system")
    doc = s.text(top["doc"][1], "doc") if "doc" in top else ""

    base = Path(path).parent
    roles: dict[str, Role] = {}
    declared_roles: set[str] = set()
    roles_node = s.require(
        top, "roles", root, "the system", "Add 'roles:' naming each machine: '<role>: {spec: <file>}'."
    )
    if roles_node is not None:
        for rname, rknode, rnode in s.named_mapping(roles_node, "roles", "role"):
            declared_roles.add(rname)
            role = _read_role(s, base, rname, rknode, rnode, role_findings)
            if role is not None:
                roles[rname] = role

    messages: dict[str, Message] = {}
    msgs_node = s.require(
        top, "messages", root, "the system", "Add 'messages:' with '<name>: {from: <role>, to: <role>}' per message."
    )
    if msgs_node is not None:
        for mname, mknode, mnode in s.named_mapping(msgs_node, "messages", "message"):
            what = f"message {mname!r}"
            items = s.mapping(mnode, what, MESSAGE_KEYS)
            if items is None:
                continue
            fix = "Write '{from: <sending role>, to: <receiving role>}'."
            fnode = s.require(items, "from", mknode, what, fix)
            tnode = s.require(items, "to", mknode, what, fix)
            sender = s.name(fnode, f"{what}: from") if fnode is not None else None
            receiver = s.name(tnode, f"{what}: to") if tnode is not None else None
            reply = (
                s.name(items["reply_if_finished"][1], f"{what}: reply_if_finished")
                if "reply_if_finished" in items
                else None
            )
            mdoc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
            if sender is not None and receiver is not None:
                messages[mname] = Message(mname, sender, receiver, reply, mdoc, s.loc(mknode))

    channel = Channel()
    if "channel" in top:
        items = s.mapping(top["channel"][1], "channel", CHANNEL_KEYS)
        if items is not None:
            flags = {k: s.boolean(items[k][1], f"channel: {k}") for k in ("loss", "duplicate", "reorder") if k in items}
            capacity = channel.capacity
            if "capacity" in items:
                got = _count(
                    s,
                    items["capacity"][1],
                    "channel: capacity",
                    "Write how many messages may be in flight at once, e.g. 2.",
                )
                capacity = got if got is not None else capacity
            channel = Channel(
                loss=flags.get("loss", channel.loss),
                duplicate=flags.get("duplicate", channel.duplicate),
                reorder=flags.get("reorder", channel.reorder),
                capacity=capacity,
                loc=s.loc(top["channel"][0]),
            )

    requests = 2
    if "requests" in top:
        got = _count(s, top["requests"][1], "requests", "Write how many requests to explore, e.g. 3.")
        requests = got if got is not None else requests

    never: list[Never] = []
    builtins: tuple[str, ...] = tuple(BUILTINS)
    if "properties" in top:
        items = s.mapping(top["properties"][1], "properties", PROPERTY_KEYS)
        if items is not None:
            if "never" in items:
                never = list(s.sequence(items["never"][1], "never", lambda n: _never(s, n)))
            if "builtins" in items:
                bnode = items["builtins"][1]
                listed = s.names(bnode, "builtin property", empty=True)
                unknown = [b for b in listed if b not in BUILTINS]
                for b in unknown:
                    s.error(bnode, f"unknown builtin property {b!r}", f"Built-in properties: {', '.join(BUILTINS)}.")
                builtins = tuple(b for b in BUILTINS if b in listed)
    seen_names: dict[str, Never] = {}
    for prop in never:
        if prop.name in seen_names or prop.name in BUILTINS:
            s.error(
                prop.loc,
                f"property name {prop.name!r} is used twice"
                + (" (it is a built-in property)" if prop.name in BUILTINS else ""),
                "Give each property its own name.",
            )
        seen_names.setdefault(prop.name, prop)

    if name is None:
        raise SpecError(sorted(s.errors, key=lambda f: (f.line, f.col)))
    locs = {k: s.loc(knode) for k, (knode, _v) in top.items()}
    system = System(
        name=name,
        roles=roles,
        messages=messages,
        channel=channel,
        requests=requests,
        never=tuple(never),
        builtins=builtins,
        doc=doc,
        path=path,
        locs=locs,
    )
    missing = declared_roles - set(roles)
    findings = sorted(s.errors, key=lambda f: (f.line, f.col)) + role_findings
    if not s.errors:
        findings += _composition_checks(system, missing)
    return _Draft(system, findings)


def _read_text(path: str | Path) -> str:
    shown = str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        problem, fix = "no such system file", "Check the path; bundled systems live in specs/pd_abort/."
    except IsADirectoryError:
        problem, fix = "is a directory, not a system file", "Name a .yaml file."
    except (OSError, UnicodeDecodeError) as exc:
        problem, fix = f"cannot read the system file: {exc}", "Make the file readable UTF-8 text."
    raise SpecError([Finding(READ_ERROR, "error", shown, 0, problem, fix)])


def check_system(path: str | Path) -> list[Finding]:
    """Every finding for a system file: schema, the roles' own checks, and the composition checks."""
    try:
        return _parse(_read_text(path), str(path)).findings
    except SpecError as exc:
        return list(exc.findings)


def load_system(path: str | Path) -> System:
    """Read and check a system file; raises :class:`SpecError` if the system or a role has errors."""
    draft = _parse(_read_text(path), str(path))
    errors = [f for f in draft.findings if f.severity == "error"]
    if errors:
        raise SpecError(errors)
    return draft.system


def parse_system(text: str, path: str = "<string>") -> System:
    """Parse system text (role paths relative to ``path``'s folder) and check it; raises on errors."""
    draft = _parse(text, path)
    errors = [f for f in draft.findings if f.severity == "error"]
    if errors:
        raise SpecError(errors)
    return draft.system


# -- composition checks ----------------------------------------------------------


def _finding(code: str, loc: Loc, message: str, fix: str, severity: Severity = "error") -> Finding:
    return Finding(code, severity, loc.path, loc.line, message, fix, loc.col)


def _environment(spec: Spec) -> set[str]:
    """Events that can always happen but do not count as progress: abort and the on_error event."""
    return {ABORT} | ({spec.on_error} if spec.on_error else set())


def _handled(spec: Spec) -> dict[str, set[str]]:
    """state → events with a transition from it."""
    out: dict[str, set[str]] = defaultdict(set)
    for e in spec.edges():
        out[e.source].add(e.event)
    return out


def _check_sends(system: System, missing: set[str]) -> Iterator[Finding]:
    """KVF201, KVF202: every send names a declared message, to the role that receives it, from its sender."""
    roles = ", ".join(system.roles)
    for role in system.roles.values():
        for t in role.spec.transitions:
            for send in t.sends:
                msg = system.messages.get(send.message)
                if msg is None:
                    yield _finding(
                        "KVF201",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r}, which {system.path} does not declare",
                        f"Declare it under 'messages:' as '{send.message}: {{from: {role.name}, to: {send.to}}}', or fix the name.",
                    )
                    continue
                if send.to in missing:
                    pass  # its spec could not be read: KVF200 or the role's own findings say so
                elif send.to not in system.roles:
                    yield _finding(
                        "KVF202",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r} to {send.to!r}, which is not a role",
                        f"Send it to one of: {roles}.",
                    )
                elif send.to != msg.receiver:
                    yield _finding(
                        "KVF202",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r} to {send.to!r}, but the message is declared to go to {msg.receiver!r}",
                        f"Write 'to: {msg.receiver}', or declare a separate message for {send.to!r}.",
                    )
                if msg.sender != role.name:
                    yield _finding(
                        "KVF202",
                        send.loc,
                        f"{role.name}: transition {t.event!r} sends {send.message!r}, which is declared to come from {msg.sender!r}",
                        f"Declare it 'from: {role.name}', or send it from {msg.sender!r}.",
                    )


def _check_messages(system: System, missing: set[str]) -> Iterator[Finding]:
    """KVF203, KVF204, KVF205, KVF210, KVF211, KVF212: declarations that cannot work as written."""
    sent = {s.message for r in system.roles.values() for t in r.spec.transitions for s in t.sends}
    roles = ", ".join(system.roles)
    for msg in system.messages.values():
        bad_ends = [r for r in (msg.sender, msg.receiver) if r not in system.roles and r not in missing]
        for r in bad_ends:
            yield _finding(
                "KVF211", msg.loc, f"message {msg.name!r} names {r!r}, which is not a role", f"Use one of: {roles}."
            )
        if msg.sender == msg.receiver:
            yield _finding(
                "KVF211",
                msg.loc,
                f"message {msg.name!r} goes from {msg.sender!r} to itself",
                "Messages cross between roles; a role's own next step is a local event.",
            )
        if msg.reply_if_finished is not None:
            reply = system.messages.get(msg.reply_if_finished)
            if reply is None or reply.sender != msg.receiver or reply.receiver != msg.sender:
                yield _finding(
                    "KVF210",
                    msg.loc,
                    f"message {msg.name!r} is answered with {msg.reply_if_finished!r}, which is not declared from {msg.receiver!r} to {msg.sender!r}",
                    f"Declare '{msg.reply_if_finished}: {{from: {msg.receiver}, to: {msg.sender}}}'.",
                )
        if msg.name not in sent and msg.sender not in missing:
            yield _finding(
                "KVF204",
                msg.loc,
                f"message {msg.name!r} is declared but no transition sends it",
                f"Add 'send: {{to: {msg.receiver}, message: {msg.name}}}' to a transition of {msg.sender!r}, or delete it.",
                "warning",
            )
        receiver = system.roles.get(msg.receiver)
        if receiver is None:
            continue
        spec = receiver.spec
        if msg.name in _environment(spec):
            yield _finding(
                "KVF212",
                msg.loc,
                f"message {msg.name!r} is {msg.receiver}'s {'abort' if msg.name == ABORT else 'on_error'} event, which must stay local",
                f"A message event happens only on delivery, so {msg.receiver} could no longer {msg.name} on its own; give the message its own name.",
            )
        handled = _handled(spec)
        ignored = {(st, ev) for st, ev, _r in spec.ignored()}
        takes = [st for st in spec.states if msg.name in handled.get(st, ())]
        if not takes:
            only_ignored = any(ev == msg.name for _st, ev in ignored)
            yield _finding(
                "KVF203",
                msg.loc,
                f"message {msg.name!r} goes to {msg.receiver!r}, which "
                + ("only ever ignores it: sending it has no effect" if only_ignored else "has no transition for it"),
                f"Add a transition on {msg.name!r} to {receiver.path}"
                + (
                    ""
                    if only_ignored
                    else " (message names are events of the receiving role), or send it to a role that handles it."
                ),
                "warning" if only_ignored else "error",
            )
            if not only_ignored:
                continue
        bare = [st for st in spec.states if msg.name not in handled.get(st, ()) and (st, msg.name) not in ignored]
        if bare:
            yield _finding(
                "KVF205",
                msg.loc,
                f"message {msg.name!r} to {msg.receiver!r} is neither handled nor ignored in {', '.join(bare)}: "
                "arriving there (late, duplicated or reordered) it raises IllegalTransition",
                f"Add '{{event: {msg.name}, in: [{', '.join(bare)}]}}' to the ignore rules of {receiver.path} if it is harmless there.",
                "warning",
            )


def _check_waits(system: System) -> Iterator[Finding]:
    """KVF206, KVF208: message events are remote, so a state left only by messages needs a deadline."""
    for role in system.roles.values():
        spec = role.spec
        inbox = system.inbox(role.name)
        handled = _handled(spec)
        env = _environment(spec)
        for st in spec.states.values():
            if st.timeout is not None and st.timeout.fire in inbox:
                yield _finding(
                    "KVF208",
                    st.timeout.loc,
                    f"{role.name}: state {st.name!r} times out by firing {st.timeout.fire!r}, which is a message from {inbox[st.timeout.fire].sender!r}",
                    "A message event happens only when the message arrives; fire a local event such as 'expire'.",
                )
            if st.is_final or not st.waits_local:
                continue
            ways = handled.get(st.name, set()) - env
            if ways and ways <= set(inbox):
                senders = sorted({inbox[e].sender for e in ways})
                yield _finding(
                    "KVF206",
                    st.loc,
                    f"{role.name}: state {st.name!r} is 'waits: local', but only messages from {', '.join(senders)} move it on "
                    f"({', '.join(sorted(ways))}): a lost message would pin it there forever{' holding ' + ', '.join(st.holds) if st.holds else ''}",
                    "Replace 'waits: local' with 'timeout: {after: <param>, fire: <local event>}'.",
                )


def _reachable(system: System) -> dict[str, set[str]]:
    """Role states reachable in the composition when messages flow only if some reachable transition sends them."""
    reached = {name: {r.spec.initial.name} for name, r in system.roles.items() if _has_initial(r.spec)}
    sendable: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, role in system.roles.items():
            if name not in reached:
                continue
            inbox = system.inbox(name)
            for e in role.spec.edges():
                if e.source not in reached[name] or e.target not in role.spec.states:
                    continue
                if e.event in inbox and e.event not in sendable:
                    continue
                if e.target not in reached[name]:
                    reached[name].add(e.target)
                    changed = True
                for send in e.transition.sends:
                    if send.message not in sendable:
                        sendable.add(send.message)
                        changed = True
                        reply = system.messages.get(send.message)
                        if reply is not None and reply.reply_if_finished is not None:
                            sendable.add(reply.reply_if_finished)
    return reached


def _has_initial(spec: Spec) -> bool:
    return any(s.initial for s in spec.states.values())


def _check_armed(system: System) -> Iterator[Finding]:
    """KVF207: states (and so their timeouts) no run of the composition can reach."""
    reached = _reachable(system)
    for name, role in system.roles.items():
        if name not in reached:
            continue
        for st in role.spec.states.values():
            if st.name in reached[name]:
                continue
            what = "its timeout is never armed" if st.timeout is not None else "it is dead weight"
            yield _finding(
                "KVF207",
                st.timeout.loc if st.timeout is not None else st.loc,
                f"{name}: state {st.name!r} cannot be reached in {system.name!r} (it is entered only on messages no reachable transition sends), so {what}",
                "Send the message that leads there, or drop the state from this role.",
                "warning",
            )


def _check_properties(system: System, missing: set[str]) -> Iterator[Finding]:
    """KVF209: properties name roles, states and resources that exist."""
    for prop in system.never:
        for cond in prop.when:
            role = system.roles.get(cond.role)
            if role is None:
                if cond.role not in missing:
                    yield _finding(
                        "KVF209",
                        cond.loc,
                        f"property {prop.name!r} names {cond.role!r}, which is not a role",
                        f"Use one of: {', '.join(system.roles)}.",
                    )
                continue
            spec = role.spec
            for st in cond.states:
                if st not in spec.states:
                    yield _finding(
                        "KVF209",
                        cond.loc,
                        f"property {prop.name!r}: {cond.role} has no state {st!r}",
                        f"Use one of: {', '.join(spec.states)}.",
                    )
            for res in (*cond.holds, *cond.lacks):
                if res not in spec.resources:
                    yield _finding(
                        "KVF209",
                        cond.loc,
                        f"property {prop.name!r}: {cond.role} has no resource {res!r}",
                        f"Use one of: {', '.join(spec.resources) or '(it declares none)'}.",
                    )


def _composition_checks(system: System, missing: set[str]) -> list[Finding]:
    """Every composition finding, grouped by file, in line order within each."""
    found: list[Finding] = [
        *_check_sends(system, missing),
        *_check_messages(system, missing),
        *_check_waits(system),
        *_check_properties(system, missing),
    ]
    if not missing and not any(f.severity == "error" for f in found):
        found += _check_armed(system)  # after an error, what it cuts off would only echo it
    return sorted(found, key=lambda f: (f.path != system.path, f.path, f.line, f.col, f.code))
