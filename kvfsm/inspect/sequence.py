"""A trace as a sequence diagram (SVG): a lane per role instance and one for the channel, a row per move.

Drawn here rather than by a library because it is a few boxes and arrows
whose rows the page must find by step number (``data-step``): the script
highlights the current row and a click on a row steps there.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from html import escape

from .steps import CHANNEL, Snapshot

LANE_W = 240
ROW_H = 66
HEAD_H = 40
TEXT_W = 36
"""Characters per line of a move's text inside its lane."""


def columns(lanes: Sequence[str], channel: bool = True) -> list[str]:
    """Lanes left to right: the first half of the instances, the channel, the rest (messages cross the middle); one
    machine's timeline has no channel."""
    if not channel:
        return list(lanes)
    half = (len(lanes) + 1) // 2
    return [*lanes[:half], CHANNEL, *lanes[half:]]


def _x(cols: list[str], name: str) -> int:
    """The lane's middle; a name with no lane of its own (no instance moved) is drawn across the middle."""
    if name in cols:
        return cols.index(name) * LANE_W + LANE_W // 2
    return cols.index(CHANNEL) * LANE_W + LANE_W // 2 if CHANNEL in cols else len(cols) * LANE_W // 2


def _text(x: int, y: int, lines: list[str], cls: str) -> str:
    spans = "".join(f'<tspan x="{x}" dy="{0 if i == 0 else 13}">{escape(line)}</tspan>' for i, line in enumerate(lines))
    return f'<text class="{cls}" x="{x}" y="{y}" text-anchor="middle">{spans}</text>'


def _arrow(x1: int, x2: int, y: int, label: str, cls: str, marker: str, lost: bool = False) -> str:
    tip = "" if lost else f' marker-end="url(#{marker})"'
    end = f'<text class="lost" x="{x2}" y="{y + 4}" text-anchor="middle">╳</text>' if lost else ""
    mid = (x1 + x2) // 2
    return (
        f'<line class="{cls}" x1="{x1}" y1="{y}" x2="{x2}" y2="{y}"{tip}/>{end}'
        f'<text class="msg" x="{mid}" y="{y - 4}" text-anchor="middle">{escape(label)}</text>'
    )


def sequence_svg(
    lanes: Sequence[str], request: str, snaps: Sequence[Snapshot], ident: str = "seq", channel: bool = True
) -> str:
    """The SVG element (no XML prolog: it is inlined in the page); the start row shows ``request``'s instances.

    ``ident`` prefixes its ids, unique per page (an arrowhead defined in a
    hidden diagram of a trace set would draw nothing in the shown one).
    """
    cols = columns(lanes, channel)
    marker = f"{ident}-arrow"
    width = LANE_W * len(cols)
    height = HEAD_H + ROW_H * len(snaps) + 10
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="sequence" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">',
        f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z"/></marker></defs>',
    ]
    for name in cols:
        x = _x(cols, name)
        cls = "lane channel" if name == CHANNEL else "lane"
        parts.append(f'<line class="{cls}" x1="{x}" y1="{HEAD_H - 8}" x2="{x}" y2="{height}"/>')
        parts.append(f'<text class="head" x="{x}" y="{HEAD_H - 16}" text-anchor="middle">{escape(name)}</text>')
    for snap in snaps:
        top = HEAD_H + ROW_H * snap.index
        classes = "row" + (" violation" if snap.violation else "") + (" cycle" if snap.in_cycle else "")
        parts.append(f'<g class="{classes}" data-step="{snap.index}">')
        parts.append(f'<rect class="band" x="0" y="{top}" width="{width}" height="{ROW_H}"/>')
        parts.append(f'<text class="num" x="4" y="{top + 14}">{snap.index or "start"}</text>')
        if snap.role is None:
            for inst in snap.instances:
                if inst.request == request and inst.role in cols:
                    parts.append(_text(_x(cols, inst.role), top + 30, [inst.state], "state"))
        else:
            x = _x(cols, snap.role)
            middle = _x(cols, CHANNEL)
            told = snap.text if snap.role == snap.request else f"{snap.request}: {snap.text}"
            lines = textwrap.wrap(told, TEXT_W)[:2]
            if snap.note:
                lines.append(f"({snap.note})"[: TEXT_W + 4])
            parts.append(_text(x, top + 27, lines[:3], "move"))
            if snap.delivered is not None:
                parts.append(_arrow(middle, x, top + 14, f"✉ {snap.delivered}", "deliver", marker))
            for n, (message, _to, lost) in enumerate(snap.sent):
                parts.append(_arrow(x, middle, top + ROW_H - 4 - 12 * n, f"✉ {message}", "send", marker, lost))
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)
