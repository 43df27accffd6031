"""``kvfsm bench``: the performance comparison, rendered as tables."""

from __future__ import annotations

import argparse
import json

from rich.markup import escape
from rich.table import Table

from .common import EXIT_FINDINGS, EXIT_OK, Subparsers, err, missing_extra, out


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "bench", help="the performance comparison (one run, ratios against baselines; exit 1 if a target is missed)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    try:
        from ..showcase import bench
    except ImportError as exc:
        return missing_extra("bench", "showcase", exc)

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("benchmarks", total=None)

        def step(label: str, done: int, total: int) -> None:
            progress.update(task, description=label, completed=done, total=total)

        report = bench.run(quick=args.quick, progress=step)
    if args.format == "json":
        out.print_json(json.dumps(report.as_dict()))
        return EXIT_OK if report.passed or report.quick else EXIT_FINDINGS
    from ..showcase.bench.report import fmt_number

    section = None
    table = None
    for row in report.rows:
        if row.section != section:
            if table is not None:
                out.print(table)
            section = row.section
            table = Table(title=escape(section), title_justify="left")
            for column in ("", "value", "unit", "ratio"):
                table.add_column(column, justify="left" if column in ("", "unit") else "right")
        assert table is not None
        ratio = f"{fmt_number(row.ratio)}× {row.baseline}" if row.ratio is not None and row.baseline else ""
        table.add_row(escape(row.name), fmt_number(row.value), row.unit, escape(ratio))
    if table is not None:
        out.print(table)
    targets = Table(title="targets", title_justify="left")
    for column in ("", "target", "measured"):
        targets.add_column(column)
    for t in report.targets:
        targets.add_row(
            "[green]met[/]" if t.passed else "[red]missed[/]", escape(t.description), fmt_number(t.measured)
        )
    out.print(targets)
    for note in report.notes:
        out.print(f"[dim]- {escape(note)}[/]")
    env = ", ".join(f"{k} {v}" for k, v in report.environment.items())
    out.print(
        f"[dim]{'quick (figures not meaningful)' if report.quick else 'full'} run, {report.seconds:.0f} s; {escape(env)}[/]"
    )
    return EXIT_OK if report.passed or report.quick else EXIT_FINDINGS
