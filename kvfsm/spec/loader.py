"""Read a schema-v1 YAML spec into the immutable model, keeping every line number.

The loader walks PyYAML's node graph rather than plain Python objects so that
each error (KVF001) names the file, line and column it came from, and says how
to mend it. It collects every schema error it can before raising.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .findings import READ_ERROR, Finding, SpecError
from .model import WILDCARD, IgnoreRule, Loc, Resource, Send, Spec, State, Timeout, Transition

SCHEMA_VERSION = 1
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader where PyYAML was built with it (much faster on big specs); errors are re-read without it."""
_NUMERAL = re.compile(r"[-+]?[0-9][0-9_]*\Z")
"""An integer literal: one that is no float is too large for one."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
T = TypeVar("T")
_NULL = "tag:yaml.org,2002:null"
_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"

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
}
BEGIN_KEYS = ("payload", "doc")
RESOURCE_KEYS = ("release", "acquire", "doc")
STATE_KEYS = ("initial", "final", "holds", "waits", "timeout", "doc")
TIMEOUT_KEYS = ("after", "fire")
TRANSITION_KEYS = ("event", "from", "to", "do", "doc", "send", "payload")
SEND_KEYS = ("to", "message")
IGNORE_KEYS = ("event", "in")


class _Schema:
    """Walks the node graph, converting values and collecting KVF001 findings."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.errors: list[Finding] = []

    def loc(self, node: Node) -> Loc:
        mark = node.start_mark
        return Loc(self.path, mark.line + 1, mark.column + 1)

    def error(self, node: Node | Loc, message: str, fix: str = "") -> None:
        loc = node if isinstance(node, Loc) else self.loc(node)
        self.errors.append(Finding("KVF001", "error", self.path, loc.line, message, fix, loc.col))

    # -- typed readers; each returns None after recording an error ---------

    def mapping(
        self, node: Node, what: str, allowed: tuple[str, ...] | dict[str, str]
    ) -> dict[str, tuple[Node, Node]] | None:
        if not isinstance(node, MappingNode):
            keys = f"with keys {', '.join(allowed)}" if allowed else "one entry per name"
            self.error(
                node, f"{what} must be a mapping, not {_kind(node)}", f"Write it as '{{key: value, ...}}', {keys}."
            )
            return None
        out: dict[str, tuple[Node, Node]] = {}
        for knode, vnode in node.value:
            if not isinstance(knode, ScalarNode):
                self.error(knode, f"{what} has a non-text key", "Keys must be plain names.")
                continue
            key = knode.value
            if key in out:
                self.error(knode, f"{what} repeats key {key!r}", "Each key may appear once; merge the two entries.")
                continue
            if allowed and key not in allowed:
                close = _closest(key, allowed)
                hint = f"Did you mean {close!r}? " if close else ""
                self.error(knode, f"{what} has unknown key {key!r}", f"{hint}Allowed keys: {', '.join(allowed)}.")
                continue
            out[key] = (knode, vnode)
        return out

    def named_mapping(self, node: Node, what: str, one: str) -> list[tuple[str, Node, Node]]:
        """A mapping whose keys are user-chosen names (states, resources, params)."""
        items = self.mapping(node, what, ())
        if items is None:
            return []
        out = []
        for name, (knode, vnode) in items.items():
            if self.name(knode, f"{one} name") is not None:
                out.append((name, knode, vnode))
        return out

    def scalar(self, node: Node, what: str) -> str | None:
        if not isinstance(node, ScalarNode):
            self.error(
                node,
                f"{what} must be a single value, not {_kind(node)}",
                "Write one plain value here (a name, number or string), not a list or a mapping.",
            )
            return None
        return str(node.value)

    def name(self, node: Node, what: str) -> str | None:
        value = self.scalar(node, what)
        if value is None:
            return None
        if node.tag in (_INT, _FLOAT, _NULL):
            self.error(node, f"{what} must be a name, not {_kind(node)}", "Write a name: letters, digits and '_'.")
            return None
        if not _NAME.match(value):
            self.error(
                node,
                f"{what} {value!r} is not a valid name",
                "Use letters, digits and '_', not starting with a digit (names become driver methods and diagram ids).",
            )
            return None
        return value

    def text(self, node: Node, what: str) -> str:
        value = self.scalar(node, what)
        return value if value is not None else ""

    def boolean(self, node: Node, what: str) -> bool:
        value = self.scalar(node, what)
        if value is None:
            return False
        flag = value.lower()
        if node.tag != _BOOL or flag not in _TRUE + _FALSE:
            self.error(node, f"{what} must be true or false, not {value!r}", "Write it unquoted: true or false.")
            return False
        return flag in _TRUE

    def number(self, node: Node, what: str) -> float | None:
        value = self.scalar(node, what)
        if value is None:
            return None
        number = _to_number(node)
        if number is None and node.tag in (_INT, _FLOAT) and _NUMERAL.match(value):
            self.error(node, f"{what} is out of range: {value[:40]}…", "Write plain seconds, e.g. 30.0.")
            return None
        if number is None:
            self.error(node, f"{what} must be a number, not {_kind(node)}", "Write plain seconds, unquoted, e.g. 30.0.")
            return None
        if number < 0 or not math.isfinite(number):
            self.error(
                node,
                f"{what} must be a finite, non-negative number of seconds, not {value}",
                "Write seconds such as 30.0 (a negative, .inf or .nan deadline is no deadline).",
            )
            return None
        return number

    def names(self, node: Node, what: str, *, wildcard: bool = False, empty: bool = False) -> tuple[str, ...]:
        """A name or a list of names, each once; ``"*"`` allowed where ``wildcard``, ``[]`` where ``empty``."""
        if isinstance(node, MappingNode):
            self.error(node, f"{what} must be a name or a list of names, not a mapping", "Write 'a' or '[a, b]'.")
            return ()
        items = node.value if isinstance(node, SequenceNode) else [node]
        out: list[str] = []
        for item in items:
            if wildcard and isinstance(item, ScalarNode) and item.value == WILDCARD:
                name: str | None = WILDCARD
            else:
                name = self.name(item, what)
            if name is None:
                continue
            if name in out:
                self.error(item, f"{what} lists {name!r} twice", f"Name {name!r} once.")
                continue
            out.append(name)
        if not empty and isinstance(node, SequenceNode) and not node.value:
            self.error(node, f"{what} is an empty list", "Name at least one.")
        return tuple(out)

    def require(self, items: dict[str, tuple[Node, Node]], key: str, owner: Node, what: str, fix: str) -> Node | None:
        if key in items:
            return items[key][1]
        self.error(owner, f"{what} is missing required key {key!r}", fix)
        return None

    def header(self, top: dict[str, tuple[Node, Node]], root: Node, what: str, kind: str) -> str | None:
        """Check ``kvfsm: 1`` and read the file's name (``machine:`` or ``system:``); None if absent or bad."""
        version_node = self.require(top, "kvfsm", root, what, "Add 'kvfsm: 1' as the first line.")
        if version_node is not None:
            version = self.scalar(version_node, "kvfsm")
            if version is not None and (version_node.tag != _INT or version != str(SCHEMA_VERSION)):
                self.error(
                    version_node,
                    f"unsupported schema version: kvfsm is {_kind(version_node)}",
                    f"This kvfsm reads schema version {SCHEMA_VERSION}: write 'kvfsm: {SCHEMA_VERSION}'.",
                )
        return self.required_name(top, kind, root, what, f"Add '{kind}: <name>'.", kind)

    def top(
        self, text: str, what: str, kind: str, allowed: dict[str, str], start: str, other_fix: str
    ) -> tuple[Node, dict[str, tuple[Node, Node]]]:
        """The file's root and top-level keys; one KVF001 when it is the other kind of file (machine ↔ system)."""
        root = compose(text, self.path, what, start)
        keys = _top_keys(root)
        other = "system" if kind == "machine" else "machine"
        if other in keys and kind not in keys:
            at = self.loc(keys[other])
            name = "system file" if other == "system" else "machine spec"
            mine = "machine spec" if kind == "machine" else "system file"
            raise SpecError(
                [
                    Finding(
                        "KVF001",
                        "error",
                        self.path,
                        at.line,
                        f"this is a {name} ('{other}:'), not a {mine}",
                        other_fix,
                        at.col,
                    )
                ]
            )
        top = self.mapping(root, what, allowed)
        if top is None:
            raise SpecError(self.errors)
        return root, top

    def required_name(
        self, items: dict[str, tuple[Node, Node]], key: str, owner: Node, what: str, fix: str, label: str
    ) -> str | None:
        """The name under ``key``, which must be there; None (with the error recorded) if absent or bad."""
        node = self.require(items, key, owner, what, fix)
        return self.name(node, label) if node is not None else None

    def sequence(self, node: Node, what: str, read: Callable[[Node], T | None]) -> tuple[T, ...]:
        if not isinstance(node, SequenceNode):
            self.error(node, f"{what} must be a list, not {_kind(node)}", "Write one '- {...}' entry per item.")
            return ()
        out = []
        for item in node.value:
            value = read(item)
            if value is not None:
                out.append(value)
        return tuple(out)


