"""Draw a spec or a composition as Graphviz (DOT, and any format ``dot`` writes) or Mermaid, deterministically.

What the picture must say at a glance: where a request starts, which states
are success or failure ends, what each state holds, which edges run actions or
release resources, which edges are deadlines (and how long they are), and
which events are messages from a peer. A transition from many states (``"*"``
or a long source list) is drawn once, from a group node, and the events
between the same two states share one edge, so the diagram never becomes a
hairball. A composition draws each role as a cluster around its machine, with
the messages as edges between the roles.
"""

from __future__ import annotations

import html
import re
import subprocess
import textwrap
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from ..errors import KvfsmError
from ..spec.model import Spec, Timeout, Transition
from ..spec.system import Message, Role, System

GROUP_AT = 3
"""A transition with this many sources or more is drawn from one group node."""

COLOURS = {"success": "#d8f3dc", "failure": "#fde2e4", "live": "#ffffff", "group": "#f1f3f5"}
MESSAGE = "#1864ab"
"""Messages, either way: events a peer sends, sends on transitions, and the edges between roles."""
DEADLINE = "#c92a2a"
OWNER = "#5f3dc4"
"""Ownership between roles (``owns:``): the parent's cluster to its children's, a diamond at the parent."""

WIDE = 48
"""Label lines longer than this are wrapped (a long line widens the whole rank it sits on)."""

Rankdir = Literal["TB", "LR"]
RANKDIRS: tuple[Rankdir, ...] = ("TB", "LR")
"""Top to bottom (the default: narrow enough for a page) or left to right."""

TEXT_FORMATS = ("dot", "mermaid")
"""What kvfsm writes itself, with no Graphviz installed; every other format is one ``dot -T`` writes."""
INTERACTIVE = frozenset({"x11", "xlib", "gtk"})
"""Formats ``dot`` lists that open a window rather than write a file."""
NO_GRAPHVIZ = "graphviz 'dot' is not installed; install the Debian package 'graphviz' (or use -f dot / -f mermaid)"
EXTENSIONS = {".mmd": "mermaid", ".mermaid": "mermaid", ".dot": "dot", ".gv": "dot"}
"""Output extensions that do not name their format; any other (``.png``, ``.pdf``) is the Graphviz format."""

Kind = Literal["text", "message"]
Line = tuple[str, Kind]
"""One label line and how it is drawn: plain, or as a message (blue)."""


@dataclass(frozen=True)
class _Part:
    """What one or more events on an arrow say: their titles, and what they do (the same for all of them)."""

    titles: tuple[str, ...]
    does: tuple[Line, ...]
    remote: bool

    def lines(self, wrap: bool = True) -> list[Line]:
        kind: Kind = "message" if self.remote else "text"
        lines: list[Line] = [(", ".join(self.titles), kind), *self.does]
        return [(part, k) for text, k in lines for part in (_wrap(text) if wrap else [text])]


@dataclass(frozen=True)
class _Arrow:
    source: str
    target: str
    parts: tuple[_Part, ...]
    timeout: bool
    pairs: tuple[tuple[str, str], ...] = ()
    """The (source state, event) edges of the spec this arrow draws."""
    cluster: str = ""
    """The phase cluster this arrow leaves from as a whole (its deadline's event), drawn from the cluster's edge."""

    @property
    def remote(self) -> bool:
        """Every event it draws comes from a peer."""
        return all(p.remote for p in self.parts)

    def lines(self, wrap: bool = True) -> list[Line]:
        """The label, wrapped for Graphviz (Mermaid wraps its own)."""
        return [line for p in self.parts for line in p.lines(wrap)]

    def joined(self, other: _Arrow) -> _Arrow:
        """This arrow with ``other``'s events too: an event that does what one already here does shares its lines."""
        parts = list(self.parts)
        for new in other.parts:
            same = next((i for i, p in enumerate(parts) if (p.does, p.remote) == (new.does, new.remote)), None)
            if same is None:
                parts.append(new)
            else:
                parts[same] = _Part(parts[same].titles + new.titles, new.does, new.remote)
        return _Arrow(self.source, self.target, tuple(parts), self.timeout, self.pairs + other.pairs, self.cluster)


