"""Draw a spec as Graphviz DOT/SVG or Mermaid, deterministically, for review in diffs.

What the picture must say at a glance: where a request starts, which states
are success or failure ends, what each state holds, which edges run actions or
release resources, and which edges are deadlines. A transition from many
states (``"*"`` or a long source list) is drawn once, from a group node, so
the diagram never becomes a hairball.
"""

from __future__ import annotations

import html
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ..spec.model import Spec, State, Transition

GROUP_AT = 3
"""A transition with this many sources or more is drawn from one group node."""

COLOURS = {"success": "#d8f3dc", "failure": "#fde2e4", "live": "#ffffff", "group": "#f1f3f5"}


@dataclass(frozen=True)
class _Arrow:
    source: str
    target: str
    label: list[str]
    timeout: bool
    pairs: tuple[tuple[str, str], ...] = ()
    """The (source state, event) edges of the spec this arrow draws."""
    cluster: str = ""
    """The phase cluster this arrow leaves from as a whole (its deadline's event), drawn from the cluster's edge."""


def _effects(spec: Spec, source: str | None, target: str, many: bool) -> list[str]:
    """What an edge does to resources, as short lines ('frees a, b' / 'takes c')."""
    lines = []
    taken = spec.acquires(source, target)
    if taken:
        lines.append("takes " + ", ".join(taken))
    if many:
        if any(spec.holds(s) for s in spec.states if s != target):
            lines.append("frees what the state holds")
    elif source is not None:
        freed = spec.releases(source, target)
        if freed:
            lines.append("frees " + ", ".join(freed))
    return lines


def _title(spec: Spec, t: Transition) -> str:
    """``event ⟨id space⟩ ×K / do()``: the id a message of the event names, when it is not the key, who sends it,
    how many distinct senders it waits for, and whether it may come before its id (early)."""
    event = t.event
    if spec.routed_by(event) != spec.key:
        event = f"{event} ⟨{spec.routed_by(event)}⟩"
    if spec.is_remote(t.event):
        event = f"{event} (remote)"
    if t.count is not None:
        event = f"{event} ×{t.count} senders"
    decl = spec.event_decls.get(t.event)
    if decl is not None and decl.early is not None:
        event = f"{event} (early ≤{decl.early.within})"
    for owned in spec.owns.values():
        if t.event == owned.ended:
            event = f"{event} (no {owned.name} live)"
        elif t.event == owned.failed:
            event = f"{event} (one of {owned.name} failed)"
        elif t.event in owned.forward:
            event = f"{event} (→ {owned.name})"
    text = event if t.do is None else f"{event} / {t.do}()"
    return f"{text}  (on_error)" if t.event == spec.on_error else text


def _sends(t: Transition) -> list[str]:
    """A composition's messages leave on the edge that sends them ('sends abort_req → prefill')."""
    return [f"sends {s.message} → {s.to}" for s in t.sends]


def _is_timeout(spec: Spec, source: str, event: str) -> bool:
    return source in spec.states and spec.fires_on_timeout(source, event)


def _seconds(after: str | float) -> str:
    return f"after {after}" if isinstance(after, str) else f"after {after:g} s"


def _after(spec: Spec, state: State) -> str:
    assert state.timeout is not None
    return _seconds(state.timeout.after)


def _deadline(spec: Spec, source: str, event: str) -> str:
    """What an edge's deadline is: 'after t' for the state's own, 'phase p: after t' for a phase's."""
    own = spec.states[source].timeout
    if own is not None and own.fire == event:
        return _seconds(own.after)
    phase = next(p for p in spec.phases_of(source) if spec.phases[p].timeout.fire == event)
    return f"phase {phase}: {_seconds(spec.phases[phase].timeout.after)}"


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


def _layout(spec: Spec) -> tuple[list[tuple[str, list[str]]], list[_Arrow]]:
    """Group nodes (id, member states) and arrows, in declaration order."""
    groups: list[tuple[str, list[str]]] = []
    arrows: list[_Arrow] = []
    clusters = _clusters(spec)
    for i, t in enumerate(spec.transitions):
        sources = [s for s in spec.expand(t.sources) if s in spec.states]
        if t.target not in spec.states:
            continue
        whole = next((c for c, members in clusters if members == sources), None)
        if whole is not None and spec.phases[whole].timeout.fire == t.event:  # the phase's deadline, from it all
            same = len({spec.releases(s, t.target) for s in sources}) == 1
            effects = _effects(spec, sources[0] if same else None, t.target, many=not same)
            label = [_deadline(spec, sources[0], t.event), _title(spec, t), *effects]
            pairs = tuple((s, t.event) for s in sources)
            arrows.append(_Arrow(sources[0], t.target, [*label, *_sends(t)], True, pairs, f"cluster_{whole}"))
            continue
        if len(sources) >= GROUP_AT:
            gid = f"group_{i}"
            groups.append((gid, sources))
            label = [_title(spec, t), *_effects(spec, None, t.target, many=True), *_sends(t)]
            arrows.append(_Arrow(gid, t.target, label, False, tuple((s, t.event) for s in sources)))
            continue
        for s in sources:
            timed = _is_timeout(spec, s, t.event)
            label = [_title(spec, t), *_effects(spec, s, t.target, many=False), *_sends(t)]
            if timed:
                label.insert(0, _deadline(spec, s, t.event))
            arrows.append(_Arrow(s, t.target, label, timed, ((s, t.event),)))
    return groups, arrows


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