_TRUE = ("true", "yes", "on")
_FALSE = ("false", "no", "off")


def _kind(node: Node) -> str:
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if node.tag == _NULL:
        return "an empty value" if node.value in ("", "~") else f"the null value {node.value!r}"
    if node.tag in (_INT, _FLOAT) and _to_number(node) is not None:
        return f"the number {node.value}"
    return f"the value {node.value!r}"


def _to_number(node: Node) -> float | None:
    """The value of an int- or float-tagged scalar (``!!int abc`` is not a number)."""
    if node.tag not in (_INT, _FLOAT):
        return None
    try:
        return float(SafeConstructor().construct_object(node))
    except (yaml.YAMLError, TypeError, ValueError, OverflowError):
        return None


def _closest(word: str, options: tuple[str, ...] | dict[str, str]) -> str | None:
    """The known key ``word`` was most likely meant to be (case does not count against it)."""
    lowered = {o.lower(): o for o in options}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


# -- the schema, section by section ------------------------------------------


def _resource(s: _Schema, name: str, knode: Node, node: Node) -> Resource | None:
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


def _timeout(s: _Schema, owner: str, knode: Node, node: Node) -> Timeout | None:
    """``knode`` is the ``timeout:`` key: findings about the timeout point there."""
    what = f"state {owner!r} timeout"
    items = s.mapping(node, what, TIMEOUT_KEYS)
    if items is None:
        return None
    fix = "Write 'timeout: {after: <param or seconds>, fire: <event>}'."
    after_node = s.require(items, "after", knode, what, fix)
    fire_node = s.require(items, "fire", knode, what, fix)
    if after_node is None or fire_node is None:
        return None
    after: str | float | None
    if isinstance(after_node, ScalarNode) and after_node.tag != "tag:yaml.org,2002:str":  # seconds, not a param
        after = s.number(after_node, f"{what}: after")
    else:
        after = s.name(after_node, f"{what}: after")
    fire = s.name(fire_node, f"{what}: fire")
    if after is None or fire is None:
        return None
    return Timeout(after, fire, s.loc(knode))