def _wrap(text: str, width: int = WIDE) -> list[str]:
    """``text`` in lines of at most ``width`` characters where it can be; a duration (``= 30 s``) is not split."""
    glued = re.sub(r"(\S+) = (\S+) s\b", "\\1\0=\0\\2\0s", text)
    lines = textwrap.wrap(glued, width, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
    return [line.replace("\0", " ") for line in lines] or [text]


def _units(held: tuple[str, ...]) -> str:
    """``pin ×2, queue_task``: a resource held more than once (``holds: {pin: 2}``) says how many times."""
    counts = Counter(held)
    return ", ".join(r if counts[r] == 1 else f"{r} ×{counts[r]}" for r in dict.fromkeys(held))


def _effects(spec: Spec, source: str | None, target: str, many: bool) -> list[str]:
    """What an edge does to resources, as short lines ('frees a, b' / 'takes c')."""
    lines = []
    taken = spec.acquires(source, target)
    if taken:
        lines.append("takes " + _units(taken))
    if many:
        if any(spec.holds(s) for s in spec.states if s != target):
            lines.append("frees what the state holds")
    elif source is not None:
        freed = spec.releases(source, target)
        if freed:
            lines.append("frees " + _units(freed))
    return lines


def _duration(spec: Spec, after: str | float) -> str:
    """``store_timeout = 30 s``: a param with the value the spec gives it, or a number of seconds."""
    if isinstance(after, str):
        value = spec.params.get(after)
        return after if value is None else f"{after} = {value:g} s"
    return f"{after:g} s"


def _title(spec: Spec, t: Transition, inbox: frozenset[str], deadline: str = "") -> str:
    """``✉ event ⟨id space⟩ (remote) ×K after t = 30 s / do()``: a message's envelope, the id it names when it is not
    the key, who sends it, how many distinct senders it waits for, whether it may come before its id (early),
    the deadline that fires it, and the action."""
    event = t.event
    if _received(spec, t.event, inbox):
        event = f"✉ {event}"
    if spec.routed_by(t.event) != spec.key:
        event = f"{event} ⟨{spec.routed_by(t.event)}⟩"
    if spec.is_remote(t.event):
        event = f"{event} (remote)"
    if t.count is not None:
        event = f"{event} ×{t.count} senders"
    decl = spec.event_decls.get(t.event)
    if decl is not None and decl.early is not None:
        event = f"{event} (early ≤ {_duration(spec, decl.early.within)})"
    for owned in spec.owns.values():
        if t.event == owned.ended:
            event = f"{event} (no {owned.name} live)"
        elif t.event == owned.failed:
            event = f"{event} (one of {owned.name} failed)"
        elif t.event in owned.forward:
            event = f"{event} (→ {owned.name})"
    if deadline:
        event = f"{event} {deadline}"
    text = event if t.do is None else f"{event} / {t.do}()"
    return f"{text}  (on_error)" if t.event == spec.on_error else text


def _received(spec: Spec, event: str, inbox: frozenset[str]) -> bool:
    """Whether ``event`` comes from a peer: declared ``remote: true``, or a message of the composition."""
    return spec.is_remote(event) or event in inbox


def _sends(t: Transition) -> list[Line]:
    """A composition's messages leave on the edge that sends them ('sends ✉ abort_req → prefill')."""
    return [(f"sends ✉ {s.message} → {s.to}", "message") for s in t.sends]


def _is_timeout(spec: Spec, source: str, event: str) -> bool:
    return source in spec.states and spec.fires_on_timeout(source, event)


def _after(spec: Spec, timeout: Timeout) -> str:
    return f"after {_duration(spec, timeout.after)}"


def _deadline(spec: Spec, source: str, event: str) -> str:
    """What an edge's deadline is: 'after t = 30 s' for the state's own, 'after t = 30 s (phase p)' for a phase's."""
    own = spec.states[source].timeout
    if own is not None and own.fire == event:
        return _after(spec, own)
    phase = next(p for p in spec.phases_of(source) if spec.phases[p].timeout.fire == event)
    return f"{_after(spec, spec.phases[phase].timeout)} (phase {phase})"


def _clusters(spec: Spec) -> list[tuple[str, list[str]]]:
    """Phases drawn as clusters around their states, in declaration order: each phase whose states are not
    already inside an earlier cluster (Graphviz nests clusters but cannot overlap them)."""
    drawn: set[str] = set()
    out = []
    for name in spec.phases:
        members = [s for s in spec.states if s in spec.phase_states[name]]
        if members and drawn.isdisjoint(members):
            out.append((name, members))
            drawn.update(members)
    return out


def _part(title: str, effects: list[str], sends: list[Line], remote: bool) -> tuple[_Part]:
    return (_Part((title,), (*((line, "text") for line in effects), *sends), remote),)


def _layout(spec: Spec, inbox: frozenset[str]) -> tuple[list[tuple[str, list[str]]], list[_Arrow]]:
    """Group nodes (id, member states) and arrows, in declaration order; events between the same two ends
    (and of the same kind: deadline or not) share one arrow, their labels stacked."""
    groups: dict[tuple[str, ...], str] = {}
    arrows: list[_Arrow] = []
    clusters = _clusters(spec)
    for t in spec.transitions:
        sources = [s for s in spec.expand(t.sources) if s in spec.states]
        if t.target not in spec.states:
            continue
        remote = _received(spec, t.event, inbox)
        whole = next((c for c, members in clusters if members == sources), None)
        if whole is not None and spec.phases[whole].timeout.fire == t.event:  # the phase's deadline, from it all
            same = len({spec.releases(s, t.target) for s in sources}) == 1
            effects = _effects(spec, sources[0] if same else None, t.target, many=not same)
            title = _title(spec, t, inbox, _deadline(spec, sources[0], t.event))
            pairs = tuple((s, t.event) for s in sources)
            part = _part(title, effects, _sends(t), remote)
            arrows.append(_Arrow(sources[0], t.target, part, True, pairs, f"cluster_{whole}"))
            continue
        if len(sources) >= GROUP_AT:
            gid = groups.setdefault(tuple(sources), f"group_{len(groups)}")
            effects = _effects(spec, None, t.target, many=True)
            part = _part(_title(spec, t, inbox), effects, _sends(t), remote)
            arrows.append(_Arrow(gid, t.target, part, False, tuple((s, t.event) for s in sources)))
            continue
        for s in sources:
            timed = _is_timeout(spec, s, t.event)
            title = _title(spec, t, inbox, _deadline(spec, s, t.event) if timed else "")
            part = _part(title, _effects(spec, s, t.target, many=False), _sends(t), remote)
            arrows.append(_Arrow(s, t.target, part, timed, ((s, t.event),)))
    return [(gid, list(members)) for members, gid in groups.items()], _merged(arrows)


def _merged(arrows: list[_Arrow]) -> list[_Arrow]:
    """One arrow per (source, target, deadline or not, cluster), in order of first appearance."""
    out: dict[tuple[str, str, bool, str], _Arrow] = {}
    for a in arrows:
        key = (a.source, a.target, a.timeout, a.cluster)
        seen = out.get(key)
        out[key] = a if seen is None else seen.joined(a)
    return list(out.values())


def _ignored(spec: Spec) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for state, event, _rule in spec.ignored():
        out.setdefault(state, [])
        if event not in out[state]:
            out[state].append(event)
    return out


def _group_label(spec: Spec, members: list[str]) -> str:
    live = [n for n, s in spec.states.items() if not s.is_final]
    return "any live state" if members == live else "any of: " + ", ".join(members)


def _owns(spec: Spec) -> list[list[str]]:
    """Per ``owns:`` entry, the lines of a note drawn beside the parent: its children and what it hears of them."""
    notes = []
    for o in spec.owns.values():
        heard = f"ended → {o.ended}" + (f", failed → {o.failed}" if o.failed else "")
        passed = [f"passes on {', '.join(o.forward)}"] if o.forward else []
        notes.append([f"owns {o.name}: {o.machine}", f"each begun with its {o.by}", heard, *passed])
    return notes


def _outgoing(spec: Spec) -> list[str]:
    """The messages ``outgoing:`` says this machine sends its peers (from its actions, on no one edge)."""
    if not spec.outgoing:
        return []
    return ["sends its peers:"] + [
        f"✉ {o.name} → {o.to}" + (f".{o.event}" if o.event != o.name else "") + f" ⟨{o.carries}⟩"
        for o in spec.outgoing.values()
    ]


# -- DOT -------------------------------------------------------------------


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _h(text: str) -> str:
    return html.escape(text, quote=False)


def _note(lines: list[str]) -> str:
    """A plain-text label of left-aligned lines."""
    return "".join(line.replace("\\", "\\\\").replace('"', '\\"') + "\\l" for line in lines)


Coverage = Mapping[tuple[str, str], int]
"""``(source state, event) → times taken``, as a model-based run counts it (see kvfsm.testing)."""

UNTAKEN = ', style=dotted, color="#adb5bd", fontcolor="#868e96"'


def _covered(a: _Arrow, coverage: Coverage) -> tuple[str, str]:
    """Extra label line and style of an arrow in a coverage overlay: grey and dotted when never taken."""
    counts = [coverage.get(pair, 0) for pair in a.pairs]
    total = sum(counts)
    if total == 0:
        return "never taken", UNTAKEN
    if len(counts) > 1 and 0 in counts:
        untaken = [pair for pair, n in zip(a.pairs, counts, strict=True) if n == 0]
        if len({e for _s, e in a.pairs}) == 1:  # one event from several states: which states
            missed = "from " + ", ".join(src for src, _e in untaken)
        elif len({s for s, _e in a.pairs}) == 1:  # several events merged on one edge: which events
            missed = ", ".join(e for _s, e in untaken)
        else:
            missed = ", ".join(f"{e} from {src}" for src, e in untaken)
        return f"taken {total}× (never {missed})", ', color="#e67700", fontcolor="#e67700"'
    return f"taken {total}×", ", penwidth=2"


def _graph_header(name: str, title: list[str], rankdir: Rankdir, compound: bool) -> list[str]:
    label = "\\n".join(part.replace("\\", "\\\\").replace('"', '\\"') for line in title for part in _wrap(line, 100))
    return [
        f"digraph {_q(name)} {{",
        f'  graph [rankdir={rankdir}, fontname="Helvetica", fontsize=12, nodesep=0.4, ranksep=0.5, labelloc=t,'
        + (" compound=true," if compound else ""),
        f'         label="{label}"];',
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11, fillcolor="#ffffff"];',
        '  edge [fontname="Helvetica", fontsize=9, color="#495057", fontcolor="#212529"];',
    ]


