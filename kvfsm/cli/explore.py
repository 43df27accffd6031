"""``kvfsm explore``: exhaustive exploration of a composition, or its export to Promela.

Every run is bounded: sizes (``-n``, a system's ``requests:``, ranks, channel
capacity) are checked before anything is built, and the search stops at a
state bound and a time bound (:data:`DEFAULT_MAX_STATES`,
:data:`DEFAULT_TIME_LIMIT`; ``--max-states``/``--time-limit`` change them).
Progress goes to stderr: a rich bar on a terminal, plain lines otherwise or
with ``--progress``. Ctrl-C stops the search and prints what it found.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from .common import (
    EXIT_FINDINGS,
    EXIT_INCOMPLETE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    Subparsers,
    add_strict,
    err,
    out,
    print_finding,
    refuse,
    write_output,
)

if TYPE_CHECKING:
    from ..explore import ExploreResult, Progress
    from ..spec.system import System


DEFAULT_MAX_STATES = 5_000_000
"""States a search stops at unless ``--max-states`` says otherwise: about 1.2 GB and a minute or two on
one core. Every bundled composition needs far fewer (pd_prefill_crash, 4 requests: 41,825)."""

DEFAULT_TIME_LIMIT = 300.0
"""Seconds a run (one request's local system, then the search) stops at unless ``--time-limit`` says otherwise."""

PROGRESS_EVERY = 10.0
"""Seconds between progress lines when stderr is no terminal (a CI log shows the search is alive)."""

PROGRESS_FLAG_EVERY = 1.0
"""Seconds between progress lines with ``--progress``."""

STOPPED = {
    "max_states": "stopped at the state bound",
    "time_limit": "stopped at the time bound",
    "interrupted": "interrupted (Ctrl-C)",
    "first": "stopped at the first violation (--first)",
}


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "explore",
        help="explore every interleaving of a composition's requests "
        "(exit 0 verified, 1 violated, 2 unusable, 3 incomplete, 130 interrupted)",
    )
    p.add_argument("system", type=Path, metavar="SYSTEM", help="a system file (roles, messages, channel, properties)")
    p.add_argument(
        "-n", "--requests", type=int, default=None, help="how many requests (default: the system's; at most 32)"
    )
    p.add_argument("--no-symmetry", action="store_true", help="requests are not interchangeable: store ordered tuples")
    p.add_argument("--no-merge", action="store_true", help="do not merge local states that no property can tell apart")
    p.add_argument("--first", action="store_true", help="stop at the first violation")
    p.add_argument(
        "--max-states",
        default=None,
        metavar="N|none",
        help=f"stop after N states (verdict: incomplete); default {DEFAULT_MAX_STATES:,}; none: no bound",
    )
    p.add_argument(
        "--time-limit",
        default=None,
        metavar="SECONDS|none",
        help=f"stop after this long (verdict: incomplete); default {DEFAULT_TIME_LIMIT:g}; none: no bound",
    )
    p.add_argument(
        "--progress",
        action="store_true",
        help="print a progress line to stderr every second, with the start and the end (default: a bar on a "
        f"terminal, else a line every {PROGRESS_EVERY:g} s)",
    )
    p.add_argument(
        "--unchecked",
        action="store_true",
        help="explore the roles as written even where they fail their checks (a seed's rejected shape); "
        "their errors are printed first",
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_strict(p)
    p.add_argument("--trace", type=Path, default=None, metavar="FILE", help="write the shortest counterexample as JSON")
    p.add_argument(
        "--promela",
        type=Path,
        default=None,
        metavar="OUT.pml",
        help="write the composition as a Promela model for SPIN instead of exploring",
    )
    p.set_defaults(run=run)


def _bound(text: str | None, default: float, flag: str, kind: Callable[[str], float]) -> float | str | None:
    """A bound from its flag: the default when not given, ``None`` for ``none``, else a number above 0;
    or what is wrong with it (a str)."""
    if text is None:
        return default
    if text.strip().lower() == "none":
        return None
    try:
        value = kind(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        what = "a whole number of states" if kind is int else "a number of seconds"
        return f"{flag} must be {what} above 0, or none (no bound), not {text!r}"
    return value


def run(args: argparse.Namespace) -> int:
    from ..explore import MAX_REQUESTS, check_sizes
    from ..spec import SpecError
    from ..spec.system import load_system, read_system

    if args.requests is not None and not 1 <= args.requests <= MAX_REQUESTS:
        side = "at least 1" if args.requests < 1 else f"at most {MAX_REQUESTS}"
        err.print(f"[red]kvfsm explore: --requests must be {side}, not {args.requests}[/]")
        return EXIT_USAGE
    if args.promela is not None:
        searching = ("first", "no_symmetry", "no_merge", "max_states", "time_limit", "progress", "trace", "strict")
        for name in searching:
            if getattr(args, name) not in (None, False):
                return refuse("explore", f"--{name.replace('_', '-')}", "--promela, which exports and does not search")
        if args.format != "text":
            return refuse("explore", "--format json", "--promela, which exports and does not search")
    max_states = _bound(args.max_states, DEFAULT_MAX_STATES, "--max-states", int)
    time_limit = _bound(args.time_limit, DEFAULT_TIME_LIMIT, "--time-limit", float)
    for problem in (max_states, time_limit):
        if isinstance(problem, str):
            err.print(f"[red]kvfsm explore: {escape(problem)}[/]")
            return EXIT_USAGE
    args.max_states_given, args.time_limit_given = args.max_states is not None, args.time_limit is not None
    args.max_states = int(max_states) if isinstance(max_states, float | int) else None
    args.time_limit = time_limit
    try:
        if args.unchecked:
            system, rejected = read_system(args.system)
            for finding in rejected:
                if args.format == "json":  # stdout holds the JSON document alone
                    err.print(f"[yellow]{escape(str(finding))}[/]")
                else:
                    print_finding(finding)
            if rejected:
                err.print(
                    f"[yellow]kvfsm explore: exploring {len(rejected)} check error(s) as written (--unchecked)[/]"
                )
        else:
            system = load_system(args.system)
    except SpecError as exc:  # a composition that fails its checks is unusable (2), not violated (1)
        for finding in exc.findings:
            err.print(f"[red]{escape(str(finding))}[/]")  # on stderr, as every refused input is
        if not args.unchecked and _explorable_as_written(args.system):
            err.print("[yellow]kvfsm explore: fix the errors above, or explore it as written with --unchecked[/]")
        return EXIT_USAGE
    check_sizes(system, args.requests)  # before anything is built: ExploreError, a usage error
    if args.promela is not None:
        return _export(args, system)
    return _explore(args, system)


def _explorable_as_written(path: str) -> bool:
    """Whether ``--unchecked`` would explore the system: only its roles' own checks fail, not the composition's."""
    from ..spec import SpecError
    from ..spec.system import read_system

    try:
        read_system(path)
    except SpecError:
        return False
    return True


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
    from ..explore import explore

    try:
        with _progress(args, system) as show:
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
    except KeyboardInterrupt:  # before the search began, or while its traces were drawn: nothing whole to show
        err.print("[yellow]kvfsm explore: interrupted (Ctrl-C) before the search had a result to show[/]")
        return EXIT_INTERRUPTED
    if args.progress:
        err.print(
            f"explore {escape(system.name)}: done: {result.states:,} states, depth {result.depth}, "
            f"{result.seconds:.1f} s, {result.verdict}",
            highlight=False,
        )
    traces = [p.trace for p in result.violated if p.trace is not None]
    if args.trace is not None and traces:
        shortest = min(traces, key=lambda t: len(t.moves))
        write_output(args.trace, json.dumps(shortest.as_dict(), indent=2) + "\n", "--trace")
    if args.format == "json":
        out.print_json(json.dumps(result.as_dict()))
    else:
        _render(result, given=(args.max_states_given, args.time_limit_given))
        if args.trace is not None:
            out.print(
                f"[dim]wrote {escape(str(args.trace))}[/]" if traces else "[dim]no counterexample: no trace written[/]"
            )
    if result.interrupted:
        return EXIT_INTERRUPTED
    if result.verdict == "violated" or (args.strict and result.unreached):
        return EXIT_FINDINGS
    return EXIT_OK if result.verdict == "verified" else EXIT_INCOMPLETE


@contextmanager
def _progress(args: argparse.Namespace, system: System) -> Iterator[Callable[[Progress], None]]:
    """The progress callback: a rich bar on a terminal, else (or with ``--progress``) plain lines on stderr."""
    name = escape(system.name)

    def words(p: Progress) -> str:
        return (
            f"depth {p.depth}, {p.states:,} states, {p.rate:,.0f} states/s, frontier {p.frontier:,}, {p.seconds:.1f} s"
        )

    if args.progress or not err.is_terminal:
        every = PROGRESS_FLAG_EVERY if args.progress else PROGRESS_EVERY
        if args.progress:
            bounds = ", ".join(
                [
                    f"{args.max_states:,} states" if args.max_states is not None else "no state bound",
                    f"{args.time_limit:g} s" if args.time_limit is not None else "no time bound",
                ]
            )
            n = args.requests or system.requests
            err.print(f"explore {name}: searching {n} request(s) (bounds: {bounds})", highlight=False)
        last = [time.monotonic() - (every if args.progress else 0.0)]

        def line(p: Progress) -> None:
            now = time.monotonic()
            if now - last[0] >= every:
                last[0] = now
                err.print(f"explore {name}: {words(p)}", highlight=False)

        yield line
        return

    from rich.progress import Progress as Bar
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    with Bar(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err, transient=True
    ) as bar:
        task = bar.add_task(f"exploring {name}", total=None)

        def show(p: Progress) -> None:
            bar.update(task, description=f"exploring {name}: {words(p)}")

        yield show


def _render(result: ExploreResult, given: tuple[bool, bool] = (False, False)) -> None:
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
    why = _why_stopped(result, given)
    verdict = {
        "verified": "[green]verified[/] for these bounds",
        "violated": f"[red]{len(result.violated)} property(ies) violated[/]",
        "incomplete": f"[yellow]incomplete[/]: {escape(why)}; nothing is proved",
    }[result.verdict]
    out.print(verdict)
    if result.verdict == "violated" and result.stopped not in (None, "first"):
        out.print(f"[yellow]the search did not finish[/]: {escape(why)}; the properties not violated are unknown")


def _why_stopped(result: ExploreResult, given: tuple[bool, bool]) -> str:
    """Why an incomplete search stopped, with the bound and whether it was the default."""
    how = STOPPED.get(result.stopped or "", "the search was cut short")
    if not result.nodes:  # one request's local system alone outgrew the bound: no search at all
        how += f" while building one request's local system ({result.local_states:,} local states)"
    if result.stopped == "max_states" and result.max_states is not None:
        source = "--max-states" if given[0] else "the default; --max-states changes it"
        return f"{how} ({result.max_states:,} states, {source})"
    if result.stopped == "time_limit" and result.time_limit is not None:
        source = "--time-limit" if given[1] else "the default; --time-limit changes it"
        return f"{how} ({result.time_limit:g} s, {source})"
    if result.stopped == "interrupted":
        return f"{how} after {result.states:,} states"
    return how
