"""``kvfsm explore``: exhaustive exploration of a composition, or its export to Promela."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from .common import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, Subparsers, err, out, print_finding, write_output

if TYPE_CHECKING:
    from ..explore import ExploreResult
    from ..spec.system import System

EXIT_INCOMPLETE = 3
"""Nothing violated, but the search was cut short (``--max-states``, ``--time-limit``)."""


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "explore",
        help="explore every interleaving of a composition's requests (exit 0 verified, 1 violated, 3 incomplete)",
    )
    p.add_argument("system", type=Path, metavar="SYSTEM", help="a system file (roles, messages, channel, properties)")
    p.add_argument("-n", "--requests", type=int, default=None, help="how many requests (default: the system's)")
    p.add_argument("--no-symmetry", action="store_true", help="requests are not interchangeable: store ordered tuples")
    p.add_argument("--no-merge", action="store_true", help="do not merge local states that no property can tell apart")
    p.add_argument("--first", action="store_true", help="stop at the first violation")
    p.add_argument(
        "--max-states", type=int, default=None, metavar="N", help="stop after N states (verdict: incomplete)"
    )
    p.add_argument(
        "--time-limit", type=float, default=None, metavar="SECONDS", help="stop searching after this long (incomplete)"
    )
    p.add_argument(
        "--unchecked",
        action="store_true",
        help="explore the roles as written even where they fail their checks (a seed's rejected shape); "
        "their errors are printed first",
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE", help="write the shortest counterexample as JSON")
    p.add_argument(
        "--promela",
        type=Path,
        default=None,
        metavar="OUT.pml",
        help="write the composition as a Promela model for SPIN instead of exploring",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..spec.system import load_system, read_system

    if args.requests is not None and args.requests < 1:
        err.print(f"[red]kvfsm explore: --requests must be at least 1, not {args.requests}[/]")
        return EXIT_USAGE
    if args.max_states is not None and args.max_states < 1:
        err.print(f"[red]kvfsm explore: --max-states must be at least 1, not {args.max_states}[/]")
        return EXIT_USAGE
    if args.unchecked:
        system, rejected = read_system(args.system)
        for finding in rejected:
            print_finding(finding)
        if rejected:
            err.print(f"[yellow]kvfsm explore: exploring {len(rejected)} check error(s) as written (--unchecked)[/]")
    else:
        system = load_system(args.system)
    if args.promela is not None:
        return _export(args, system)
    return _explore(args, system)


def _export(args: argparse.Namespace, system: System) -> int:
    from ..gen.promela import to_promela

    text = to_promela(system, requests=args.requests)
    write_output(args.promela, text, "--promela")
    n = args.requests or system.requests
    out.print(f"wrote {escape(str(args.promela))} (Promela, {n} request(s), {len(text.splitlines())} lines)")
    out.print(
        f"[dim]check it: spin -a {escape(args.promela.name)} && gcc -O2 -DSAFETY -DNOREDUCE -o pan pan.c && ./pan -m5000000[/]"
    )
    for prop in system.eventually:
        out.print(
            f"[dim]{escape(prop.name)}: spin -DLIVE -DONLY=255 -a {escape(args.promela.name)}"
            f" && gcc -O2 -DNOREDUCE -o pan pan.c && ./pan -a -N {escape(prop.name)}[/]"
        )
    return EXIT_OK


def _explore(args: argparse.Namespace, system: System) -> int:
    from rich.progress import Progress as Bar
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..explore import Progress, explore

    with Bar(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True
    ) as bar:
        task = bar.add_task(f"exploring {escape(system.name)}", total=None)

        def show(p: Progress) -> None:
            bar.update(
                task,
                description=f"exploring {escape(system.name)}: depth {p.depth}, {p.states:,} states, "
                f"{p.rate:,.0f} states/s, frontier {p.frontier:,}",
            )

        result = explore(
            system,
            requests=args.requests,
            symmetry=not args.no_symmetry,
            merge=not args.no_merge,
            first=args.first,
            max_states=args.max_states,
            time_limit=args.time_limit,
            progress=show,
        )
    traces = [p.trace for p in result.violated if p.trace is not None]
    if args.trace is not None and traces:
        shortest = min(traces, key=lambda t: len(t.moves))
        write_output(args.trace, json.dumps(shortest.as_dict(), indent=2) + "\n", "--trace")
    if args.format == "json":
        out.print_json(json.dumps(result.as_dict()))
    else:
        _render(result)
        if args.trace is not None:
            out.print(
                f"[dim]wrote {escape(str(args.trace))}[/]" if traces else "[dim]no counterexample: no trace written[/]"
            )
    if result.verdict == "violated":
        return EXIT_FINDINGS
    return EXIT_OK if result.verdict == "verified" else EXIT_INCOMPLETE


def _render(result: ExploreResult) -> None:
    from ..explore import format_trace

    c = result.channel
    channel = ", ".join(
        [w for w, on in (("lossy", c.loss), ("duplicating", c.duplicate), ("reordering", c.reorder)) if on]
        or ["reliable FIFO"]
    )
    reductions = [w for w, on in (("symmetry", result.symmetry), ("merged look-alike states", result.merge)) if on]
    out.print(
        f"[bold]{escape(result.system)}[/]: {result.requests} request(s), {channel} channel of capacity {c.capacity}; "
        f"{', '.join(reductions) or 'no reductions'}"
    )
    out.print(
        f"{result.states:,} states, {result.transitions:,} transitions, depth {result.depth}, "
        f"{result.seconds:.2f} s ({result.rate:,.0f} states/s); one request: {result.local_states} local states"
        + (f" → {result.nodes} classes" if result.merge else "")
    )
    table = Table(title_justify="left")
    for column in ("property", "verdict", "what it means"):
        table.add_column(column)
    colours = {"holds": "green", "violated": "red", "unknown": "yellow"}
    for p in result.properties:
        verdict = f"[{colours[p.status]}]{p.status}[/]"
        if p.trace is not None and p.trace.loop is not None:
            verdict += f" (lasso: {p.trace.loop} + {len(p.trace.cycle)} steps)"
        elif p.trace is not None:
            verdict += f" ({len(p.trace.moves)} steps)"
        table.add_row(escape(p.name), verdict, escape(p.description))
    out.print(table)
    for p in result.violated:
        assert p.trace is not None
        out.print()
        out.print(escape(format_trace(p.trace)), highlight=False)
    for role, state in result.unreached:
        out.print(f"[yellow]warning:[/] {escape(role)} never reaches {escape(state)} within these bounds")
    verdict = {
        "verified": "[green]verified[/] for these bounds",
        "violated": f"[red]{len(result.violated)} property(ies) violated[/]",
        "incomplete": "[yellow]incomplete[/]: the search was cut short; nothing is proved",
    }[result.verdict]
    out.print(verdict)