def _state(s: _Schema, name: str, knode: Node, node: Node) -> State | None:
    """``knode`` is the state's name: findings about the state point there, not at its first key."""
    what = f"state {name!r}"
    if isinstance(node, ScalarNode) and node.tag == _NULL:
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
        holds=s.names(items["holds"][1], f"{what}: holds", empty=True) if "holds" in items else (),
        waits_local=waits_local,
        timeout=_timeout(s, name, *items["timeout"]) if "timeout" in items else None,
        doc=s.text(items["doc"][1], f"{what}: doc") if "doc" in items else "",
        loc=s.loc(knode),
    )


def _send(s: _Schema, node: Node) -> Send | None:
    items = s.mapping(node, "send", SEND_KEYS)
    if items is None:
        return None
    fix = "Write 'send: {to: <role>, message: <message>}' (or a list of them)."
    to = s.required_name(items, "to", node, "send", fix, "send: to")
    message = s.required_name(items, "message", node, "send", fix, "send: message")
    if to is None or message is None:
        return None
    return Send(to, message, s.loc(node))


def _sends(s: _Schema, node: Node) -> tuple[Send, ...]:
    """``send:`` holds one ``{to, message}`` mapping or a list of them."""
    if isinstance(node, SequenceNode):
        if not node.value:
            s.error(node, "send is an empty list", "Name at least one message, or drop 'send'.")
        return s.sequence(node, "send", lambda n: _send(s, n))
    one = _send(s, node)
    return (one,) if one is not None else ()


