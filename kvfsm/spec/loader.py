"""Read a schema-v1 YAML machine spec into the immutable model, keeping every line number.

The sections of a machine spec (resources, states, transitions, ignore rules)
are read with the shared :class:`~kvfsm.spec.schema.Schema`, so each error
(KVF001) names the file, line and column it came from and says how to mend
it. It collects every schema error it can before raising.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from ..errors import KvfsmError
from .findings import READ_ERROR, Finding, SpecError
from .model import (
    Early,
    EventDecl,
    IgnoreRule,
    Outgoing,
    Owned,
    Phase,
    Relation,
    Resource,
    Send,
    Space,
    Spec,
    State,
    Timeout,
    Transition,
)
from .schema import INT, NULL, STR, Schema, kind_of

TOP_KEYS = {
    "kvfsm": "schema version (required, 1)",
    "machine": "machine name (required)",
    "doc": "description",
    "key": "id space that names instances (required)",
    "params": "named numbers",
    "resources": "what an instance can hold",
    "states": "the states (required)",
    "transitions": "the transitions (required)",
    "ignore": "legal no-op events",
    "on_error": "event fired when an action raises",
    "begin": "what begin() carries: {payload: [names]}",
    "relations": "relations the params must keep, e.g. 'lease_ttl > transfer_timeout'",
    "spaces": "id spaces besides the key's: {name: {linked_at: <event or begin>}}",
    "events": "what events are: {name: {by: <id space>, remote: true}}",
    "outgoing": "messages sent to peers: {name: {to: <peer machine>, event: <its event>, carries: <id space>}}",
    "phases": "deadlines that span states: {name: {states: [<states>] or '*', timeout: {after, fire}}}",
    "owns": "instances of another machine: {name: {machine, by: <begin payload key>, ended: <event>}}",
}
OWNS_KEYS = ("machine", "by", "ended", "failed", "forward", "doc")
PHASE_KEYS = ("states", "timeout", "doc")
BEGIN_KEYS = ("payload", "doc")
SPACE_KEYS = ("linked_at", "doc")
EVENT_KEYS = ("by", "remote", "early", "doc")
EARLY_KEYS = ("keep", "within")
OUTGOING_KEYS = ("to", "event", "carries", "doc")
RESOURCE_KEYS = ("release", "acquire", "doc")
STATE_KEYS = ("initial", "final", "holds", "waits", "timeout", "warn_after", "doc")
TIMEOUT_KEYS = ("after", "fire")
TRANSITION_KEYS = ("event", "from", "to", "do", "doc", "send", "payload", "count", "release")
SEND_KEYS = ("to", "message")
IGNORE_KEYS = ("event", "in")


# -- the schema, section by section ------------------------------------------


def _resource(s: Schema, name: str, knode: Node, node: Node) -> Resource | None:
    """``knode`` is the resource's name: findings about the whole resource point there."""
    what = f"resource {name!r}"
    items = s.mapping(node, what, RESOURCE_KEYS)
    if items is None:
        return None
    release = s.required_name(
        items,
        "release",
        knode,
        what,
        "Every resource needs 'release: <driver method>' so that no path can keep it.",
        f"{what}: release",
    )
    acquire = s.name(items["acquire"][1], f"{what}: acquire") if "acquire" in items else None
    doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
    if release is None:
        return None
    return Resource(name, release, acquire, doc, s.loc(knode))


def _seconds(s: Schema, node: Node, what: str) -> str | float | None:
    """A number of seconds, or the name of a param that holds one."""
    if isinstance(node, ScalarNode) and node.tag != STR:  # seconds, not a param
        return s.number(node, what)
    return s.name(node, what)


def _timeout(s: Schema, owner: str, knode: Node, node: Node, what: str = "") -> Timeout | None:
    """``knode`` is the ``timeout:`` key: findings about the timeout point there."""
    what = what or f"state {owner!r} timeout"
    items = s.mapping(node, what, TIMEOUT_KEYS)
    if items is None:
        return None
    fix = "Write 'timeout: {after: <param or seconds>, fire: <event>}'."
    after_node = s.require(items, "after", knode, what, fix)
    fire_node = s.require(items, "fire", knode, what, fix)
    if after_node is None or fire_node is None:
        return None
    after = _seconds(s, after_node, f"{what}: after")
    fire = s.name(fire_node, f"{what}: fire")
    if after is None or fire is None:
        return None
    return Timeout(after, fire, s.loc(knode))