@dataclass(frozen=True)
class _Drawn:
    """A machine's DOT statements, and where its states are: ``role/`` before each name inside a composition."""

    lines: list[str]
    prefix: str
    clusters: list[tuple[str, list[str]]]

    def node(self, state: str) -> str:
        return _q(self.prefix + state)


def _dot_machine(
    spec: Spec,
    *,
    prefix: str = "",
    indent: str = "  ",
    ignores: bool = False,
    coverage: Coverage | None = None,
    inbox: frozenset[str] = frozenset(),
) -> _Drawn:
    """The statements that draw one machine; ids start with ``prefix`` so several machines share a graph."""
    groups, arrows = _layout(spec, inbox)
    clusters = _clusters(spec)
    ignored = _ignored(spec) if ignores else {}
    drawn = _Drawn([], prefix, clusters)
    lines, node = drawn.lines, drawn.node
    lines.append(f'{indent}{node("__begin")} [shape=circle, style=filled, fillcolor="#212529", label="", width=0.18];')
    for st in spec.states.values():
        rows = [f"<b>{_h(st.name)}</b>"]
        if st.holds:
            rows.append(f'<font point-size="9">holds: {_h(_units(st.holds))}</font>')
        if st.waits_local:
            rows.append('<font point-size="9" color="#6c757d">waits: local</font>')
        if st.timeout is not None:
            deadline = f"{st.timeout.fire} {_after(spec, st.timeout)}"
            rows.append(f'<font point-size="9" color="{DEADLINE}">deadline: {_h(deadline)}</font>')
        loose = [p for p in spec.phases_of(st.name) if not any(p == c for c, _m in clusters)]
        if loose:
            rows.append(f'<font point-size="9" color="{DEADLINE}">in phase: {_h(", ".join(loose))}</font>')
        if st.is_final:
            rows.append(f'<font point-size="9" color="#6c757d">final: {st.final}</font>')
        if st.name in ignored:
            for part in _wrap("ignores: " + ", ".join(ignored[st.name])):
                rows.append(f'<font point-size="8" color="#adb5bd">{_h(part)}</font>')
        fill = COLOURS[st.final or "live"]
        extra = ", peripheries=2" if st.is_final else ""
        extra += ", penwidth=2" if st.initial else ""
        lines.append(f'{indent}{node(st.name)} [label=<{"<br/>".join(rows)}>, fillcolor="{fill}"{extra}];')
    for i, note in enumerate(_owns(spec)):
        lines.append(
            f'{indent}{node(f"__owns{i}")} [shape=note, style=filled, fillcolor="#fff9db", fontsize=9, label="{_note(note)}"];'
        )
    outgoing = _outgoing(spec)
    if outgoing:
        lines.append(
            f'{indent}{node("__outgoing")} [shape=note, style=filled, fillcolor="#e7f5ff", color="{MESSAGE}", '
            f'fontcolor="{MESSAGE}", fontsize=9, label="{_note(outgoing)}"];'
        )
    for name, members in clusters:
        timeout = spec.phases[name].timeout
        label = f"phase {name}: {timeout.fire} {_after(spec, timeout)}, from entering it"
        lines.append(f"{indent}subgraph {_q('cluster_' + prefix + name)} {{")
        lines.append(
            f'{indent}  label={_q(label)}; style="dashed,rounded"; color="{DEADLINE}"; fontcolor="{DEADLINE}"; fontsize=9;'
        )
        lines.append(f"{indent}  " + " ".join(node(m) + ";" for m in members))
        lines.append(f"{indent}}}")
    for gid, members in groups:
        label = "\\n".join(part.replace('"', '\\"') for part in _wrap(_group_label(spec, members)))
        lines.append(
            f'{indent}{node(gid)} [label="{label}", shape=box, style="dashed,rounded,filled", fillcolor="{COLOURS["group"]}", fontsize=9, color="#868e96"];'
        )
    initial = next((s.name for s in spec.states.values() if s.initial), None)
    if initial is not None:
        taken = spec.acquires(None, initial)
        begin = "begin" + (f"\\ntakes {', '.join(taken)}" if taken else "")
        lines.append(f'{indent}{node("__begin")} -> {node(initial)} [label="{begin}"];')
    for a in arrows:
        style = ""
        if a.timeout:
            style = f', style=dashed, color="{DEADLINE}", fontcolor="{DEADLINE}"'
        elif a.remote:
            style = f', color="{MESSAGE}"'
        parts = a.lines()
        if coverage is not None:
            times, covered_style = _covered(a, coverage)
            parts.append((times, "text"))
            style = covered_style if covered_style == UNTAKEN else style + covered_style
        label = "<br/>".join(
            _h(text) if kind == "text" else f'<font color="{MESSAGE}">{_h(text)}</font>' for text, kind in parts
        )
        if a.cluster:
            style += f", ltail={_q('cluster_' + prefix + a.cluster.removeprefix('cluster_'))}"
        lines.append(f"{indent}{node(a.source)} -> {node(a.target)} [label=<{label}>{style}];")
    return drawn


