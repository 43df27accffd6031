"""Read a system file into the composition model, keeping every line number.

The sections (roles, messages, channel, requests, properties) are read with
the shared :class:`~kvfsm.spec.schema.Schema`, so each schema error is a
KVF001 with file, line and column and a fix. Each role's machine spec is read
and checked as ``kvfsm check`` would (an unreadable one is KVF200); the
composition checks (KVF2xx) are :mod:`kvfsm.spec.system.checks`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..checks import run_checks
from ..findings import READ_ERROR, Finding, SpecError
from ..loader import InputError, read_input
from ..loader import read as read_machine
from ..schema import NULL, YAML_LOADER, Schema
from .channel import Channel
from .model import BUILTIN_PROPERTIES, BUILTINS, LIVENESS, Condition, Message, Property, Role, System, TimeRelation

TOP_KEYS = {
    "kvfsm": "schema version (required, 1)",
    "system": "system name (required)",
    "doc": "description",
    "roles": "the machines that take part (required)",
    "messages": "what the roles send each other (required)",
    "channel": "what the channel may do to messages",
    "requests": "how many requests to explore",
    "properties": "what must never happen, and what must eventually happen",
    "relations": "which timeouts outlast which: 'prefill.abort_timeout > decode.read_timeout'",
}
ROLE_KEYS = ("spec", "doc", "crash", "ranks", "environment")
CRASH_KEYS = ("restart",)
MESSAGE_KEYS = ("from", "to", "reply_if_finished", "count", "doc")
CHANNEL_KEYS = ("loss", "duplicate", "reorder", "capacity")
PROPERTY_KEYS = ("never", "builtins", "eventually")
NEVER_KEYS = ("name", "when", "doc")
CONDITION_KEYS = ("in", "holds", "lacks")
DEFAULT_REQUESTS = 2


def is_system_text(text: str) -> bool:
    """Whether YAML text is a system file (its top-level mapping has ``system``), not a machine spec."""
    try:
        root = yaml.compose(text, Loader=YAML_LOADER)
    except (yaml.YAMLError, RecursionError):
        return False
    return isinstance(root, MappingNode) and any(
        isinstance(k, ScalarNode) and k.value == "system" for k, _v in root.value
    )


def is_system_file(path: str | Path) -> bool:
    """Whether ``path`` holds a system file; ``False`` for a machine spec or an unreadable file (read with a bound)."""
    try:
        return is_system_text(read_input(path, what="system file"))
    except InputError:
        return False


@dataclass(frozen=True)
class Draft:
    """What the loader could read, errors and all, for the composition checks to work on."""

    system: System
    findings: list[Finding]
    """Schema errors (in line order), then each role's own findings."""
    schema_errors: bool
    missing: frozenset[str]
    """Roles declared but whose spec could not be read (their findings say why)."""


# -- the sections ----------------------------------------------------------------


def _condition(s: Schema, role: str, knode: Node, node: Node) -> Condition | None:
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


def _never(s: Schema, node: Node) -> Property | None:
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
    return Property(name, "never", tuple(conditions), doc, s.loc(node))


def _properties(s: Schema, node: Node) -> tuple[Property, ...]:
    """``properties: {never: [...], builtins: [...], eventually: [...]}``: built-ins, each ``never``, then each ``eventually``."""
    never: tuple[Property, ...] = ()
    eventually: tuple[Property, ...] = ()
    builtins = BUILTIN_PROPERTIES
    items = s.mapping(node, "properties", PROPERTY_KEYS)
    if items is not None:
        if "never" in items:
            never = s.sequence(items["never"][1], "never", lambda n: _never(s, n))
        if "builtins" in items:
            bnode = items["builtins"][1]
            listed = s.names(bnode, "builtin property", empty=True)
            for b in listed:
                if b not in BUILTINS:
                    s.error(bnode, f"unknown builtin property {b!r}", f"Built-in properties: {', '.join(BUILTINS)}.")
            builtins = tuple(p for p in BUILTIN_PROPERTIES if p.name in listed)
        if "eventually" in items:
            enode = items["eventually"][1]
            wanted = s.names(enode, "eventually property")
            for w in wanted:
                if w not in LIVENESS:
                    s.error(
                        enode, f"unknown eventually property {w!r}", f"Eventually properties: {', '.join(LIVENESS)}."
                    )
            eventually = tuple(
                Property(w, w, loc=s.loc(enode))  # type: ignore[arg-type]  # LIVENESS' keys are the liveness kinds
                for w in LIVENESS
                if w in wanted
            )
    seen: set[str] = set()
    for prop in never:
        if prop.name in seen or prop.name in BUILTINS or prop.name in LIVENESS:
            s.error(
                prop.loc,
                f"property name {prop.name!r} is used twice"
                + (" (it is a built-in property)" if prop.name in BUILTINS or prop.name in LIVENESS else ""),
                "Give each property its own name.",
            )
        seen.add(prop.name)
    return (*builtins, *never, *eventually)