def _state(s: Schema, name: str, knode: Node, node: Node) -> State | None:
    """``knode`` is the state's name: findings about the state point there, not at its first key."""
    what = f"state {name!r}"
    if isinstance(node, ScalarNode) and node.tag == NULL:
        return State(name, loc=s.loc(knode))  # `name: {}` written as `name:`
    items = s.mapping(node, what, STATE_KEYS)
    if items is None:
        return None
    final = None
    if "final" in items:
        fnode = items["final"][1]
        value = s.scalar(fnode, f"{what}: final")
        if value in ("success", "failure"):
            final = value
        elif value is not None:
            s.error(
                fnode,
                f"{what}: final must be 'success' or 'failure', not {value!r}",
                "Final states say how the request ended: 'final: success' or 'final: failure'.",
            )
    waits_local = False
    if "waits" in items:
        wnode = items["waits"][1]
        value = s.scalar(wnode, f"{what}: waits")
        if value == "local":
            waits_local = True
        elif value is not None:
            s.error(
                wnode,
                f"{what}: waits must be 'local', not {value!r}",
                "'waits: local' marks a state only local code leaves; otherwise give it a timeout.",
            )
    return State(
        name,
        initial=s.boolean(items["initial"][1], f"{what}: initial") if "initial" in items else False,
        final=final,  # type: ignore[arg-type]
        holds=_holds(s, items["holds"][1], f"{what}: holds") if "holds" in items else (),
        waits_local=waits_local,
        timeout=_timeout(s, name, *items["timeout"]) if "timeout" in items else None,
        warn_after=_seconds(s, items["warn_after"][1], f"{what}: warn_after") if "warn_after" in items else None,
        doc=s.text(items["doc"][1], f"{what}: doc") if "doc" in items else "",
        loc=s.loc(knode),
    )


def _holds(s: Schema, node: Node, what: str) -> tuple[str, ...]:
    """``[a, b]``, each held once, or ``{a: 2, b: 1}``: a resource held more than once (a pin taken twice) is
    listed as often as it is held, so every edge acquires and releases the difference, one call per unit."""
    if not isinstance(node, MappingNode):
        return s.names(node, what, empty=True)
    out: list[str] = []
    fix = "Write how many times the state holds it, e.g. '{block_pin: 2}', or list names held once: '[a, b]'."
    for knode, vnode in node.value:
        name = s.name(knode, what)
        times = s.count(vnode, f"{what}: {knode.value}", fix)
        if name is not None and name in out:
            s.error(
                knode, f"{what} names {name!r} twice", f"Name it once, with how many times it is held: '{{{name}: 2}}'."
            )
        elif name is not None and times is not None:
            out.extend([name] * times)
    return tuple(out)


def _send(s: Schema, node: Node) -> Send | None:
    items = s.mapping(node, "send", SEND_KEYS)
    if items is None:
        return None
    fix = "Write 'send: {to: <role>, message: <message>}' (or a list of them)."
    to = s.required_name(items, "to", node, "send", fix, "send: to")
    message = s.required_name(items, "message", node, "send", fix, "send: message")
    if to is None or message is None:
        return None
    return Send(to, message, s.loc(node))


def _sends(s: Schema, node: Node) -> tuple[Send, ...]:
    """``send:`` holds one ``{to, message}`` mapping or a list of them."""
    if isinstance(node, SequenceNode):
        if not node.value:
            s.error(node, "send is an empty list", "Name at least one message, or drop 'send'.")
        return s.sequence(node, "send", lambda n: _send(s, n))
    one = _send(s, node)
    return (one,) if one is not None else ()


def _transition(s: Schema, node: Node) -> Transition | None:
    items = s.mapping(node, "transition", TRANSITION_KEYS)
    if items is None:
        return None
    fix = "Write '- {event: <name>, from: <state or list or \"*\">, to: <state>}'."
    nodes = [s.require(items, k, node, "transition", fix) for k in ("event", "from", "to")]
    if None in nodes:
        return None
    event_node, from_node, to_node = nodes
    assert event_node is not None and from_node is not None and to_node is not None
    event = s.name(event_node, "transition event")
    sources = s.names(from_node, "transition source", wildcard=True)
    target = s.name(to_node, "transition target")
    do = s.name(items["do"][1], "transition do") if "do" in items else None
    doc = s.text(items["doc"][1], "transition doc") if "doc" in items else ""
    sends = _sends(s, items["send"][1]) if "send" in items else ()
    payload = s.names(items["payload"][1], "transition payload", empty=True) if "payload" in items else ()
    count = _count(s, items["count"][1]) if "count" in items else None
    release = _release_by(s, items["release"][1]) if "release" in items else ()
    if event is None or not sources or target is None:
        return None
    return Transition(event, sources, target, do, doc, s.loc(node), sends, payload, count, release)


