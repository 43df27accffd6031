"""``kvfsm replay``: check a transition journal a Tracker wrote against its spec."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from rich.markup import escape

from ..spec import SpecError, load
from .common import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, Subparsers, err, out

if TYPE_CHECKING:
    from ..replay import Divergence, Replay


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "replay",
        help="check a transition log a Tracker wrote against its spec (exit 0 conforms, 1 diverges, 2 unusable)",
        description="Replay a JSON-lines transition journal (kvfsm.replay.JsonlJournal) on the spec and report "
        "illegal transitions, resources never released and deadlines overrun, by log line.",
    )
    p.add_argument("spec", type=Path, metavar="SPEC", help="the spec file the tracker ran")
    p.add_argument("log", metavar="LOG", help="the journal file (.gz is read as gzip; - reads stdin)")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a param the deployment overrode, as it passed Tracker(params=...); repeatable",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=None,
        metavar="SECONDS",
        help="slack before a deadline counts as overrun (default 1.0)",
    )
    p.add_argument(
        "--allow-live",
        action="store_true",
        help="accept instances still holding resources at the end (a log cut from a running process)",
    )
    p.add_argument("--all", action="store_true", help="list every divergence, not just the first")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(run=run)


def _params(pairs: list[str]) -> dict[str, float] | str:
    """``NAME=SECONDS`` pairs as a dict, or what is wrong with one of them."""
    params: dict[str, float] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not eq or not name or not math.isfinite(seconds):
            return f"--param {pair!r}: write NAME=SECONDS, e.g. --param transfer_timeout=5"
        params[name] = seconds
    return params


def run(args: argparse.Namespace) -> int:
    try:
        from ..replay import DEFAULT_TOLERANCE, check_log
    except ModuleNotFoundError as exc:  # msgspec is an optional dependency of the library
        err.print(f"[red]kvfsm replay: needs {exc.name} (pip install {exc.name})[/]")
        return EXIT_USAGE
    params = _params(args.param)
    if isinstance(params, str):
        err.print(f"[red]kvfsm replay: {escape(params)}[/]")
        return EXIT_USAGE
    tolerance = DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance
    if not math.isfinite(tolerance) or tolerance < 0:
        err.print(f"[red]kvfsm replay: --tolerance must be a number of seconds >= 0, not {args.tolerance}[/]")
        return EXIT_USAGE
    try:
        spec = load(args.spec)
    except SpecError as exc:
        for f in exc.findings:
            err.print(f"[red]{escape(str(f))}[/]")
        err.print(f"[red]kvfsm replay: {escape(str(args.spec))} cannot be used; `kvfsm check` it first[/]")
        return EXIT_USAGE
    source: Path | BinaryIO = sys.stdin.buffer if args.log == "-" else Path(args.log)
    if isinstance(source, Path) and not source.is_file():
        why = "is a directory" if source.is_dir() else "does not exist"
        err.print(f"[red]kvfsm replay: log {escape(str(source))} {why}[/]")
        return EXIT_USAGE
    report = check_log(
        spec,
        source,
        name="<stdin>" if args.log == "-" else None,
        params=params,
        tolerance=tolerance,
        allow_live=args.allow_live,
    )
    if args.format == "json":
        doc = report.as_dict()
        doc["spec"] = str(args.spec)
        out.print_json(json.dumps(doc))
    else:
        _render(report, every=args.all)
    return EXIT_OK if report.conforms else EXIT_FINDINGS


def _render(report: Replay, *, every: bool) -> None:
    shown = report.divergences if every else report.divergences[:1]
    for d in shown:
        _divergence(d)
    summary = (
        f"{report.path}: {report.records} transition(s) of {report.instances} instance(s) of "
        f"{report.machine!r} in {report.lines} line(s)"
    )
    if report.conforms:
        out.print(f"[green]✓ {escape(summary)}: conforms[/]")
        return
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(report.by_kind.items()))
    out.print(f"[red]{escape(summary)}: {report.total} divergence(s) ({escape(counts)})[/]")
    hidden = report.total - len(shown)
    if hidden and not every:
        out.print(f"[dim]{hidden} more; --all lists them[/]")
    elif hidden:
        out.print(f"[dim]{hidden} more not listed: only the first {len(shown)} are kept[/]")


def _divergence(d: Divergence) -> None:
    out.print(f"[bold]{escape(d.path)}:{d.line}[/]: [red]{d.kind}:[/] {escape(d.message)}")
    if d.fix:
        out.print(f"    [dim]fix:[/] {escape(d.fix)}")
