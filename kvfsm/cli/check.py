"""``kvfsm check``: static checks of spec files."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.markup import escape

from ..spec import Finding, check
from .common import (
    EXIT_FINDINGS,
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_strict,
    findings_json,
    out,
    print_finding,
    unreadable,
)


def register(sub: Subparsers) -> None:
    p = sub.add_parser("check", help="static checks of spec files (exit 0 clean, 1 findings, 2 unreadable)")
    p.add_argument("specs", nargs="+", type=Path, metavar="SPEC")
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_strict(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    reports: list[tuple[str, list[Finding]]] = [(str(p), check(p)) for p in args.specs]
    findings = [f for _p, fs in reports for f in fs]
    errors = sum(f.severity == "error" for f in findings)
    warnings = len(findings) - errors
    if args.format == "json":
        out.print_json(json.dumps(findings_json(reports)))
    else:
        for path, fs in reports:
            if not fs:
                out.print(f"[green]✓[/] {escape(path)}: clean")
            for f in fs:
                print_finding(f)
        summary = f"{len(reports)} spec(s): {errors} error(s), {warnings} warning(s)"
        out.print(f"[red]{summary}[/]" if errors else f"[green]{summary}[/]")
    if unreadable(findings):  # a file, or a role spec a system names, that cannot be read
        return EXIT_USAGE
    return EXIT_FINDINGS if errors or (args.strict and warnings) else EXIT_OK