def _release_by(s: Schema, node: Node) -> tuple[tuple[str, str], ...]:
    """``release: {recv_report: report_loaded}``: on this transition, those resources go by those actions."""
    fix = "Write 'release: {<resource>: <driver method>}', e.g. 'release: {recv_report: report_loaded}'."
    if not isinstance(node, MappingNode):
        s.error(node, f"transition release must be a mapping of resource to action, not {kind_of(node)}", fix)
        return ()
    out: list[tuple[str, str]] = []
    for knode, vnode in node.value:
        resource, action = s.name(knode, "transition release"), s.name(vnode, "transition release action")
        if resource is not None and any(r == resource for r, _a in out):
            s.error(knode, f"transition release names {resource!r} twice", fix)
        elif resource is not None and action is not None:
            out.append((resource, action))
    return tuple(out)


def _count(s: Schema, node: Node) -> int | str | None:
    """``count: K``: a whole number of senders (0 or more), or the name of a param or payload key that gives it."""
    fix = "Write how many distinct senders it waits for (e.g. 2), or a param or payload key that says (e.g. readers)."
    if node.tag == INT:
        return s.whole(node, "transition count", fix)
    return s.name(node, "transition count")


def _begin(s: Schema, node: Node) -> tuple[str, ...]:
    """``begin: {payload: [names]}``: the keyword arguments begin() carries to the initial acquires."""
    items = s.mapping(node, "begin", BEGIN_KEYS)
    if items is None:
        return ()
    if "doc" in items:
        s.text(items["doc"][1], "begin doc")
    return s.names(items["payload"][1], "begin payload", empty=True) if "payload" in items else ()


def _ignore(s: Schema, node: Node) -> IgnoreRule | None:
    items = s.mapping(node, "ignore rule", IGNORE_KEYS)
    if items is None:
        return None
    fix = "Write '- {event: [<events>], in: [<states>]}'."
    event_node = s.require(items, "event", node, "ignore rule", fix)
    in_node = s.require(items, "in", node, "ignore rule", fix)
    if event_node is None or in_node is None:
        return None
    events = s.names(event_node, "ignored event")
    states = s.names(in_node, "ignore state", wildcard=True)
    if not events or not states:
        return None
    return IgnoreRule(events, states, s.loc(node))


_RELATION = re.compile(r"^\s*(?P<left>[^<>=]+?)\s*(?P<op>>=|<=|>|<)\s*(?P<right>[^<>=]+?)\s*$")
_TERM = re.compile(
    r"^\s*(?:(?P<coef>[0-9]+(?:\.[0-9]*)?)\s*\*\s*)?(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*$|^\s*(?P<num>[0-9]+(?:\.[0-9]*)?)\s*$"
)


def _relation(s: Schema, node: Node) -> Relation | None:
    """``a > b + 2 * c``: two sums of params and numbers compared with <, <=, > or >=."""
    text = s.scalar(node, "relation")
    if text is None:
        return None
    fix = "Write '<param> > <param>' with sums like 'a + 2 * b + 5' on either side and one of <, <=, >, >=."
    match = _RELATION.match(text)
    if match is None:
        s.error(node, f"relation {text!r} is not 'left <op> right'", fix)
        return None
    sides: list[tuple[tuple[float, str | None], ...]] = []
    for side in (match["left"], match["right"]):
        terms: list[tuple[float, str | None]] = []
        for part in side.split("+"):
            term = _TERM.match(part)
            if term is None:
                s.error(node, f"relation {text!r}: {part.strip()!r} is not a param, a number or 'number * param'", fix)
                return None
            if term["num"] is not None:
                terms.append((float(term["num"]), None))
            else:
                terms.append((float(term["coef"] or 1.0), term["name"]))
        sides.append(tuple(terms))
    return Relation(sides[0], match["op"], sides[1], text.strip(), s.loc(node))