# -- DOT -------------------------------------------------------------------


def _owns(spec: Spec) -> list[list[str]]:
    """Per ``owns:`` entry, the lines of a note drawn beside the parent: its children and what it hears of them."""
    notes = []
    for o in spec.owns.values():
        heard = f"ended → {o.ended}" + (f", failed → {o.failed}" if o.failed else "")
        passed = [f"passes on {', '.join(o.forward)}"] if o.forward else []
        notes.append([f"owns {o.name}: {o.machine}", f"each begun with its {o.by}", heard, *passed])
    return notes


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
        missed = ", ".join(src for (src, _e), n in zip(a.pairs, counts, strict=True) if n == 0)
        return f"taken {total}× (never from {missed})", ', color="#e67700", fontcolor="#e67700"'
    return f"taken {total}×", ", penwidth=2"


def to_dot(spec: Spec, *, ignores: bool = False, coverage: Coverage | None = None) -> str:
    """The spec as DOT. With ``coverage``, every edge says how often a test took it; untaken ones are grey and dotted."""
    groups, arrows = _layout(spec)
    clusters = _clusters(spec)
    ignored = _ignored(spec) if ignores else {}
    title = spec.name + " — " + spec.doc if spec.doc else spec.name
    if coverage is not None:
        pairs = [p for a in arrows for p in a.pairs]
        exercised = sum(coverage.get(p, 0) > 0 for p in pairs)
        title += f"\ntransition coverage: {exercised} of {len(pairs)} edges taken (grey dotted: never; orange: from some sources only)"
    lines = [
        f"digraph {_q(spec.name)} {{",
        '  graph [rankdir=LR, fontname="Helvetica", fontsize=12, nodesep=0.5, ranksep=0.9, labelloc=t,'
        + (" compound=true," if clusters else ""),
        f"         label={_q(title)}];",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11, fillcolor="#ffffff"];',
        '  edge [fontname="Helvetica", fontsize=9, color="#495057", fontcolor="#212529"];',
        '  __begin [shape=circle, style=filled, fillcolor="#212529", label="", width=0.18];',
    ]
    for st in spec.states.values():
        rows = [f"<b>{html.escape(st.name)}</b>"]
        if st.holds:
            rows.append(f'<font point-size="9">holds: {html.escape(", ".join(st.holds))}</font>')
        if st.waits_local:
            rows.append('<font point-size="9" color="#6c757d">waits: local</font>')
        if st.timeout is not None:
            rows.append(f'<font point-size="9" color="#6c757d">deadline: {html.escape(_after(spec, st))}</font>')
        loose = [p for p in spec.phases_of(st.name) if not any(p == c for c, _m in clusters)]
        if loose:
            rows.append(f'<font point-size="9" color="#c92a2a">in phase: {html.escape(", ".join(loose))}</font>')
        if st.is_final:
            rows.append(f'<font point-size="9" color="#6c757d">final: {st.final}</font>')
        if st.name in ignored:
            rows.append(
                f'<font point-size="8" color="#adb5bd">ignores: {html.escape(", ".join(ignored[st.name]))}</font>'
            )
        fill = COLOURS[st.final or "live"]
        extra = ", peripheries=2" if st.is_final else ""
        extra += ", penwidth=2" if st.initial else ""
        lines.append(f'  {_q(st.name)} [label=<{"<br/>".join(rows)}>, fillcolor="{fill}"{extra}];')
    for i, note in enumerate(_owns(spec)):
        label = "\\l".join(n.replace("\\", "\\\\").replace('"', '\\"') for n in note) + "\\l"
        lines.append(f'  __owns{i} [shape=note, style=filled, fillcolor="#fff9db", fontsize=9, label="{label}"];')
    for name, members in clusters:
        timeout = spec.phases[name].timeout
        label = f"phase {name}: {_seconds(timeout.after)} → {timeout.fire}, from entering it"
        lines.append(f"  subgraph {_q('cluster_' + name)} {{")
        lines.append(
            f'    label={_q(label)}; style="dashed,rounded"; color="#c92a2a"; fontcolor="#c92a2a"; fontsize=9;'
        )
        lines.append("    " + " ".join(_q(m) + ";" for m in members))
        lines.append("  }")
    for gid, members in groups:
        lines.append(
            f'  {gid} [label={_q(_group_label(spec, members))}, shape=box, style="dashed,rounded,filled", fillcolor="{COLOURS["group"]}", fontsize=9, color="#868e96"];'
        )
    initial = next((s.name for s in spec.states.values() if s.initial), None)
    if initial is not None:
        taken = spec.acquires(None, initial)
        begin = "begin" + (f"\\ntakes {', '.join(taken)}" if taken else "")
        lines.append(f'  __begin -> {_q(initial)} [label="{begin}"];')
    for a in arrows:
        style = ', style=dashed, color="#c92a2a", fontcolor="#c92a2a"' if a.timeout else ""
        parts = a.label
        if coverage is not None:
            times, covered_style = _covered(a, coverage)
            parts = [*parts, times]
            style = covered_style if covered_style == UNTAKEN else style + covered_style
        label = "\\n".join(part.replace('"', '\\"') for part in parts)
        if a.cluster:
            style += f", ltail={_q(a.cluster)}"
        lines.append(f'  {_q(a.source)} -> {_q(a.target)} [label="{label}"{style}];')
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- Mermaid -----------------------------------------------------------------


