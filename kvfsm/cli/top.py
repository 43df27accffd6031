"""``kvfsm top URL``: a live view of a running process's trackers, read from its debug endpoint's ``/state``."""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from typing import Any

from rich.live import Live
from rich.table import Table

from ..errors import KvfsmError
from .common import EXIT_OK, Subparsers, out


def register(sub: Subparsers) -> None:
    p = sub.add_parser("top", help="live view of a process's trackers (its kvfsm.observe.DebugServer URL)")
    p.add_argument("url", metavar="URL", help="the debug endpoint, e.g. http://127.0.0.1:9400")
    p.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between reads (default 1)")
    p.add_argument("--limit", type=int, default=3, metavar="N", help="oldest instances shown per state (default 3)")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.set_defaults(run=run)


def fetch(url: str, limit: int) -> dict[str, Any]:
    """The endpoint's ``/state``; a usage error naming the URL if it cannot be read."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/state?limit={limit}", timeout=5) as answer:
            doc: dict[str, Any] = json.load(answer)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        raise KvfsmError(f"cannot read {url}/state ({exc}); is a kvfsm.observe.DebugServer serving there?") from None
    return doc


def render(doc: dict[str, Any]) -> Table:
    """One row per state of every tracker: how many, the oldest's age, and who that is."""
    table = Table(title="kvfsm top", show_lines=False)
    for column in ("machine", "state", "count", "oldest age (s)", "oldest"):
        table.add_column(column, justify="right" if column in ("count", "oldest age (s)") else "left")
    for machine, dump in doc.get("trackers", {}).items():
        for state, row in dump["states"].items():
            oldest = row["oldest"][0] if row["oldest"] else None
            age = "" if oldest is None or oldest["age"] is None else f"{oldest['age']:.1f}"
            who = "" if oldest is None else f"{oldest['key']} holds {', '.join(oldest['held']) or 'nothing'}"
            style = "dim" if row["final"] or not row["count"] else ""
            table.add_row(machine, state, str(row["count"]), age, who, style=style)
    return table


def run(args: argparse.Namespace) -> int:
    if args.once:
        out.print(render(fetch(args.url, args.limit)))
        return EXIT_OK
    with Live(render(fetch(args.url, args.limit)), console=out, refresh_per_second=4) as live:
        while True:
            time.sleep(args.interval)
            live.update(render(fetch(args.url, args.limit)))
