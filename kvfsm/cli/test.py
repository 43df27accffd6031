"""``kvfsm test``: model-based tests of a driver against its spec, with transition coverage."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from .common import EXIT_FINDINGS, EXIT_OK, Subparsers, out

if TYPE_CHECKING:
    from ..testing import Report


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "test",
        help="model-based tests of a driver against a spec (exit 0 passed, 1 diverged, 2 unusable)",
        description="Drive a Tracker and fresh drivers through random events, faults and timeouts (Hypothesis), "
        "checking after every step that the driver's observe(key) matches what the spec says each key holds.",
    )
    p.add_argument("spec", type=Path, metavar="SPEC")
    p.add_argument(
        "--driver",
        required=True,
        metavar="MODULE:FACTORY",
        help="a callable, importable from the current directory, that returns a fresh driver (e.g. my_drivers:make)",
    )
    p.add_argument("--examples", type=_positive, default=None, metavar="N", help="examples to run (default 100)")
    p.add_argument("--steps", type=_positive, default=None, metavar="N", help="steps per example (default 50)")
    p.add_argument("--seed", type=_seed, default=None, metavar="S", help="repeat a run exactly (default: random)")
    p.add_argument(
        "--coverage-svg", type=Path, default=None, metavar="FILE", help="the diagram with coverage drawn on it"
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..gen.diagram import to_svg
    from ..spec import load
    from ..testing import STEPS, load_factory
    from ..testing import run as run_machine

    spec = load(args.spec)
    factory = load_factory(args.driver)
    report = run_machine(spec, factory, examples=args.examples, seed=args.seed, steps=args.steps or STEPS)
    svg_note = ""
    if args.coverage_svg is not None:
        data = to_svg(spec, coverage=report.coverage.taken())
        args.coverage_svg.parent.mkdir(parents=True, exist_ok=True)
        args.coverage_svg.write_bytes(data)
        svg_note = str(args.coverage_svg)
    if args.format == "json":
        doc = {"driver": args.driver, **report.as_dict(), "coverage_svg": svg_note or None}
        out.print_json(json.dumps(doc))
    else:
        _render(args, report)
        if svg_note:
            out.print(f"coverage diagram: {escape(svg_note)}")
    return EXIT_OK if report.passed else EXIT_FINDINGS


def _render(args: argparse.Namespace, report: Report) -> None:
    budget = f"seed {report.seed}, {report.coverage.examples} example(s) of up to {report.steps} steps"
    if report.passed:
        out.print(f"[green]✓ {escape(report.spec.name)}: the driver kept to the spec[/] ({budget})")
    else:
        out.print(f"[red]✗ {escape(report.spec.name)}: the driver diverged from the spec[/] ({budget})")
        *steps, last = report.story or ("",)
        for line in steps:
            out.print(f"  {escape(line)}")
        problem = "; " + "; ".join(report.problems)
        if last.endswith(problem):
            out.print(f"  {escape(last[: -len(problem)])}; [bold red]{escape(problem[2:])}[/]")
        elif last:
            out.print(f"  {escape(last)}")
        if not report.story:
            out.print(f"  {escape(report.error)}")
        again = ["kvfsm", "test", str(args.spec), "--driver", args.driver, "--seed", str(report.seed)]
        if args.examples:
            again += ["--examples", str(args.examples)]
        out.print(f"[dim]repeat with: {escape(shlex.join(again))}[/]")
    _coverage(report)


def _coverage(report: Report) -> None:
    from ..testing.coverage import HOWS

    cov = report.coverage
    table = Table(title="transition coverage", title_justify="left", show_edge=False, pad_edge=False)
    for name in ("from", "event", "to", "taken", "how"):
        table.add_column(name, justify="right" if name == "taken" else "left")
    for row in cov.edge_counts():
        how = ", ".join(f"{h} {row.by[h]}" for h in HOWS if row.by[h])
        event = f"{row.event} (deadline)" if row.timeout else row.event
        if row.taken:
            table.add_row(row.source, event, row.target, str(row.taken), how)
        else:
            table.add_row(row.source, event, row.target, "[red]never[/]", "", style="dim")
    out.print(table)
    for state, event, fired in cov.timeouts():
        mark = f"fired {fired}×" if fired else "[red]never fired[/]"
        out.print(f"deadline of {escape(state)} ({escape(event)}): {mark}")
    summary = cov.summary()
    names = {"edges": "edges", "timeouts": "deadlines", "ignored": "ignored pairs"}
    parts = [f"{names[k]} {done}/{total}" for k, (done, total) in summary.items() if total]
    faults = ", ".join(f"{a} {n}" for a, n in sorted(cov.faults.items())) or "none"
    out.print(f"exercised: {' · '.join(parts)} · injected faults: {escape(faults)}")
