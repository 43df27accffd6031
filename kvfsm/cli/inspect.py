"""``kvfsm inspect``: a spec, a system, a counterexample, a trace set, a test story or a journal (or a live process)
in a browser, or as one HTML file."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rich.markup import escape

from .common import EXIT_OK, EXIT_USAGE, Subparsers, err, out, refuse, write_output


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "inspect",
        help="a spec, system, explorer trace, trace set, test story or journal (or a live process) as a web page: "
        "served on 127.0.0.1, or --html",
        description="Show a spec or system (its diagram, what each state holds and its deadline, kvfsm check's "
        "findings pinned to the states and edges they name) and, with --trace, step through an explorer "
        "counterexample, or with --trace-set through each trace of the system's trace set; for a machine spec, with "
        "--story through a failing kvfsm test run's story, or with --journal through a journal's transitions with "
        "kvfsm replay's findings at their lines; or, with --live URL (repeatable), watch tracker debug endpoints. "
        "The page is served on 127.0.0.1 until Ctrl-C (exit 130), or written with --html as one self-contained file. "
        "Exit 0 once it is written or served: the findings are in the page (kvfsm check gives them an exit status).",
    )
    p.add_argument("target", nargs="?", type=Path, metavar="SPEC_OR_SYSTEM", help="a machine spec or a system file")
    p.add_argument("--trace", type=Path, metavar="TRACE.json", help="a counterexample written by kvfsm explore --trace")
    p.add_argument(
        "--trace-set",
        action="store_true",
        help="step through the system's trace set (the traces kvfsm test SYSTEM replays), one trace at a time",
    )
    p.add_argument(
        "--story",
        type=Path,
        metavar="RESULT.json",
        help="step through the story of a failing 'kvfsm test SPEC --format json' run written to this file; with "
        "--trace, mark where 'kvfsm test SYSTEM --trace TRACE.json --format json' found the drivers diverge",
    )
    p.add_argument(
        "--journal",
        type=Path,
        metavar="LOG",
        help="step through a transition journal (plain or gzip) with kvfsm replay's findings at their lines",
    )
    p.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="KEY",
        help="--journal: show this key's instances (repeatable; default: the keys with findings, else every key)",
    )
    p.add_argument("--html", type=Path, metavar="OUT.html", help="write the page to this file instead of serving it")
    p.add_argument(
        "--live",
        action="append",
        metavar="URL",
        help="watch a tracker debug endpoint (e.g. kvfsm demo --metrics's); repeat it to watch several on one page",
    )
    p.add_argument(
        "--port", type=_port, default=None, metavar="PORT", help="serve on 127.0.0.1:PORT (default: any free)"
    )
    p.add_argument(
        "--interval", type=_seconds, default=None, metavar="S", help="--live: seconds between reads (default 1)"
    )
    p.set_defaults(run=run)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number from 0 to 65535")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds from 0.1 to 3600")
    return value


def run(args: argparse.Namespace) -> int:
    from ..explore import read_trace
    from ..inspect import (
        InspectServer,
        build,
        build_journal,
        build_replayed,
        build_story,
        build_trace_set,
        html,
        live_page,
    )
    from ..inspect.live import Watch

    if args.html is not None and args.port is not None:
        return refuse("inspect", "--port", "--html, which writes a file")
    if args.key and args.journal is None:
        return refuse("inspect", "--key", "a page without --journal, whose keys it picks")
    if args.live is not None:
        given_there = (args.target, args.trace, args.trace_set or None, args.story, args.journal, args.html)
        options = ("SPEC_OR_SYSTEM", "--trace", "--trace-set", "--story", "--journal", "--html")
        for given, option in zip(given_there, options, strict=True):
            if given is not None:
                return refuse("inspect", option, "--live, which watches a running process")
        for url in args.live:
            if not url.startswith(("http://", "https://")):
                err.print(f"[red]kvfsm inspect: --live {escape(url)} is no http:// URL of a debug endpoint[/]")
                return EXIT_USAGE
        urls = list(dict.fromkeys(args.live))
        page = live_page(urls, args.interval or 1.0)
        watch: Watch | None = Watch(urls)
    else:
        if args.target is None:
            err.print("[red]kvfsm inspect: name a spec or system file, or --live URL[/]")
            return EXIT_USAGE
        if args.interval is not None:
            return refuse("inspect", "--interval", "a spec or trace, which does not change")
        runs = [o for o, v in (("--trace", args.trace), ("--trace-set", args.trace_set or None),
                                 ("--story", args.story), ("--journal", args.journal)) if v is not None]  # fmt: skip
        replayed = runs == ["--trace", "--story"]  # the trace, and what replaying it on the drivers found
        if len(runs) > 1 and not replayed:
            return refuse("inspect", runs[1], f"{runs[0]}: the page steps through one kind of run")
        if args.trace_set:
            page = build_trace_set(args.target)
        elif replayed:
            page = build_replayed(args.target, read_trace(args.trace), args.story)
        elif args.story is not None:
            page = build_story(args.target, args.story)
        elif args.journal is not None:
            page = build_journal(args.target, args.journal, args.key)
        else:
            page = build(args.target, read_trace(args.trace) if args.trace is not None else None)
        watch = None
    document = html(page)
    if args.html is not None:
        write_output(args.html, document, "--html")
        out.print(f"wrote {escape(str(args.html))} ({len(document.encode()):,} bytes, self-contained)")
        return EXIT_OK
    server = InspectServer(document, port=args.port or 0, watch=watch)
    try:
        out.print(f"kvfsm inspect: serving {escape(page.title)} at {server.url} (loopback only; Ctrl-C stops)")
        server.serve_forever()
    finally:
        server.close()
    return EXIT_OK