def to_dot(spec: Spec, *, ignores: bool = False, coverage: Coverage | None = None, rankdir: Rankdir = "TB") -> str:
    """The spec as DOT. With ``coverage``, every edge says how often a test took it; untaken ones are grey and dotted."""
    title = [spec.name + " — " + spec.doc if spec.doc else spec.name]
    drawn = _dot_machine(spec, ignores=ignores, coverage=coverage)
    if coverage is not None:
        _groups, arrows = _layout(spec, frozenset())
        pairs = [p for a in arrows for p in a.pairs]
        exercised = sum(coverage.get(p, 0) > 0 for p in pairs)
        title.append(
            f"transition coverage: {exercised} of {len(pairs)} edges taken (grey dotted: never; orange: from some sources only)"
        )
    lines = _graph_header(spec.name, title, rankdir, bool(drawn.clusters))
    return "\n".join([*lines, *drawn.lines, "}"]) + "\n"


def _role_title(role: Role) -> list[str]:
    head = f"{role.name}: {role.spec.name}" + (f" ×{role.ranks} ranks" if role.ranks > 1 else "")
    lines = [head]
    if role.doc:
        lines += _wrap(role.doc, 60)
    if role.crash:
        lines.append("may crash, " + ("restarts knowing no old request" if role.restart else "stays down"))
    if role.environment:
        lines.append("from outside: " + ", ".join(role.environment))
    return lines


