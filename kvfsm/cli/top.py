"""``kvfsm top URL``: a live view of a running process's trackers, read from its debug endpoint's ``/state``."""

from __future__ import annotations

import argparse
import json
import math
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
    p.add_argument("--interval", type=_seconds, default=1.0, metavar="S", help="seconds between reads (default 1)")
    p.add_argument("--limit", type=_count, default=3, metavar="N", help="oldest instances shown per state (default 3)")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.set_defaults(run=run)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 1000")
    return value


MAX_ANSWER = 16 << 20
"""Largest ``/state`` answer read (16 MiB): a dump is bounded by ``--limit`` per state, so more than
this is not a kvfsm debug endpoint, and it is refused rather than read whole."""

READ_SECONDS = 10.0
"""Longest one read of ``/state`` may take, however slowly the server sends."""


def fetch(url: str, limit: int) -> dict[str, Any]:
    """The endpoint's ``/state``; a usage error naming the URL if it cannot be read, or is too big or too slow."""
    where = f"{url.rstrip('/')}/state"
    hint = "is a kvfsm.observe.DebugServer serving there?"
    try:
        with urllib.request.urlopen(f"{where}?limit={limit}", timeout=5) as answer:
            body = _bounded(answer, where, hint)
        doc = json.loads(body)
    except (OSError, urllib.error.URLError, ValueError, RecursionError) as exc:
        raise KvfsmError(f"cannot read {where} ({exc}); {hint}") from None
    if not isinstance(doc, dict):
        raise KvfsmError(f"{where} answered {type(doc).__name__}, not a JSON object; {hint}")
    return doc


def _bounded(answer: Any, where: str, hint: str) -> bytes:
    """The answer's body, read in chunks up to :data:`MAX_ANSWER` bytes and :data:`READ_SECONDS`."""
    chunks: list[bytes] = []
    size = 0
    started = time.monotonic()
    while chunk := answer.read(1 << 16):
        size += len(chunk)
        if size > MAX_ANSWER:
            raise KvfsmError(f"{where} answered more than {MAX_ANSWER >> 20} MiB; {hint}")
        if time.monotonic() - started > READ_SECONDS:
            raise KvfsmError(f"{where} took more than {READ_SECONDS:g} s to answer; {hint}")
        chunks.append(chunk)
    return b"".join(chunks)


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


def view(url: str, limit: int) -> Table:
    """One read of the endpoint, drawn; an answer that is JSON but no tracker dump is a usage error too."""
    doc = fetch(url, limit)
    try:
        return render(doc)
    except (KeyError, TypeError, AttributeError, IndexError) as exc:
        raise KvfsmError(f"{url}/state is not a kvfsm tracker dump ({type(exc).__name__}: {exc})") from None


def run(args: argparse.Namespace) -> int:
    if args.once:
        out.print(view(args.url, args.limit))
        return EXIT_OK
    with Live(view(args.url, args.limit), console=out, refresh_per_second=4) as live:
        while True:
            time.sleep(args.interval)
            live.update(view(args.url, args.limit))