def _transition(s: _Schema, node: Node) -> Transition | None:
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
    if event is None or not sources or target is None:
        return None
    return Transition(event, sources, target, do, doc, s.loc(node), sends, payload)


def _begin(s: _Schema, node: Node) -> tuple[str, ...]:
    """``begin: {payload: [names]}``: the keyword arguments begin() carries to the initial acquires."""
    items = s.mapping(node, "begin", BEGIN_KEYS)
    if items is None:
        return ()
    if "doc" in items:
        s.text(items["doc"][1], "begin doc")
    return s.names(items["payload"][1], "begin payload", empty=True) if "payload" in items else ()


def _ignore(s: _Schema, node: Node) -> IgnoreRule | None:
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


def _syntax_error(exc: yaml.MarkedYAMLError, path: str) -> Finding:
    """A YAML syntax error as KVF001; a bare ``*`` (an alias to PyYAML) gets told to quote it."""
    problem = exc.problem or str(exc)
    about_alias = "alias" in f"{exc.context or ''} {problem}"
    # An alias error's context mark is where the `*` stands; otherwise the problem mark is the spot.
    mark = (exc.context_mark if about_alias else None) or exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark else 1
    col = mark.column + 1 if mark else 1
    if about_alias:
        message = f"YAML syntax error: a bare * starts a YAML alias ({problem})"
        fix = 'The wildcard (every non-final state) must be quoted: write "*", e.g. from: "*".'
    else:
        message = f"YAML syntax error: {exc.context + ': ' if exc.context else ''}{problem}"
        fix = "Fix the YAML syntax at that position."
    return Finding("KVF001", "error", path, line, message, fix, col)


def compose(text: str, path: str, what: str, start: str) -> Node:
    """YAML text → a node tree with marks; one KVF001 for a syntax error, a too-deep nesting or no content."""
    try:
        try:
            root = yaml.compose(text, Loader=_LOADER)
        except yaml.YAMLError:  # read it again the slow way: the pure-Python parser's messages are better
            root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        raise SpecError([_syntax_error(exc, path)]) from None
    except yaml.YAMLError as exc:
        raise SpecError([Finding("KVF001", "error", path, 1, f"YAML error: {exc}", "Fix the YAML syntax.")]) from None
    except RecursionError:
        raise SpecError(
            [Finding("KVF001", "error", path, 1, f"{what} is nested too deeply to read", "Flatten the nesting.")]
        ) from None
    if root is None or (isinstance(root, ScalarNode) and root.tag == _NULL):  # nothing, or a bare `---`
        raise SpecError([Finding("KVF001", "error", path, 1, f"{what} is empty", f"Start with {start}.")])
    return root


def _top_keys(root: Node) -> dict[str, Node]:
    return {k.value: k for k, _v in root.value if isinstance(k, ScalarNode)} if isinstance(root, MappingNode) else {}


def read_text(text: str, path: str = "<string>") -> Spec:
    """Read spec text (schema only: see :func:`kvfsm.parse` for the checks); raises :class:`SpecError` listing every KVF001."""
    s = _Schema(path)
    root, top = s.top(
        text,
        "the spec",
        "machine",
        TOP_KEYS,
        "'kvfsm: 1', 'machine: <name>', 'key: <id space>', 'states:' and 'transitions:'",
        "Check it with 'kvfsm check' and explore it with 'kvfsm explore'; draw, test or replay "
        "one of its roles' machine specs (a role's 'spec:' must name a machine spec).",
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
    )


def read(path: str | Path) -> Spec:
    """Read and parse a spec file (schema errors only; see :func:`kvfsm.load` for checks)."""
    shown = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(
            [
                Finding(
                    READ_ERROR, "error", shown, 0, "no such spec file", "Check the path; bundled specs live in specs/."
                )
            ]
        ) from None
    except IsADirectoryError:
        raise SpecError(
            [
                Finding(
                    READ_ERROR,
                    "error",
                    shown,
                    0,
                    "is a directory, not a spec file",
                    "Name a .yaml file, or use a shell glob such as specs/*.yaml.",
                )
            ]
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(
            [
                Finding(
                    READ_ERROR,
                    "error",
                    shown,
                    0,
                    f"cannot read the spec file: {exc}",
                    "Make the file readable UTF-8 text.",
                )
            ]
        ) from None
    return read_text(text, shown)