def _crash(s: Schema, node: Node, what: str) -> tuple[bool, bool]:
    """``crash: true`` (it may crash, and restarts), ``crash: false``, or ``crash: {restart: false}``."""
    if isinstance(node, MappingNode):
        items = s.mapping(node, f"{what}: crash", CRASH_KEYS)
        restart = s.boolean(items["restart"][1], f"{what}: crash: restart") if items and "restart" in items else True
        return True, restart
    return s.boolean(node, f"{what}: crash"), True


def _read_role(s: Schema, base: Path, name: str, knode: Node, node: Node, out: list[Finding]) -> Role | None:
    what = f"role {name!r}"
    crash, restart, ranks = False, True, 1
    environment: tuple[str, ...] = ()
    if isinstance(node, ScalarNode) and node.tag != NULL:
        spec_node: Node | None = node  # `prefill: prefill.yaml`
        doc = ""
    else:
        items = s.mapping(node, what, ROLE_KEYS)
        if items is None:
            return None
        spec_node = s.require(items, "spec", knode, what, "Write '{spec: <machine spec file>}', relative to this file.")
        doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
        if "crash" in items:
            crash, restart = _crash(s, items["crash"][1], what)
        if "ranks" in items:
            ranks = s.count(items["ranks"][1], f"{what}: ranks", "Write how many instances (TP ranks), e.g. 2.") or 1
        if "environment" in items:  # events from outside the composition: KVF217, KVF218
            environment = s.names(items["environment"][1], f"{what}: environment event")
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
    return Role(name, spec, shown, doc, s.loc(knode), crash, restart, ranks, environment)


def _roles(s: Schema, node: Node, base: Path, out: list[Finding]) -> tuple[dict[str, Role], frozenset[str]]:
    """The roles whose specs could be read, and the names of those that could not."""
    roles: dict[str, Role] = {}
    declared: set[str] = set()
    for name, knode, rnode in s.named_mapping(node, "roles", "role"):
        declared.add(name)
        role = _read_role(s, base, name, knode, rnode, out)
        if role is not None:
            roles[name] = role
    return roles, frozenset(declared - set(roles))


def _messages(s: Schema, node: Node) -> dict[str, Message]:
    messages: dict[str, Message] = {}
    for mname, mknode, mnode in s.named_mapping(node, "messages", "message"):
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
        count = _count(s, items["count"][1], what) if "count" in items else 0
        if sender is not None and receiver is not None:
            messages[mname] = Message(mname, sender, receiver, reply, mdoc, s.loc(mknode), count)
    return messages


_TERM = r"\s*([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\s*"
_SIDE = re.compile(rf"{_TERM}(?:\+{_TERM})*")
_RELATION = re.compile(r"^(?P<left>[^<>]+)(?P<op>[<>])(?P<right>[^<>]+)$")


def _relation(s: Schema, node: Node) -> TimeRelation | None:
    """``role.param > role.param + role.param`` (or ``<``): which deadline outlasts which."""
    fix = "Write 'role.param > role.param', or a sum on the longer side's other end: 'a.x > b.y + c.z'."
    text = s.scalar(node, "relation")
    if text is None:
        return None
    match = _RELATION.match(text)
    sides = []
    for part in (match.group("left"), match.group("right")) if match else ():
        if _SIDE.fullmatch(part) is None:
            break
        sides.append(tuple(tuple(t.strip() for t in term.split(".")) for term in part.split("+")))
    if match is None or len(sides) != 2:
        s.error(node, f"relation {text!r} is not 'role.param > role.param + ...'", fix)
        return None
    left, right = sides if match.group("op") == ">" else sides[::-1]
    if len(left) != 1:
        s.error(node, f"relation {text!r} has a sum on its longer side", fix)
        return None
    return TimeRelation(left[0], right, text.strip(), s.loc(node))  # type: ignore[arg-type]  # pairs by the regex