def _inboxes(system: System) -> dict[str, frozenset[str]]:
    """Per role, the events messages of the composition deliver to it."""
    return {name: frozenset(m.event for m in system.inbox(name).values()) for name in system.roles}


def _message_ends(system: System, m: Message) -> tuple[str | None, str | None]:
    """The sending state and the receiving state of a message, where each is one state (else None: the role)."""
    sender = system.roles[m.sender].spec
    sending = {
        s
        for t in sender.transitions
        if any(x.message == m.name and x.to == m.receiver for x in t.sends)
        for s in sender.expand(t.sources)
        if s in sender.states
    }
    receiver = system.roles[m.receiver].spec
    receiving = {e.source for e in receiver.edges() if e.event == m.event and e.source in receiver.states}
    return _one(sending), _one(receiving)


def _one(states: set[str]) -> str | None:
    return next(iter(states)) if len(states) == 1 else None


def _message_label(m: Message, system: System) -> list[str]:
    lines = [f"✉ {m.name}"]
    senders, receivers = system.roles[m.sender].ranks, system.roles[m.receiver].ranks
    if receivers > 1:
        lines.append(f"to each of {receivers} {m.receiver} ranks")
    if senders > 1 and m.count:
        lines.append(f"taken once {'all' if m.count < 0 else m.count} of {senders} {m.sender} ranks sent it")
    if m.reply_if_finished:
        lines.append(f"a finished {m.receiver} answers ✉ {m.reply_if_finished}")
    return lines