def _space(s: Schema, name: str, knode: Node, node: Node) -> Space | None:
    what = f"id space {name!r}"
    items = s.mapping(node, what, SPACE_KEYS)
    if items is None:
        return None
    fix = f"Say which event's payload carries the id: '{name}: {{linked_at: begin}}' (or an event name)."
    at_node = s.require(items, "linked_at", knode, what, fix)
    linked_at = s.name(at_node, f"{what}: linked_at") if at_node is not None else None
    doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
    return Space(name, linked_at, doc, s.loc(knode)) if linked_at is not None else None


def _event_decl(s: Schema, name: str, knode: Node, node: Node, key: str) -> EventDecl | None:
    what = f"event {name!r}"
    items = s.mapping(node, what, EVENT_KEYS)
    if items is None:
        return None
    by = s.name(items["by"][1], f"{what}: by") if "by" in items else key
    remote = s.boolean(items["remote"][1], f"{what}: remote") if "remote" in items else False
    doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
    early = _early(s, items["early"][1], what) if "early" in items else None
    return EventDecl(name, by or key, remote, doc, s.loc(knode), early) if by is not None else None


def _early(s: Schema, node: Node, what: str) -> Early | None:
    """``early: {keep: N, within: <seconds or param>}``: how many early messages wait, and for how long."""
    items = s.mapping(node, f"{what}: early", EARLY_KEYS)
    if items is None:
        return None
    example = "'early: {keep: 1024, within: abort_timeout}'"
    keep_node = s.require(items, "keep", node, f"{what}: early", f"Say how many may wait at once: {example}.")
    within_node = s.require(items, "within", node, f"{what}: early", f"Say how long one may wait: {example}.")
    if keep_node is None or within_node is None:
        return None
    keep = s.count(keep_node, f"{what}: early: keep", f"Write how many messages may wait at once: {example}.")
    within = _seconds(s, within_node, f"{what}: early: within")
    if keep is None or within is None:
        return None
    return Early(keep, within, s.loc(node))


def _phase(s: Schema, name: str, knode: Node, node: Node) -> Phase | None:
    """``name: {states: [...] or '*', timeout: {after, fire}}``: one deadline over a set of states."""
    what = f"phase {name!r}"
    items = s.mapping(node, what, PHASE_KEYS)
    if items is None:
        return None
    example = f"'{name}: {{states: [reading, acked], timeout: {{after: lease_ttl, fire: expire}}}}'"
    states_node = s.require(items, "states", knode, what, f"Say which states the deadline spans: {example}.")
    timeout_node = s.require(items, "timeout", knode, what, f"Say when it fires and what: {example}.")
    doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
    if states_node is None or timeout_node is None:
        return None
    states = s.names(states_node, f"{what}: states", wildcard=True)
    timeout = _timeout(s, name, items["timeout"][0], timeout_node, f"{what} timeout")
    if not states or timeout is None:
        return None
    return Phase(name, states, timeout, doc, s.loc(knode))


def _owned(s: Schema, name: str, knode: Node, node: Node) -> Owned | None:
    """``name: {machine, by, ended, failed, forward}``: children of another machine, linked by their begin payload."""
    what = f"owns {name!r}"
    items = s.mapping(node, what, OWNS_KEYS)
    if items is None:
        return None
    example = f"'{name}: {{machine: store_job, by: request_id, ended: {name}_ended}}'"
    machine = s.required_name(items, "machine", knode, what, f"Say which machine the children run: {example}.",
                              f"{what}: machine")  # fmt: skip
    by = s.required_name(items, "by", knode, what, "Say which key of the child's begin payload names its parent: "
                         f"{example}.", f"{what}: by")  # fmt: skip
    ended = s.required_name(items, "ended", knode, what, "Say which event the parent takes once none of its "
                            f"children is live: {example}.", f"{what}: ended")  # fmt: skip
    failed = s.name(items["failed"][1], f"{what}: failed") if "failed" in items else None
    forward = s.names(items["forward"][1], f"{what}: forward", empty=True) if "forward" in items else ()
    doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
    if machine is None or by is None or ended is None:
        return None
    return Owned(name, machine, by, ended, failed, forward, doc, s.loc(knode))


