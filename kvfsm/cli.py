"""The ``kvfsm`` command: renders what the library returns; never shows a traceback for bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import KvfsmError
from .spec import Finding, SpecError, check, read
from .spec.findings import READ_ERROR

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _cmd_check(args: argparse.Namespace) -> int:
    reports: list[tuple[str, list[Finding]]] = [(str(p), check(p)) for p in args.specs]
    findings = [f for _p, fs in reports for f in fs]
    errors = sum(f.severity == "error" for f in findings)
    warnings = len(findings) - errors
    unreadable = any(f.code == READ_ERROR for f in findings)
    if args.format == "json":
        doc = {
            "files": [
                {"path": p, "clean": not any(f.severity == "error" for f in fs), "findings": [f.as_dict() for f in fs]}
                for p, fs in reports
            ],
            "errors": errors,
            "warnings": warnings,
        }
        out.print_json(json.dumps(doc))
    else:
        for path, fs in reports:
            if not fs:
                out.print(f"[green]✓[/] {escape(path)}: clean")
                continue
            for f in fs:
                colour = "red" if f.severity == "error" else "yellow"
                where = f"{f.path}:{f.line}" if f.line else f.path
                out.print(f"[bold]{escape(where)}[/]: [{colour}]{f.severity} {f.code}[/] {escape(f.message)}")
                if f.fix:
                    out.print(f"    [dim]fix:[/] {escape(f.fix)}")
        summary = f"{len(reports)} spec(s): {errors} error(s), {warnings} warning(s)"
        out.print(f"[red]{summary}[/]" if errors else f"[green]{summary}[/]")
    if unreadable:
        return EXIT_USAGE
    return EXIT_FINDINGS if errors else EXIT_OK


def _cmd_diagram(args: argparse.Namespace) -> int:
    from .gen.diagram import render

    spec = read(args.spec)
    data = render(spec, args.format, ignores=args.ignores)
    if args.output is None or str(args.output) == "-":
        sys.stdout.buffer.write(data)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_bytes(data)
        out.print(f"wrote {escape(str(args.output))} ({args.format}, {len(data)} bytes)")
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from . import bench

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("benchmarks", total=None)

        def step(label: str, done: int, total: int) -> None:
            progress.update(task, description=label, completed=done, total=total)

        report = bench.run(quick=args.quick, progress=step)
    if args.format == "json":
        out.print_json(json.dumps(report.as_dict()))
        return EXIT_OK if report.passed or report.quick else EXIT_FINDINGS
    from .bench.report import fmt_number

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


def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="kvfsm", description="Declared, checked state machines for the KV-cache lifecycle of LLM-serving requests."
    )
    parser.add_argument("--version", action="version", version=f"kvfsm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="static checks of spec files (exit 0 clean, 1 findings, 2 unreadable)")
    p.add_argument("specs", nargs="+", type=Path, metavar="SPEC")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(run=_cmd_check)

    p = sub.add_parser("diagram", help="draw a spec as SVG, DOT or Mermaid")
    p.add_argument("spec", type=Path, metavar="SPEC")
    p.add_argument("-f", "--format", choices=("svg", "dot", "mermaid"), default="svg")
    p.add_argument("-o", "--output", type=Path, default=None, help="file to write (default: stdout)")
    p.add_argument("--ignores", action="store_true", help="also draw ignore rules (late events that are legal no-ops)")
    p.set_defaults(run=_cmd_diagram)

    p = sub.add_parser(
        "bench", help="the performance comparison (one run, ratios against baselines; exit 1 if a target is missed)"
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not a measurement")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.set_defaults(run=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except SpecError as exc:
        for f in exc.findings:
            err.print(f"[red]{escape(str(f))}[/]")
        return EXIT_USAGE if any(f.code == READ_ERROR for f in exc.findings) else EXIT_FINDINGS
    except (KvfsmError, OSError) as exc:
        err.print(f"[red]kvfsm {args.command}: {escape(str(exc))}[/]")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # an internal bug: say so plainly; the traceback is opt-in
        if os.environ.get("KVFSM_DEBUG"):
            raise
        err.print(
            f"[red]kvfsm {args.command}: internal error {type(exc).__name__}: {escape(str(exc))}[/] (set KVFSM_DEBUG=1 for the traceback, and please report it)"
        )
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
