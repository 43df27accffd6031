"""``kvfsm top URL``: a live view of a running process's trackers, read from its debug endpoint's ``/state``.

It outlives the process it watches: when a read fails after one has
succeeded (the process restarted, or is restarting), it says so and reads
again every interval until the endpoint answers, then says it is back.
``--format json`` prints each read as one JSON line on stdout (the notes go to
stderr), so it can be piped.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from rich.live import Live
from rich.markup import escape
from rich.table import Table

from ..errors import KvfsmError
from ..observe.client import EndpointError, read
from .common import EXIT_OK, Subparsers, err, out, refuse


def register(sub: Subparsers) -> None:
    p = sub.add_parser("top", help="live view of a process's trackers (its kvfsm.observe.DebugServer URL)")
    p.add_argument("url", metavar="URL", help="the debug endpoint, e.g. http://127.0.0.1:9400")
    p.add_argument("--interval", type=_interval, default=1.0, metavar="S", help="seconds between reads (default 1)")
    p.add_argument("--limit", type=_count, default=3, metavar="N", help="oldest instances shown per state (default 3)")
    p.add_argument("--once", action="store_true", help="print one view and exit")
    p.add_argument(
        "--count", type=_reads, default=None, metavar="N", help="stop after N reads (default: until interrupted)"
    )
    p.add_argument(
        "--format",
        choices=("text", "json"),
        default="text",
        help="json: each read as one JSON line on stdout (the /state document), notes on stderr",
    )
    p.set_defaults(run=run)


def _interval(text: str) -> float:
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


def _reads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of reads from 1 up")
    return value


def fetch(url: str, limit: int) -> dict[str, Any]:
    """The endpoint's ``/state``; a usage error naming the URL if it cannot be read, or is too big or too slow."""
    where = f"{url.rstrip('/')}/state"
    hint = "is a kvfsm.observe.DebugServer serving there?"
    try:
        doc = json.loads(read(f"{where}?limit={limit}"))
    except EndpointError as exc:
        raise KvfsmError(f"{exc}; {hint}") from None
    except (ValueError, RecursionError) as exc:
        raise KvfsmError(f"cannot read {where} ({exc}); {hint}") from None
    if not isinstance(doc, dict):
        raise KvfsmError(f"{where} answered {type(doc).__name__}, not a JSON object; {hint}")
    return doc


def render(doc: dict[str, Any], caption: str | None = None) -> Table:
    """One row per state of every tracker: how many, the oldest's age against the state's stuck threshold and
    deadline (``stuck at/timeout``), and who that is; a row whose oldest instance is stuck (not just slow) is red."""
    table = Table(title="kvfsm top", caption=caption, show_lines=False)
    table.add_column("machine", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("count", justify="right", no_wrap=True)
    table.add_column("age (s)", justify="right", no_wrap=True)
    table.add_column("stuck at/timeout", justify="right", no_wrap=True)
    table.add_column("oldest")
    for machine, dump in doc.get("trackers", {}).items():
        for state, row in dump["states"].items():
            oldest = row["oldest"][0] if row["oldest"] else None
            age = "" if oldest is None or oldest["age"] is None else f"{oldest['age']:.1f}"
            who = "" if oldest is None else f"{oldest['key']} holds {', '.join(oldest['held']) or 'nothing'}"
            if oldest is not None and oldest.get("stuck"):
                who, style = f"{who} (stuck)", "bold red"
            else:
                style = "dim" if row["final"] or not row["count"] else ""
            stuck_at, timeout = row.get("stuck_after"), row.get("timeout")
            limits = "" if stuck_at is None and timeout is None else f"{_seconds(stuck_at)}/{_seconds(timeout)}"
            table.add_row(machine, state, str(row["count"]), age, limits, who, style=style)
    return table


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


def drawn(url: str, doc: dict[str, Any], caption: str | None = None) -> Table:
    """``doc`` drawn; an answer that is JSON but no tracker dump is a usage error."""
    try:
        return render(doc, caption)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as exc:
        raise KvfsmError(f"{url}/state is not a kvfsm tracker dump ({type(exc).__name__}: {exc})") from None


class Reading(NamedTuple):
    """One read of the endpoint: its ``/state`` document, or None while it cannot be read; ``news`` says, once,
    that the endpoint was lost or is back."""

    doc: dict[str, Any] | None
    news: str | None


def watch(
    url: str,
    limit: int,
    interval: float,
    *,
    reads: int | None = None,
    pause: Callable[[float], object] = time.sleep,
    read: Callable[[str, int], dict[str, Any]] = fetch,
) -> Iterator[Reading]:
    """Read ``url`` every ``interval`` seconds, ``reads`` times (None: for ever).

    The first read must succeed (a usage error names the URL otherwise). A
    later one that fails yields ``Reading(None, "lost ...")`` once, and the
    endpoint is read again every interval until it answers, which yields the
    document with ``news`` saying it is back: the watched process may restart.
    """
    doc = read(url, limit)
    yield Reading(doc, None)
    done, lost = 1, False
    while reads is None or done < reads:
        pause(interval)
        done += 1
        try:
            doc = read(url, limit)
        except KvfsmError as exc:
            if not lost:
                lost = True
                yield Reading(None, f"lost {url} at {_clock()}: {exc}; reading again every {interval:g} s")
            continue
        yield Reading(doc, f"reconnected to {url} at {_clock()}" if lost else None)
        lost = False


def pause(seconds: float) -> None:
    """Wait between reads (a test replaces it to restart the watched endpoint in between)."""
    time.sleep(seconds)


def _clock() -> str:
    return datetime.datetime.now().strftime("%H:%M:%S")


def run(args: argparse.Namespace) -> int:
    if args.once and args.count is not None:
        return refuse("top", "--count", "--once, which reads once")
    reads = 1 if args.once else args.count
    readings = watch(args.url, args.limit, args.interval, reads=reads, pause=pause)
    if args.format == "json":
        for reading in readings:
            if reading.news is not None:
                err.print(f"[yellow]kvfsm top: {escape(reading.news)}[/]")
            if reading.doc is not None:
                sys.stdout.write(json.dumps(reading.doc) + "\n")
                sys.stdout.flush()
        return EXIT_OK
    first = next(readings)
    assert first.doc is not None
    last = first.doc
    if args.once:
        out.print(drawn(args.url, last))
        return EXIT_OK
    with Live(drawn(args.url, last), console=out, refresh_per_second=4) as live:
        caption = None
        for reading in readings:
            if reading.news is not None:
                caption = reading.news
            last = reading.doc if reading.doc is not None else last
            live.update(drawn(args.url, last, caption))
    return EXIT_OK