def _system_title(system: System) -> list[str]:
    c = system.channel
    may = [w for w, on in (("lose", c.loss), ("duplicate", c.duplicate), ("reorder", c.reorder)) if on]
    channel = (
        f"channel: may {', '.join(may)}; holds {c.capacity}"
        if may
        else f"channel: reliable, in order; holds {c.capacity}"
    )
    title = [system.name + " — " + system.doc if system.doc else system.name, channel]
    title += [f"relation: {r.text}" for r in system.relations]
    return title


def system_to_dot(system: System, *, ignores: bool = False, rankdir: Rankdir = "TB") -> str:
    """A composition as DOT: each role a cluster around its machine, each message an edge from its sender to its
    receiver (from the state that sends it to the state that takes it, where each is one; else from the role)."""
    inboxes = _inboxes(system)
    lines = _graph_header(system.name, _system_title(system), rankdir, compound=True)
    drawn: dict[str, _Drawn] = {}
    for name, role in system.roles.items():
        d = _dot_machine(role.spec, prefix=f"{name}/", indent="    ", ignores=ignores, inbox=inboxes[name])
        drawn[name] = d
        lines.append(f"  subgraph {_q('cluster_' + name)} {{")
        lines.append(
            f'    label="{_note(_role_title(role))}"; labeljust=l; style="rounded"; color="#868e96"; fontsize=11;'
        )
        lines += d.lines
        lines.append("  }")
    wires: dict[tuple[str, str, str], list[str]] = {}  # messages with the same two ends share one edge
    for m in system.messages.values():
        sending, receiving = _message_ends(system, m)
        tail = drawn[m.sender].node(sending or system.roles[m.sender].spec.initial.name)
        head = drawn[m.receiver].node(receiving or system.roles[m.receiver].spec.initial.name)
        ends = ("" if sending else f", ltail={_q('cluster_' + m.sender)}") + (
            "" if receiving else f", lhead={_q('cluster_' + m.receiver)}"
        )
        wires.setdefault((tail, head, ends), []).extend(_message_label(m, system))
    for (tail, head, ends), label in wires.items():
        lines.append(
            f'  {tail} -> {head} [label=<{"<br/>".join(map(_h, label))}>, color="{MESSAGE}", fontcolor="{MESSAGE}", '
            f"style=bold, arrowhead=vee{ends}];"
        )
    for parent, child, label in _ownership(system):
        tail = drawn[parent].node(system.roles[parent].spec.initial.name)
        head = drawn[child].node(system.roles[child].spec.initial.name)
        lines.append(
            f'  {tail} -> {head} [label=<{"<br/>".join(map(_h, label))}>, color="{OWNER}", fontcolor="{OWNER}", '
            f"style=dashed, arrowtail=diamond, dir=both, arrowhead=none, minlen=2, "
            f"ltail={_q('cluster_' + parent)}, lhead={_q('cluster_' + child)}];"
        )
    return "\n".join([*lines, "}"]) + "\n"