def _outgoing(s: Schema, name: str, knode: Node, node: Node) -> Outgoing | None:
    what = f"outgoing message {name!r}"
    items = s.mapping(node, what, OUTGOING_KEYS)
    if items is None:
        return None
    example = f"'{name}: {{to: <peer machine>, carries: <id space>}}'"
    to = s.required_name(items, "to", knode, what, f"Say which peer machine receives it: {example}.", f"{what}: to")
    fix = f"Say which id space the id it carries comes from (the key's or one under 'spaces:'): {example}."
    carries = s.required_name(items, "carries", knode, what, fix, f"{what}: carries")
    event = s.name(items["event"][1], f"{what}: event") if "event" in items else name
    doc = s.text(items["doc"][1], f"{what}: doc") if "doc" in items else ""
    if to is None or carries is None or event is None:
        return None
    return Outgoing(name, to, event, carries, doc, s.loc(knode))


def read_text(text: str, path: str = "<string>") -> Spec:
    """Read spec text (schema only: see :func:`kvfsm.parse` for the checks); raises :class:`SpecError` listing every KVF001."""
    s = Schema(path)
    root, top = s.top(
        text,
        "the spec",
        "machine",
        TOP_KEYS,
        "'kvfsm: 1', 'machine: <name>', 'key: <id space>', 'states:' and 'transitions:'",
        "Check it with 'kvfsm check', explore it with 'kvfsm explore', draw it with 'kvfsm diagram' and test "
        "it with 'kvfsm test'; replay one of its roles' machine specs (a role's 'spec:' must name a machine spec).",
    )
    name = s.header(top, root, "the spec", "machine")
    key = s.required_name(
        top, "key", root, "the spec", "Add 'key: request_id' (the id space that names instances).", "key"
    )
    doc = s.text(top["doc"][1], "doc") if "doc" in top else ""

    params: dict[str, float] = {}
    if "params" in top:
        for pname, _k, pnode in s.named_mapping(top["params"][1], "params", "param"):
            value = s.number(pnode, f"param {pname!r}")
            if value is not None:
                params[pname] = value

    resources: dict[str, Resource] = {}
    if "resources" in top:
        for rname, rknode, rnode in s.named_mapping(top["resources"][1], "resources", "resource"):
            resource = _resource(s, rname, rknode, rnode)
            if resource is not None:
                resources[rname] = resource

    states: dict[str, State] = {}
    states_node = s.require(
        top, "states", root, "the spec", "Add 'states:' with at least an initial and a final state."
    )
    if states_node is not None:
        for sname, sknode, snode in s.named_mapping(states_node, "states", "state"):
            state = _state(s, sname, sknode, snode)
            if state is not None:
                states[sname] = state

    transitions: tuple[Transition, ...] = ()
    tnode = s.require(
        top, "transitions", root, "the spec", "Add 'transitions:' with one '- {event, from, to}' entry per transition."
    )
    if tnode is not None:
        transitions = s.sequence(tnode, "transitions", lambda n: _transition(s, n))

    ignore = s.sequence(top["ignore"][1], "ignore", lambda n: _ignore(s, n)) if "ignore" in top else ()
    on_error = s.name(top["on_error"][1], "on_error") if "on_error" in top else None
    begin_payload = _begin(s, top["begin"][1]) if "begin" in top else ()
    relations = s.sequence(top["relations"][1], "relations", lambda n: _relation(s, n)) if "relations" in top else ()
    spaces: dict[str, Space] = {}
    if "spaces" in top:
        for sname, sknode, snode in s.named_mapping(top["spaces"][1], "spaces", "id space"):
            space = _space(s, sname, sknode, snode)
            if space is not None:
                spaces[sname] = space
    event_decls: dict[str, EventDecl] = {}
    if "events" in top:
        for ename, eknode, enode in s.named_mapping(top["events"][1], "events", "event"):
            decl = _event_decl(s, ename, eknode, enode, key or "")
            if decl is not None:
                event_decls[ename] = decl
    outgoing: dict[str, Outgoing] = {}
    if "outgoing" in top:
        for oname, oknode, onode in s.named_mapping(top["outgoing"][1], "outgoing", "outgoing message"):
            message = _outgoing(s, oname, oknode, onode)
            if message is not None:
                outgoing[oname] = message

    phases: dict[str, Phase] = {}
    if "phases" in top:
        for pname, pknode, pnode in s.named_mapping(top["phases"][1], "phases", "phase"):
            phase = _phase(s, pname, pknode, pnode)
            if phase is not None:
                phases[pname] = phase

    owns: dict[str, Owned] = {}
    if "owns" in top:
        for oname, oknode, onode in s.named_mapping(top["owns"][1], "owns", "owned machine"):
            owned = _owned(s, oname, oknode, onode)
            if owned is not None:
                owns[oname] = owned

    if s.errors or name is None or key is None:
        raise SpecError(sorted(s.errors, key=lambda f: (f.line, f.col)))
    locs = {k: s.loc(knode) for k, (knode, _v) in top.items()}
    return Spec(
        name=name,
        key=key,
        states=states,
        transitions=transitions,
        resources=resources,
        params=params,
        ignore=ignore,
        on_error=on_error,
        doc=doc,
        path=path,
        locs=locs,
        begin_payload=begin_payload,
        relations=relations,
        spaces=spaces,
        event_decls=event_decls,
        outgoing=outgoing,
        phases=phases,
        owns=owns,
    )


