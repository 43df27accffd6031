"""The inspect page: its model (what the page shows, computed here) and the one self-contained HTML file.

Everything the page needs is in the file: the stylesheet and script from
``assets/`` (shipped in the wheel), the diagram as Graphviz SVG from
kvfsm's own generator, the sequence diagram, and the model as JSON for
the script, which only steps through it. Nothing is fetched when it opens;
only the live view asks its own server (the same origin) for ``/live``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from html import escape
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..errors import KvfsmError
from ..explore import Trace, check_trace, format_trace
from ..gen.diagram import render
from ..spec import Finding, Spec, System, check, is_system_file, read
from ..spec.system import read_system
from ..testing.trace_set import trace_set
from .findings import Pinned, pin
from .sequence import sequence_svg
from .steps import Snapshot, lanes, snapshots

ASSETS = files("kvfsm.inspect") / "assets"
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
"""``{{name}}`` in assets/page.html: replaced in one pass, so nothing inserted is read as a placeholder."""


class InspectError(KvfsmError):
    """An input the page cannot show (a trace of another system); a usage error (exit 2)."""


@dataclass(frozen=True)
class StateRow:
    """One state as the page lists it: its node in the diagram, what it holds, its deadline."""

    node: str
    role: str
    state: str
    holds: tuple[str, ...]
    deadline: str
    final: str | None


@dataclass(frozen=True)
class TraceView:
    """One run the page steps through: its snapshots, its lanes, and what it is there for.

    A counterexample (``--trace``) is one view; a trace set is one view per
    trace, so a reviewer can tell them apart by what each exercises; a
    ``kvfsm test`` story or a journal is one view of one machine, a lane per key.
    """

    snaps: tuple[Snapshot, ...]
    lanes: tuple[str, ...]
    request: str
    """The request whose instances the start row shows (a timeline's start shows none)."""
    prop: str
    """What was checked: a property, ``kvfsm test``, ``kvfsm replay``."""
    violation: str
    """What broke, in one line; empty for a trace that breaks nothing (a trace set's)."""
    system: str = ""
    loop: int | None = None
    """A lasso's cycle starts after this move."""
    channel: bool = True
    """Messages cross a channel lane (a composition's trace); one machine's timeline has none."""
    chart: str = ""
    """The run as its command printed it (``kvfsm explore``'s chart, the story), shown under the diagram."""
    chart_from: str = ""
    """The command that printed :attr:`chart`."""
    purpose: str = ""
    """What the trace was chosen for (a trace set's goal: ``decode: waiting --abort--> aborting``); empty for a
    counterexample, whose property says it."""
    covers: tuple[str, ...] = ()
    """Every trace-set item (role edge, message, ignored delivery) its moves exercise, in the order they do."""

    @classmethod
    def of(cls, trace: Trace, snaps: Sequence[Snapshot], purpose: str = "", covers: tuple[str, ...] = ()) -> TraceView:
        """The view of an explorer trace (a counterexample carries the chart ``kvfsm explore`` prints for it)."""
        chart = format_trace(trace) if trace.violation else ""  # explore prints counterexamples, not trace sets
        return cls(
            tuple(snaps), tuple(lanes(trace)), trace.request, trace.prop, trace.violation, trace.system, trace.loop,
            chart=chart, chart_from="kvfsm explore" if chart else "", purpose=purpose, covers=covers,
        )  # fmt: skip

    def label(self, number: int) -> str:
        """The chooser's short line: ``3 · 6 moves · decode: waiting --abort--> aborting (+5)``."""
        moves = len(self.snaps) - 1
        what = self.purpose or f"{self.prop}: {self.violation}"
        more = len([c for c in self.covers if c != self.purpose])
        return f"{number} · {moves} move{'s' if moves != 1 else ''} · {what}" + (f" (+{more})" if more else "")

    def as_dict(self, number: int) -> dict[str, Any]:
        """The run as the page's script reads it (JSON-ready)."""
        return {
            "label": self.label(number),
            "purpose": self.purpose,
            "covers": list(self.covers),
            "system": self.system,
            "property": self.prop,
            "violation": self.violation,
            "request": self.request,
            "loop": self.loop,
            "snapshots": [s.as_dict() for s in self.snaps],
        }


@dataclass
class Page:
    """What one inspect page shows; :func:`html` writes it."""

    title: str
    kind: str
    """``spec``, ``system`` or ``live``."""
    path: str = ""
    diagram: str = ""
    """The Graphviz SVG element (empty for the live view)."""
    states: list[StateRow] = field(default_factory=list)
    findings: list[Pinned] = field(default_factory=list)
    traces: list[TraceView] = field(default_factory=list)
    """The runs to step through: none, one counterexample, a trace set (one chosen at a time), a story or a log."""
    live: dict[str, Any] | None = None
    """For the live view: the ``urls`` watched and ``interval`` between polls."""

    def data(self) -> dict[str, Any]:
        """The JSON the page's script reads."""
        return {
            "kind": self.kind,
            "title": self.title,
            "findings": [p.as_dict() for p in self.findings],
            "traces": [v.as_dict(n) for n, v in enumerate(self.traces, start=1)],
            "live": self.live,
        }


def _deadline(spec: Spec, name: str) -> str:
    """``expire after transfer_timeout = 30 s``, plus each phase the state is in; empty without one."""

    def after(value: str | float) -> str:
        if isinstance(value, str):
            seconds = spec.params.get(value)
            return value if seconds is None else f"{value} = {seconds:g} s"
        return f"{value:g} s"

    parts = []
    timeout = spec.states[name].timeout
    if timeout is not None:
        parts.append(f"{timeout.fire} after {after(timeout.after)}")
    for p in spec.phases_of(name):
        phase = spec.phases[p].timeout
        parts.append(f"{phase.fire} after {after(phase.after)} (phase {p})")
    return "; ".join(parts)


def _rows(spec: Spec, role: str, prefix: str) -> list[StateRow]:
    return [StateRow(prefix + n, role, n, s.holds, _deadline(spec, n), s.final) for n, s in spec.states.items()]


def _svg(drawing: Spec | System) -> str:
    """The diagram as an inline ``<svg>`` element (Graphviz's XML prolog and doctype dropped)."""
    text = render(drawing, "svg").decode("utf-8")
    return text[text.index("<svg") :]


def build(path: str | Path, trace: Trace | None = None) -> Page:
    """The page of a spec or system file, with its findings and, for a system, ``trace`` stepped through."""
    return drawn(path, [(trace, "", ())] if trace is not None else [], "--trace")


def build_trace_set(path: str | Path) -> Page:
    """The page of a system with its trace set (what ``kvfsm test SYSTEM`` replays), one trace at a time.

    Raises :class:`~kvfsm.testing.trace_set.TraceSetError` for a system too
    large to build a trace set of, as ``kvfsm test`` does.
    """
    if not is_system_file(path):
        raise InspectError(f"--trace-set needs a system file, and {path} is a machine spec")
    chosen = trace_set(path)
    traces = [
        (t, goal.name, tuple(dict.fromkeys(c.name for s in t.moves for c in chosen.covered_by(s))))
        for goal, t in zip(chosen.goals, chosen.traces, strict=True)
    ]
    page = drawn(path, traces, "--trace-set")
    page.title = f"trace set of {chosen.system.name} ({len(traces)} traces)"
    return page


def drawn(path: str | Path, traces: list[tuple[Trace, str, tuple[str, ...]]], option: str) -> Page:
    """The page of a spec or system file, with its findings and, for a system, each trace stepped through (with
    what it was chosen for and covers; ``option`` names the option that gave the traces, for the refusals)."""
    findings: list[Finding] = check(path)
    drawing: Spec | System
    if is_system_file(path):
        drawing = read_system(path)[0]
        rows = [r for name, role in drawing.roles.items() for r in _rows(role.spec, name, f"{name}/")]
        kind = "system"
    else:
        if traces:
            raise InspectError(f"{option} needs the system file the trace ran on, and {path} is a machine spec")
        drawing = read(path)
        rows = _rows(drawing, "", "")
        kind = "spec"
    page = Page(f"{kind} {drawing.name}", kind, str(path), _svg(drawing), rows, pin(findings, drawing))
    for trace, purpose, covers in traces:
        assert isinstance(drawing, System)
        if trace.system != drawing.name:
            raise InspectError(
                f"the trace is of system {trace.system!r} ({trace.path}), not {drawing.name!r} ({path}); "
                f"inspect it with {trace.path}"
            )
        check_trace(trace, drawing)
        page.traces.append(TraceView.of(trace, snapshots(trace, frozenset(drawing.roles)), purpose, covers))
    if len(traces) == 1:
        page.title = f"{traces[0][0].prop} in {drawing.name}"
    return page


def live_page(urls: Sequence[str], interval: float) -> Page:
    """The page that polls its server's ``/live`` for the tracker endpoints at ``urls``, shown together."""
    return Page(f"live {', '.join(urls)}", "live", live={"urls": list(urls), "interval": interval})


def _asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def _state_table(page: Page) -> str:
    if not page.states:
        return ""
    pinned = {n for p in page.findings for n in p.nodes}
    rows = []
    for r in page.states:
        cls = ' class="has-finding"' if r.node in pinned else ""
        kind = f"final: {r.final}" if r.final else ""
        rows.append(
            f'<tr data-node="{escape(r.node)}"{cls}><td>{escape(r.role)}</td><td>{escape(r.state)}</td>'
            f"<td>{escape(', '.join(r.holds))}</td><td>{escape(r.deadline)}</td><td>{kind}</td></tr>"
        )
    return (
        '<table class="states"><thead><tr><th>role</th><th>state</th><th>holds</th><th>deadline</th><th></th>'
        f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
    )


def _finding_list(page: Page) -> str:
    if page.kind == "live":
        return ""
    if not page.findings:
        return '<p class="clean">kvfsm check: clean</p>'
    items = []
    for i, p in enumerate(page.findings):
        f = p.finding
        where = ", ".join([*p.nodes, *(f"{a} → {b}" for a, b in p.edges), *p.clusters]) or "not pinned to the diagram"
        fix = f'<div class="fix">fix: {escape(f.fix)}</div>' if f.fix else ""
        items.append(
            f'<li class="finding {f.severity}" data-finding="{i}"><b>{escape(f.severity)} {escape(f.code)}</b> '
            f'{escape(f.message)}<div class="where">{escape(f.path)}:{f.line} · pinned to: {escape(where)}</div>'
            f"{fix}</li>"
        )
    return f'<ol class="findings">{"".join(items)}</ol>'


def _json(data: dict[str, Any]) -> str:
    """JSON safe inside a ``<script>`` element: no ``<`` can close it."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _sequence(n: int, view: TraceView) -> str:
    """Run ``n``'s sequence diagram and the run as its command printed it, if it has a chart (``kvfsm explore``
    prints counterexamples, not a trace set's traces); all but the first start hidden (the script shows the chosen
    one)."""
    hidden = " hidden" if n else ""
    chart = ""
    if view.chart:
        chart = (
            f"<details><summary>as {escape(view.chart_from)} prints it</summary>"
            f'<pre class="chart">{escape(view.chart)}</pre></details>'
        )
    svg = sequence_svg(view.lanes, view.request, view.snaps, f"seq{n}", view.channel)
    return f'<div class="trace" data-trace="{n}"{hidden}>{svg}{chart}</div>'


def html(page: Page) -> str:
    """The page as one HTML document with every asset inlined."""
    sequence = "".join(_sequence(n, v) for n, v in enumerate(page.traces))
    parts = {
        "title": escape(page.title),
        "subtitle": escape(page.path),
        "css": _asset("inspect.css"),
        "js": _asset("inspect.js"),
        "data": _json(page.data()),
        "diagram": page.diagram,
        "states": _state_table(page),
        "findings": _finding_list(page),
        "sequence": sequence,
        "kind": page.kind,
    }
    return PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("page.html"))