def _counted_by_receiver(path: str, message: Message, roles: Mapping[str, Role], out: list[Finding]) -> Message:
    """``message`` with the count its receiver's machine spec declares for its event (``count:`` on the
    transition): K where the spec writes a number or a param, else every sender rank (-1). One count, in one
    place: a system that writes its own for such a message is told to drop it."""
    role = roles.get(message.receiver)
    if role is None:
        return message
    counted = [t for t in role.spec.counted().values() if t.event == message.event]
    if not counted:
        return message
    if message.count:
        out.append(
            Finding(
                "KVF216", "error", path, message.loc.line,
                f"message {message.name!r} declares 'count:', but {message.receiver!r}'s spec counts {message.event!r} "
                f"itself ({role.path} line {counted[0].loc.line}): one count, in one place",
                "Drop 'count:' from the message; the explorer takes it from the receiver's spec.", message.loc.col,
            )
        )  # fmt: skip
    source = role.spec.count_source(counted[0])
    if source is not None and source[0] in ("number", "param"):
        k = int(source[1]) if source[0] == "number" else int(role.spec.params[str(source[1])])
        return replace(message, count=k) if k > 1 else message  # K = 1: the first copy fires, as with no count
    return replace(message, count=-1)


def _count(s: Schema, node: Node, what: str) -> int:
    """``count: all`` (-1: every sender rank) or ``count: K``: the receiver fires on the K-th distinct sender."""
    if isinstance(node, ScalarNode) and node.value == "all":
        return -1
    return s.count(node, f"{what}: count", "Write 'all', or how many sender ranks must be heard, e.g. 2.") or 0


def _channel(s: Schema, knode: Node, node: Node) -> Channel:
    default = Channel()
    items = s.mapping(node, "channel", CHANNEL_KEYS)
    if items is None:
        return default
    flags = {k: s.boolean(items[k][1], f"channel: {k}") for k in ("loss", "duplicate", "reorder") if k in items}
    capacity = default.capacity
    if "capacity" in items:
        got = s.count(
            items["capacity"][1], "channel: capacity", "Write how many messages may be in flight at once, e.g. 2."
        )
        capacity = got if got is not None else capacity
    return Channel(
        loss=flags.get("loss", default.loss),
        duplicate=flags.get("duplicate", default.duplicate),
        reorder=flags.get("reorder", default.reorder),
        capacity=capacity,
        loc=s.loc(knode),
    )


# -- the file ----------------------------------------------------------------------


def read_system_text(text: str, path: str) -> Draft:
    """Read system text as far as possible (role paths relative to ``path``'s folder).

    Raises :class:`SpecError` only when there is no system to speak of (not
    YAML, not a mapping, no name); every other problem is a finding in the
    :class:`Draft`.
    """
    s = Schema(path)
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
    roles: dict[str, Role] = {}
    missing: frozenset[str] = frozenset()
    roles_node = s.require(
        top, "roles", root, "the system", "Add 'roles:' naming each machine: '<role>: {spec: <file>}'."
    )
    if roles_node is not None:
        roles, missing = _roles(s, roles_node, Path(path).parent, role_findings)
    msgs_node = s.require(
        top, "messages", root, "the system", "Add 'messages:' with '<name>: {from: <role>, to: <role>}' per message."
    )
    messages = _messages(s, msgs_node) if msgs_node is not None else {}
    messages = {name: _counted_by_receiver(s.path, m, roles, role_findings) for name, m in messages.items()}
    channel = _channel(s, *top["channel"]) if "channel" in top else Channel()
    requests = DEFAULT_REQUESTS
    if "requests" in top:
        got = s.count(top["requests"][1], "requests", "Write how many requests to explore, e.g. 3.")
        requests = got if got is not None else requests
    properties = _properties(s, top["properties"][1]) if "properties" in top else BUILTIN_PROPERTIES
    relations = s.sequence(top["relations"][1], "relations", lambda n: _relation(s, n)) if "relations" in top else ()

    errors = sorted(s.errors, key=lambda f: (f.line, f.col))
    if name is None:
        raise SpecError(errors)
    system = System(
        name=name,
        roles=roles,
        messages=messages,
        channel=channel,
        requests=requests,
        properties=properties,
        relations=relations,
        doc=doc,
        path=path,
        locs={k: s.loc(knode) for k, (knode, _v) in top.items()},
    )
    return Draft(system, errors + role_findings, bool(errors), missing)


def read_system_file(path: str | Path) -> Draft:
    """Read a system file as far as possible; raises :class:`SpecError` (a read error) if it cannot be read at all.

    The file, like each role spec it names, is read with the loader's bound
    (:func:`~kvfsm.spec.loader.read_input`): a device, a FIFO or a file over
    1 MiB is refused before it is read.
    """
    try:
        text = read_input(path, what="system file")
    except InputError as exc:
        fix = (
            "Check the path; bundled systems live in specs/pd_abort/." if exc.problem.startswith("no such") else exc.fix
        )
        raise SpecError([Finding(READ_ERROR, "error", exc.path, 0, exc.problem, fix)]) from None
    return read_system_text(text, str(path))
