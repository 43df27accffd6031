"""``kvfsm replay``: check a transition journal a Tracker wrote against its spec, reported as KVF3xx findings."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, get_args

import msgspec
from rich.markup import escape

from ..errors import AnomalyKind
from ..replay import DEFAULT_TOLERANCE, Header, Limit, LogReport, check_log
from ..replay.codes import NAMES
from ..replay.read import first_header, log_lines
from ..replay.record import IDS_PLAIN
from ..spec import Spec, SpecError, load
from ..spec.loader import not_regular
from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_strict,
    err,
    findings_json,
    out,
    print_finding,
)


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "replay",
        help="check a transition log a Tracker wrote against its spec (exit 0 conforms, 1 findings, 2 unusable)",
        description="Check a JSON-lines transition journal (kvfsm.replay.JsonlJournal) against its spec and report "
        "illegal transitions, resources never released and deadlines overrun, by log line (KVF3xx findings).",
    )
    p.add_argument("spec", type=Path, metavar="SPEC", help="the spec file the tracker ran")
    p.add_argument("log", metavar="LOG", help="the journal file, plain or gzip (- reads stdin)")
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=SECONDS",
        help="a param's value, over the one the journal's header records (or the spec's); repeatable",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        metavar="SECONDS",
        help=f"slack before a deadline counts as overrun (default {DEFAULT_TOLERANCE:g})",
    )
    p.add_argument(
        "--allow-live",
        action="store_true",
        help="accept instances still holding resources at the end (a log cut from a running process)",
    )
    p.add_argument(
        "--max",
        action="append",
        default=[],
        metavar="NAME=LIMIT",
        help="fail when a final state or anomaly kind is more frequent: --max expired=1%% --max unknown=0; repeatable",
    )
    p.add_argument("--all", action="store_true", help="list every finding, not just the first")
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_strict(p)  # the warnings: sessions whose headers record other params than the first's
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


ANOMALY_KINDS: tuple[str, ...] = get_args(AnomalyKind)


def _limits(pairs: list[str], spec: Spec) -> dict[str, Limit] | str:
    """``NAME=LIMIT`` pairs (a final state or anomaly kind; a count or a share), or what is wrong with one."""
    limits: dict[str, Limit] = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or name not in (*spec.finals, *ANOMALY_KINDS):
            known = ", ".join((*spec.finals, *ANOMALY_KINDS))
            return f"--max {pair!r}: write NAME=LIMIT with NAME one of {known}, e.g. --max expired=1%"
        try:
            limits[name] = Limit.parse(value)
        except ValueError as exc:
            return f"--max {pair!r}: {exc}"
    return limits


def run(args: argparse.Namespace) -> int:
    params = _params(args.param)
    if isinstance(params, str):
        err.print(f"[red]kvfsm replay: {escape(params)}[/]")
        return EXIT_USAGE
    if not math.isfinite(args.tolerance) or args.tolerance < 0:
        err.print(f"[red]kvfsm replay: --tolerance must be a number of seconds >= 0, not {args.tolerance}[/]")
        return EXIT_USAGE
    try:
        spec = load(args.spec)
    except SpecError as exc:
        for f in exc.findings:
            err.print(f"[red]{escape(str(f))}[/]")
        err.print(f"[red]kvfsm replay: {escape(str(args.spec))} cannot be used; `kvfsm check` it first[/]")
        return EXIT_USAGE
    limits = _limits(args.max, spec)
    if isinstance(limits, str):
        err.print(f"[red]kvfsm replay: {escape(limits)}[/]")
        return EXIT_USAGE
    source: Path | BinaryIO = sys.stdin.buffer if args.log == "-" else Path(args.log)
    if isinstance(source, Path):
        why = _not_a_log(source)
        if why:
            err.print(f"[red]kvfsm replay: log {escape(str(source))} {escape(why)}[/]")
            return EXIT_USAGE
    name = "<stdin>" if args.log == "-" else args.log
    try:
        with log_lines(source) as raw:
            header, lines = first_header(raw)
            recorded = _recorded(header, spec)
            applied = {**recorded, **params}
            sessions = Sessions(lines, applied, spec)
            report = check_log(
                spec,
                sessions,
                name=name,
                params=applied,
                tolerance=args.tolerance,
                allow_live=args.allow_live,
                limits=limits,
            )
    except OSError as exc:
        err.print(f"[red]kvfsm replay: log {escape(name)} cannot be read: {escape(exc.strerror or str(exc))}[/]")
        return EXIT_USAGE
    for line, other in sessions.differing:
        shown = ", ".join(f"{k}={v:g}" for k, v in sorted(other.items()))
        err.print(
            f"[yellow]{escape(name)}:{line}: this session's header records {escape(shown)}; every session is "
            f"checked with the first's (or --param): check the sessions apart to check this one by its own[/]"
        )
    if args.format == "json":
        out.print_json(json.dumps(_json(report, args.spec, applied, header)))
    else:
        _render(report, every=args.all, header=header)
    return EXIT_OK if report.conforms and not (args.strict and sessions.differing) else EXIT_FINDINGS


def _recorded(header: Header | None, spec: Spec) -> dict[str, float]:
    """The params a journal's header records that ``spec`` declares (a version 1 header records none)."""
    if header is None or header.params is None or header.machine not in (None, spec.name):
        return {}
    return {name: value for name, value in header.params.items() if name in spec.params}


