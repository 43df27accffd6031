"""The schema reader both loaders share: YAML text to a node tree, and typed reads of its nodes as KVF001 findings.

A loader (machine specs in :mod:`kvfsm.spec.loader`, compositions in
:mod:`kvfsm.spec.system.loader`) walks PyYAML's node graph with a
:class:`Schema` rather than plain Python objects, so each error names the
file, line and column it came from and says how to mend it; every reader
records its error and returns ``None`` so one pass collects them all.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable
from typing import TypeVar

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .findings import Finding, SpecError
from .model import WILDCARD, Loc

__all__ = [
    "BOOL",
    "FLOAT",
    "INT",
    "NULL",
    "SCHEMA_VERSION",
    "STR",
    "YAML_LOADER",
    "Schema",
    "compose",
    "kind_of",
]

SCHEMA_VERSION = 1
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's loader where PyYAML was built with it (much faster on big specs); errors are re-read without it."""
_NUMERAL = re.compile(r"[-+]?[0-9][0-9_]*\Z")
"""An integer literal: one that is no float is too large for one."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
T = TypeVar("T")

NULL = "tag:yaml.org,2002:null"
BOOL = "tag:yaml.org,2002:bool"
INT = "tag:yaml.org,2002:int"
FLOAT = "tag:yaml.org,2002:float"
STR = "tag:yaml.org,2002:str"


class Schema:
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
                node, f"{what} must be a mapping, not {kind_of(node)}", f"Write it as '{{key: value, ...}}', {keys}."
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
                f"{what} must be a single value, not {kind_of(node)}",
                "Write one plain value here (a name, number or string), not a list or a mapping.",
            )
            return None
        return str(node.value)

    def name(self, node: Node, what: str) -> str | None:
        value = self.scalar(node, what)
        if value is None:
            return None
        if node.tag in (INT, FLOAT, NULL):
            self.error(node, f"{what} must be a name, not {kind_of(node)}", "Write a name: letters, digits and '_'.")
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
        if node.tag != BOOL or flag not in _TRUE + _FALSE:
            self.error(node, f"{what} must be true or false, not {value!r}", "Write it unquoted: true or false.")
            return False
        return flag in _TRUE

    def number(self, node: Node, what: str) -> float | None:
        value = self.scalar(node, what)
        if value is None:
            return None
        number = _to_number(node)
        if number is None and node.tag in (INT, FLOAT) and _NUMERAL.match(value):
            self.error(node, f"{what} is out of range: {value[:40]}…", "Write plain seconds, e.g. 30.0.")
            return None
        if number is None:
            self.error(
                node, f"{what} must be a number, not {kind_of(node)}", "Write plain seconds, unquoted, e.g. 30.0."
            )
            return None
        if number < 0 or not math.isfinite(number):
            self.error(
                node,
                f"{what} must be a finite, non-negative number of seconds, not {value}",
                "Write seconds such as 30.0 (a negative, .inf or .nan deadline is no deadline).",
            )
            return None
        return number

    def count(self, node: Node, what: str, fix: str) -> int | None:
        """A whole number of at least 1 (how many requests, a channel's capacity)."""
        value = self.scalar(node, what)
        if value is None:
            return None
        number = _to_int(node)
        if number is None:
            self.error(node, f"{what} must be a whole number, not {kind_of(node)}", fix)
            return None
        if number < 1:
            self.error(node, f"{what} must be at least 1, not {number}", fix)
            return None
        return number

    def whole(self, node: Node, what: str, fix: str) -> int | None:
        """A whole number of at least 0 (how many senders a count waits for: none is meaningful)."""
        number = _to_int(node)
        if number is None or number < 0:
            self.error(node, f"{what} must be a whole number of at least 0, not {self.scalar(node, what)!r}", fix)
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
            if version is not None and (version_node.tag != INT or version != str(SCHEMA_VERSION)):
                self.error(
                    version_node,
                    f"unsupported schema version: kvfsm is {kind_of(version_node)}",
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
            self.error(node, f"{what} must be a list, not {kind_of(node)}", "Write one '- {...}' entry per item.")
            return ()
        out = []
        for item in node.value:
            value = read(item)
            if value is not None:
                out.append(value)
        return tuple(out)


_TRUE = ("true", "yes", "on")
_FALSE = ("false", "no", "off")


def kind_of(node: Node) -> str:
    """How a node reads in an error message: ``a list``, ``the number 3``, ``an empty value``."""
    if isinstance(node, MappingNode):
        return "a mapping"
    if isinstance(node, SequenceNode):
        return "a list"
    if node.tag == NULL:
        return "an empty value" if node.value in ("", "~") else f"the null value {node.value!r}"
    if node.tag in (INT, FLOAT) and _to_number(node) is not None:
        return f"the number {node.value}"
    return f"the value {node.value!r}"


def _to_number(node: Node) -> float | None:
    """The value of an int- or float-tagged scalar (``!!int abc`` is not a number)."""
    if node.tag not in (INT, FLOAT):
        return None
    try:
        return float(SafeConstructor().construct_object(node))
    except (yaml.YAMLError, TypeError, ValueError, OverflowError):
        return None


def _to_int(node: Node) -> int | None:
    """The value of an int-tagged scalar, whatever YAML notation it is in (``0x10``, ``1_000``); None otherwise."""
    if node.tag != INT:
        return None
    try:
        value = SafeConstructor().construct_object(node)
    except (yaml.YAMLError, TypeError, ValueError):
        return None
    return value if isinstance(value, int) else None


def _closest(word: str, options: tuple[str, ...] | dict[str, str]) -> str | None:
    """The known key ``word`` was most likely meant to be (case does not count against it)."""
    lowered = {o.lower(): o for o in options}
    match = difflib.get_close_matches(word.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[match[0]] if match else None


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
            root = yaml.compose(text, Loader=YAML_LOADER)
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
    if root is None or (isinstance(root, ScalarNode) and root.tag == NULL):  # nothing, or a bare `---`
        raise SpecError([Finding("KVF001", "error", path, 1, f"{what} is empty", f"Start with {start}.")])
    return root


def _top_keys(root: Node) -> dict[str, Node]:
    return {k.value: k for k, _v in root.value if isinstance(k, ScalarNode)} if isinstance(root, MappingNode) else {}