# -- reading input files, bounded -------------------------------------------------

MAX_SPEC_BYTES = 1 << 20
"""Largest spec, system or exemption file read (1 MiB): the bundled specs are a few KiB, and a bound
keeps a wrong path (a log, a disk image, /dev/zero) from being read whole into memory."""


class InputError(KvfsmError):
    """An input file that cannot be read as text: missing, not a regular file, too large, binary or not UTF-8.

    ``problem`` says what is wrong in words that follow the path (``is a directory, ...``);
    ``fix`` how to mend it. Each reader wraps it in its own error (a KVF000 finding, a trace error).
    """

    def __init__(self, path: str, problem: str, fix: str) -> None:
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"{path}: {problem}")


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def not_regular(mode: int) -> str | None:
    """What a file that is not a regular file is, in words (``a FIFO (named pipe)``); ``None`` for a regular one."""
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def _size(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB" if n >= 1 << 20 else f"{n:,} bytes"


def read_input(path: str | Path, *, what: str, limit: int = MAX_SPEC_BYTES) -> str:
    """A regular file's text, read with a bound: at most ``limit`` bytes, UTF-8, no NUL byte.

    ``what`` names the file in messages (``spec file``). Raises :class:`InputError`
    for anything else: a missing file, a directory, a FIFO or device (refused
    before it is read, and opened without blocking, so an empty FIFO cannot
    hang the reader), a file over ``limit``, binary or non-UTF-8 bytes.
    """
    shown = str(path)
    one = f"{'an' if what[:1] in 'aeiou' else 'a'} {what}"
    too_big = f"Name the {what} itself; {one} is at most {_size(limit)}."
    try:
        info = os.stat(path)
        kind = not_regular(info.st_mode)
        if kind is None:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
            try:
                info = os.fstat(fd)  # the file opened, not the one stat saw
                kind = not_regular(info.st_mode)
                data = b"" if kind is not None or info.st_size > limit else _read_at_most(fd, limit + 1)
            finally:
                os.close(fd)
    except FileNotFoundError:
        raise InputError(shown, f"no such {what}", "Check the path.") from None
    except OSError as exc:
        raise InputError(shown, f"cannot read the {what}: {exc.strerror or exc}", "Make it readable.") from None
    if kind is not None:
        fix = "Name a file in it." if kind == "a directory" else f"Name a regular file: {one} is read whole."
        raise InputError(shown, f"is {kind}, not {one}", fix)
    if info.st_size > limit or len(data) > limit:
        size = _size(info.st_size) if info.st_size > limit else f"more than {_size(limit)}"
        raise InputError(shown, f"is {size}, more than the {_size(limit)} {one} may be", too_big)
    nul = data.find(b"\0")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise InputError(
            shown,
            f"is binary, not text: a NUL byte at line {line}, byte {nul + 1}",
            f"Name the {what} itself, a YAML or JSON text file.",
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise InputError(
            shown,
            f"is not UTF-8 text: byte 0x{data[exc.start]:02x} at line {line}, byte {exc.start + 1}",
            "Save it as UTF-8.",
        ) from None


def _read_at_most(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes from ``fd`` (fewer only at its end)."""
    chunks: list[bytes] = []
    left = n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read(path: str | Path) -> Spec:
    """Read and parse a spec file (schema errors only; see :func:`kvfsm.load` for checks)."""
    try:
        text = read_input(path, what="spec file")
    except InputError as exc:
        fix = "Check the path; bundled specs live in specs/." if exc.problem.startswith("no such") else exc.fix
        if exc.problem.startswith("is a directory"):
            fix = "Name a .yaml file, or use a shell glob such as specs/*.yaml."
        raise SpecError([Finding(READ_ERROR, "error", exc.path, 0, exc.problem, fix)]) from None
    return read_text(text, str(path))