class Sessions:
    """The log's lines, passed on as they are read; notes each later session header whose params differ."""

    def __init__(self, lines: Iterable[bytes], applied: dict[str, float], spec: Spec) -> None:
        self._lines = lines
        self._applied = applied
        self._spec = spec
        self.differing: list[tuple[int, dict[str, float]]] = []
        """(line, the params its header records) of each session not run with the params checked against."""

    def __iter__(self) -> Iterator[bytes]:
        decode = msgspec.json.Decoder(Header).decode
        for number, raw in enumerate(self._lines, 1):
            if number > 1 and raw.startswith(b'{"journal":'):
                try:
                    recorded = _recorded(decode(raw), self._spec)
                except (msgspec.MsgspecError, ValueError, RecursionError):
                    recorded = {}
                if any(self._applied.get(k) != v for k, v in recorded.items()):
                    self.differing.append((number, recorded))
            yield raw


def _not_a_log(path: Path) -> str:
    """Why ``path`` cannot be read as a log ("" if it can): it must be a regular file, read line by line.

    A FIFO or a device is refused before it is opened (an empty FIFO would block the open, /dev/zero
    has no lines); a pipe is read from stdin with ``-``.
    """
    try:
        kind = not_regular(path.stat().st_mode)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if kind is None:
        return ""
    if kind == "a directory":
        return "is a directory; name a journal file in it"
    return f"is {kind}, not a journal file; read a pipe from stdin with '-' (e.g. zcat LOG.gz | kvfsm replay SPEC -)"


def _json(report: LogReport, spec: Path, params: dict[str, float], header: Header | None) -> dict[str, object]:
    """``kvfsm check``'s JSON shape for the log's findings, with what was checked beside it."""
    doc = findings_json([(report.path, report.findings)])
    doc["errors"] = report.total  # every finding is an error; only the first KEEP are listed
    summary = report.as_dict()
    del summary["findings"], summary["path"]
    written = {
        "journal": None if header is None else header.journal,
        "ids": IDS_PLAIN if header is None or header.ids is None else header.ids,
        "sample": 1.0 if header is None or header.sample is None else header.sample,
    }
    return {**doc, "spec": str(spec), **summary, "params": params, **written}


def _written(header: Header | None) -> str:
    """How the journal wrote its lines, where it matters to a reader: hashed ids, a sample of the keys."""
    said = []
    if header is not None and header.ids not in (None, IDS_PLAIN):
        said.append(f"ids hashed ({header.ids})")
    if header is not None and header.sample is not None and header.sample < 1.0:
        said.append(f"{header.sample:.2%} of keys sampled")
    return f" ({', '.join(said)})" if said else ""


def _render(report: LogReport, *, every: bool, header: Header | None = None) -> None:
    shown = report.findings if every else report.findings[:1]
    for f in shown:
        print_finding(f)
    summary = (
        f"{report.path}: {report.records} transition(s) of {report.instances} instance(s) of "
        f"{report.machine!r} in {report.lines} line(s){_written(header)}"
    )
    mix = ", ".join(f"{n} {state}" for state, n in report.outcomes.items())
    dropped = ", ".join(f"{n} {kind}" for kind, n in sorted(report.anomalies.items()))
    out.print(f"[dim]outcomes: {escape(mix or 'none')}; anomalies: {escape(dropped or 'none')}[/]")
    if report.conforms:
        out.print(f"[green]✓ {escape(summary)}: conforms[/]")
        return
    counts = ", ".join(f"{n} {code} {NAMES.get(code, '')}".rstrip() for code, n in sorted(report.by_code.items()))
    out.print(f"[red]{escape(summary)}: {report.total} finding(s) ({escape(counts)})[/]")
    hidden = report.total - len(shown)
    if hidden and not every:
        out.print(f"[dim]{hidden} more; --all lists them[/]")
    elif hidden:
        out.print(f"[dim]{hidden} more not listed: only the first {len(shown)} are kept[/]")