def _ownership(system: System) -> list[tuple[str, str, list[str]]]:
    """``(parent role, child role, label)`` per role whose spec owns the machine another role runs (``owns:``)."""
    out = []
    for parent, role in system.roles.items():
        for owned in role.spec.owns.values():
            for child, other in system.roles.items():
                if other.spec.name == owned.machine and child != parent:
                    passed = f"passes on {', '.join(owned.forward)}" if owned.forward else ""
                    heard = f"hears {owned.ended}" + (f", {owned.failed}" if owned.failed else "")
                    out.append((parent, child, [f"owns {owned.name} (by {owned.by})", heard, *([passed] if passed else [])]))
    return out


# -- Mermaid -----------------------------------------------------------------


def _m(text: str) -> str:
    """Mermaid labels cannot hold ':' or ';' safely."""
    return text.replace(":", "꞉").replace(";", ",")


def _mermaid_machine(
    spec: Spec, *, prefix: str = "", indent: str = "    ", ignores: bool = False, inbox: frozenset[str] = frozenset()
) -> tuple[list[str], list[tuple[str, str]]]:
    """The lines that draw one machine, and its (id, class) pairs; ids start with ``prefix``."""
    groups, arrows = _layout(spec, inbox)
    ignored = _ignored(spec) if ignores else {}
    lines = []
    for st in spec.states.values():
        notes = []
        if st.holds:
            notes.append("holds " + _units(st.holds))
        if st.waits_local:
            notes.append("waits local")
        if st.timeout is not None:
            notes.append(f"deadline {st.timeout.fire} {_after(spec, st.timeout)}")
        for p in spec.phases_of(st.name):
            timeout = spec.phases[p].timeout
            notes.append(f"phase {p} ({timeout.fire} {_after(spec, timeout)})")
        if st.name in ignored:
            notes.append("ignores " + ", ".join(ignored[st.name]))
        if notes:
            lines.append(f"{indent}{prefix}{st.name} : {_m(st.name)}<br/>{_m('<br/>'.join(notes))}")
        else:
            lines.append(f"{indent}{prefix}{st.name}" + (f" : {_m(st.name)}" if prefix else ""))
    for gid, members in groups:
        lines.append(f'{indent}state "{_m(_group_label(spec, members))}" as {prefix}{gid}')
    initial = next((s.name for s in spec.states.values() if s.initial), None)
    if initial is not None:
        lines.append(f"{indent}[*] --> {prefix}{initial} : begin")
    for a in arrows:
        lines.append(
            f"{indent}{prefix}{a.source} --> {prefix}{a.target} : {_m('<br/>'.join(t for t, _k in a.lines(wrap=False)))}"
        )
    if initial is not None:
        for note in [*_owns(spec), *([_outgoing(spec)] if spec.outgoing else [])]:
            lines += [
                f"{indent}note left of {prefix}{initial}",
                *(f"{indent}    {_m(n)}" for n in note),
                f"{indent}end note",
            ]
    for st in spec.states.values():
        if st.is_final:
            lines.append(f"{indent}{prefix}{st.name} --> [*]")
    classes: list[tuple[str, str]] = [(prefix + n, s.final) for n, s in spec.states.items() if s.final is not None]
    classes += [(prefix + gid, "group") for gid, _members in groups]
    return lines, classes


def _mermaid_classes(classes: list[tuple[str, str]]) -> list[str]:
    lines = [
        f"    classDef success fill:{COLOURS['success']},stroke:#2b8a3e",
        f"    classDef failure fill:{COLOURS['failure']},stroke:#c92a2a",
        f"    classDef group fill:{COLOURS['group']},stroke-dasharray:4 3",
    ]
    for kind in ("success", "failure", "group"):
        names = [n for n, k in classes if k == kind]
        if names:
            lines.append(f"    class {','.join(names)} {kind}")
    return lines


def _mermaid_head(title: str, rankdir: Rankdir) -> list[str]:
    return ["---", f"title: {_m(title)}", "---", "stateDiagram-v2", f"    direction {rankdir}"]


def to_mermaid(spec: Spec, *, ignores: bool = False, rankdir: Rankdir = "TB") -> str:
    body, classes = _mermaid_machine(spec, ignores=ignores)
    return "\n".join([*_mermaid_head(spec.name, rankdir), *body, *_mermaid_classes(classes)]) + "\n"


