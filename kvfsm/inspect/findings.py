"""``kvfsm check`` findings pinned to what they name in the diagram: states, edges, a role's cluster.

A finding says ``path:line``; the spec model knows the line each state and
transition was written on, so a finding on a state's line is pinned to that
state's node, one on a transition's line to its edges, one on a role's line
of a system file to the role's cluster. A finding that names a state in its
message (``state 'deferred' has no timeout``) is pinned there too. What
matches nothing is listed unpinned, never dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..spec import Finding, Spec, System

NAMED_STATE = re.compile(r"\bstate '([^']+)'")


@dataclass(frozen=True)
class Pinned:
    """A finding and where the page marks it: Graphviz node names, ``(tail, head)`` edges, cluster names."""

    finding: Finding
    nodes: tuple[str, ...] = ()
    edges: tuple[tuple[str, str], ...] = ()
    clusters: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The finding as the page's script reads it."""
        return {
            **self.finding.as_dict(),
            "nodes": list(self.nodes),
            "edges": [list(e) for e in self.edges],
            "clusters": list(self.clusters),
        }


def _same(a: str, b: str) -> bool:
    """Whether two paths name one file (findings and specs may spell a path differently)."""
    if a == b:
        return True
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _in_spec(f: Finding, spec: Spec, prefix: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The nodes and edges of one machine (drawn with ``prefix`` before each state) that ``f`` names."""
    nodes: list[str] = []
    edges: list[tuple[str, str]] = []
    if not _same(f.path, spec.path):
        return nodes, edges
    for name, state in spec.states.items():
        if state.loc.line == f.line or (state.timeout is not None and state.timeout.loc.line == f.line):
            nodes.append(prefix + name)
    for t in spec.transitions:
        if t.loc.line == f.line and t.target in spec.states:
            edges += [(prefix + s, prefix + t.target) for s in spec.expand(t.sources) if s in spec.states]
    for name in NAMED_STATE.findall(f.message):
        if name in spec.states and prefix + name not in nodes:
            nodes.append(prefix + name)
    return nodes, edges


def pin(findings: list[Finding], drawing: Spec | System) -> list[Pinned]:
    """Each finding with the nodes, edges and clusters it names in ``drawing``'s diagram (empty: unpinned)."""
    out = []
    for f in findings:
        nodes: list[str] = []
        edges: list[tuple[str, str]] = []
        clusters: list[str] = []
        if isinstance(drawing, System):
            for name, role in drawing.roles.items():
                n, e = _in_spec(f, role.spec, f"{name}/")
                nodes += n
                edges += e
                if _same(f.path, drawing.path) and role.loc.line == f.line:
                    clusters.append(f"cluster_{name}")
        else:
            nodes, edges = _in_spec(f, drawing, "")
        out.append(Pinned(f, tuple(dict.fromkeys(nodes)), tuple(dict.fromkeys(edges)), tuple(clusters)))
    return out