def _m(text: str) -> str:
    """Mermaid labels cannot hold ':' or ';' safely."""
    return text.replace(":", "꞉").replace(";", ",")


def to_mermaid(spec: Spec, *, ignores: bool = False) -> str:
    groups, arrows = _layout(spec)
    ignored = _ignored(spec) if ignores else {}
    lines = ["---", f"title: {_m(spec.name)}", "---", "stateDiagram-v2", "    direction LR"]
    for st in spec.states.values():
        notes = []
        if st.holds:
            notes.append("holds " + ", ".join(st.holds))
        if st.waits_local:
            notes.append("waits local")
        if st.timeout is not None:
            notes.append("deadline " + _after(spec, st))
        for p in spec.phases_of(st.name):
            notes.append(f"phase {p} ({_seconds(spec.phases[p].timeout.after)} → {spec.phases[p].timeout.fire})")
        if st.name in ignored:
            notes.append("ignores " + ", ".join(ignored[st.name]))
        lines.append(f"    {st.name}" + (f" : {_m(st.name)}<br/>{_m('<br/>'.join(notes))}" if notes else ""))
    for gid, members in groups:
        lines.append(f'    state "{_m(_group_label(spec, members))}" as {gid}')
    initial = next((s.name for s in spec.states.values() if s.initial), None)
    if initial is not None:
        lines.append(f"    [*] --> {initial} : begin")
    for a in arrows:
        lines.append(f"    {a.source} --> {a.target} : {_m('<br/>'.join(a.label))}")
    if initial is not None:
        for note in _owns(spec):
            lines += [f"    note left of {initial}", *(f"        {_m(n)}" for n in note), "    end note"]
    for st in spec.states.values():
        if st.is_final:
            lines.append(f"    {st.name} --> [*]")
    lines.append(f"    classDef success fill:{COLOURS['success']},stroke:#2b8a3e")
    lines.append(f"    classDef failure fill:{COLOURS['failure']},stroke:#c92a2a")
    lines.append(f"    classDef group fill:{COLOURS['group']},stroke-dasharray:4 3")
    for kind in ("success", "failure"):
        names = [n for n, s in spec.states.items() if s.final == kind]
        if names:
            lines.append(f"    class {','.join(names)} {kind}")
    if groups:
        lines.append(f"    class {','.join(g for g, _m2 in groups)} group")
    return "\n".join(lines) + "\n"


def to_svg(spec: Spec, *, ignores: bool = False, coverage: Coverage | None = None) -> bytes:
    """SVG from Graphviz's ``dot`` program (Debian package ``graphviz``); ``coverage`` as for :func:`to_dot`.

    ``dot`` is run directly, so the text formats need nothing beyond kvfsm's core install.
    """
    source = to_dot(spec, ignores=ignores, coverage=coverage).encode()
    try:
        done = subprocess.run(["dot", "-Tsvg"], input=source, capture_output=True, check=False)
    except FileNotFoundError:
        raise OSError(
            "graphviz 'dot' is not installed; install the Debian package 'graphviz' (or use -f dot / -f mermaid)"
        ) from None
    if done.returncode != 0:
        reason = done.stderr.decode(errors="replace").strip() or f"exit status {done.returncode}"
        raise OSError(f"graphviz 'dot' could not draw {spec.name!r}: {reason}; use -f dot / -f mermaid instead")
    return done.stdout


def render(spec: Spec, fmt: str, *, ignores: bool = False) -> bytes:
    if fmt == "svg":
        return to_svg(spec, ignores=ignores)
    if fmt == "dot":
        return to_dot(spec, ignores=ignores).encode()
    if fmt == "mermaid":
        return to_mermaid(spec, ignores=ignores).encode()
    raise ValueError(f"unknown diagram format {fmt!r}; use svg, dot or mermaid")