def system_to_mermaid(system: System, *, ignores: bool = False, rankdir: Rankdir = "TB") -> str:
    """A composition as Mermaid: each role a composite state around its machine, messages from role to role."""
    inboxes = _inboxes(system)
    lines = _mermaid_head(system.name, rankdir)
    classes: list[tuple[str, str]] = []
    for name, role in system.roles.items():
        body, more = _mermaid_machine(
            role.spec, prefix=f"{name}__", indent="        ", ignores=ignores, inbox=inboxes[name]
        )
        label = f"{name}꞉ {role.spec.name}" + (f" ×{role.ranks} ranks" if role.ranks > 1 else "")
        lines += [f'    state "{_m(label)}" as {name} {{', *body, "    }"]
        classes += more
    wires: dict[tuple[str, str], list[str]] = {}  # messages between the same two roles share one edge
    for m in system.messages.values():
        wires.setdefault((m.sender, m.receiver), []).extend(_message_label(m, system))
    lines += [f"    {sender} --> {receiver} : {_m('<br/>'.join(label))}" for (sender, receiver), label in wires.items()]
    lines += [f"    {parent} --> {child} : {_m('<br/>'.join(label))}" for parent, child, label in _ownership(system)]
    return "\n".join([*lines, *_mermaid_classes(classes)]) + "\n"


# -- Graphviz and the formats ------------------------------------------------


@cache
def graphviz_formats() -> tuple[str, ...]:
    """The output formats this machine's Graphviz ``dot`` writes (what ``dot -T?`` lists), files only."""
    try:
        done = subprocess.run(["dot", "-T?"], capture_output=True, check=False)
    except FileNotFoundError:
        raise OSError(NO_GRAPHVIZ) from None
    listed = done.stderr.decode(errors="replace").partition("Use one of:")[2].split()
    return tuple(f for f in listed if f not in INTERACTIVE)


def format_of(path: Path) -> str | None:
    """The format an output file's name asks for: ``.mmd`` Mermaid, ``.dot``/``.gv`` DOT, ``.png`` png, ...;
    None for a name without an extension."""
    ext = path.suffix.lower()
    return EXTENSIONS.get(ext, ext[1:] or None)


def _graphviz(source: str, fmt: str, name: str) -> bytes:
    try:
        done = subprocess.run(["dot", f"-T{fmt}"], input=source.encode(), capture_output=True, check=False)
    except FileNotFoundError:
        raise OSError(NO_GRAPHVIZ) from None
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
        raise OSError(f"graphviz 'dot' could not draw {name!r}: {reason}; use -f dot / -f mermaid instead")
    return done.stdout


def to_svg(spec: Spec, *, ignores: bool = False, coverage: Coverage | None = None, rankdir: Rankdir = "TB") -> bytes:
    """SVG from Graphviz's ``dot`` program (Debian package ``graphviz``); ``coverage`` as for :func:`to_dot`.

    ``dot`` is run directly, so the text formats need nothing beyond kvfsm's core install.
    """
    return _graphviz(to_dot(spec, ignores=ignores, coverage=coverage, rankdir=rankdir), "svg", spec.name)


def check_format(fmt: str, named_by: str = "") -> None:
    """Raise :class:`~kvfsm.KvfsmError` unless ``fmt`` is DOT, Mermaid or a format Graphviz writes here;
    ``named_by`` says where the name came from (an output file's extension), for the message."""
    if fmt in TEXT_FORMATS or fmt == "svg":
        return
    known = graphviz_formats()
    if fmt not in known:
        where = f" (from {named_by})" if named_by else ""
        raise KvfsmError(
            f"unknown diagram format {fmt!r}{where}: Graphviz here writes {', '.join(known)}; kvfsm itself writes "
            "dot (the source) and mermaid. Name one with -f, or give -o a file name ending in one (x.png, x.mmd)"
        )


def render(drawing: Spec | System, fmt: str, *, ignores: bool = False, rankdir: Rankdir = "TB") -> bytes:
    """A machine spec or a composition in ``fmt``: ``dot`` (the source), ``mermaid``, or any Graphviz format."""
    check_format(fmt)
    if fmt == "mermaid":
        mermaid = (
            system_to_mermaid(drawing, ignores=ignores, rankdir=rankdir)
            if isinstance(drawing, System)
            else (to_mermaid(drawing, ignores=ignores, rankdir=rankdir))
        )
        return mermaid.encode()
    dot = (
        system_to_dot(drawing, ignores=ignores, rankdir=rankdir)
        if isinstance(drawing, System)
        else (to_dot(drawing, ignores=ignores, rankdir=rankdir))
    )
    return dot.encode() if fmt == "dot" else _graphviz(dot, fmt, drawing.name)
