"""``kvfsm test``: model-based tests of a driver against its spec, with transition coverage, or a trace replayed on drivers."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rich.markup import escape
from rich.table import Table

from .common import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, Subparsers, add_strict, err, out, write_output

DEFAULT_CALL_TIMEOUT = 60.0
"""Seconds one call into a driver (its factory, observe, an action, a release) may take before it is a finding.
Model-based calls take microseconds; a factory that starts a real engine may take tens of seconds."""

if TYPE_CHECKING:
    from ..spec import Spec
    from ..spec.system import System
    from ..testing import Report
    from ..testing.contract import DriverFactory, OwnedFactory
    from ..testing.trace_replay import TraceResult
    from ..testing.trace_set import SystemCoverage


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _percent(text: str) -> float:
    try:
        value = float(text.rstrip("%"))
    except ValueError:
        value = -1.0
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"{text!r} is not a percentage from 0 to 100")
    return value / 100


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "test",
        help="model-based tests of a driver against a spec, or a trace replayed on drivers "
        "(exit 0 passed, 1 diverged, 2 unusable)",
        description="Drive a Tracker and fresh drivers through random events, faults and timeouts (Hypothesis), "
        "checking after every step that the driver's observe(key) matches what the spec says each key holds. "
        "Given a system file, replay a small set of traces that together take every reachable role edge and "
        "deliver every reachable message, on one Tracker and driver per role (exit 0 when all match and nothing "
        "reachable went unexercised). With --trace, replay one explorer trace of a system instead "
        "(exit 0 when the trace's violation is reproduced). Hypothesis runs with no example database (the seed "
        "repeats a run); its own files go under $XDG_CACHE_HOME/kvfsm/hypothesis (~/.cache/kvfsm/hypothesis), "
        "never into the working directory. A long run shows its examples as a bar on stderr when stderr is a "
        "terminal; --examples N runs exactly N examples (the planned path cover among them, never cut short).",
    )
    p.add_argument(
        "spec",
        type=Path,
        metavar="SPEC",
        help="a machine spec; or a system file: its trace set (every reachable role edge and message) is replayed "
        "on the drivers, or with --trace one trace is",
    )
    p.add_argument(
        "--driver",
        action="append",
        default=[],
        metavar="[ROLE=]MODULE:FACTORY",
        help="a callable, importable from the current directory, that returns a fresh driver (e.g. my_drivers:make); "
        "for a spec that owns another machine (owns:), also NAME=MODULE:FACTORY for the owned machine's drivers, "
        "called with the owner's driver (its spec is read from beside the owner's; without it, a ledger driver); "
        "for a system file, one ROLE=MODULE:FACTORY per role you have a driver for (the others get a ledger driver)",
    )
    p.add_argument(
        "--trace",
        type=Path,
        default=None,
        metavar="TRACE.json",
        help="replay this kvfsm-trace/1 file (from 'kvfsm explore SYSTEM --trace FILE') on the drivers",
    )
    p.add_argument("--examples", type=_positive, default=None, metavar="N", help="examples to run (default 100)")
    p.add_argument("--steps", type=_positive, default=None, metavar="N", help="steps per example (default 50)")
    p.add_argument("--seed", type=_seed, default=None, metavar="S", help="repeat a run exactly (default: random)")
    p.add_argument(
        "--coverage-svg", type=Path, default=None, metavar="FILE", help="the diagram with coverage drawn on it"
    )
    p.add_argument(
        "--min-coverage",
        type=_percent,
        default=None,
        metavar="PERCENT",
        help="pass with only this share of the edges, deadlines and ignore rules exercised (default 100)",
    )
    p.add_argument(
        "--exempt",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML exemption list: machine → {'SOURCE --EVENT--> TARGET' (or 'deadline of S', 'ignored E in S'): "
        "why it may go unexercised}",
    )
    p.add_argument(
        "--call-timeout",
        default=None,
        metavar="SECONDS|none",
        help="a driver call (its factory, observe, an action, a release) that has not returned after this long is "
        f"a finding, exit 1 (default {DEFAULT_CALL_TIMEOUT:g}; none: no limit)",
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    add_strict(p)  # the warnings: items left unexercised that --min-coverage let pass
    p.set_defaults(run=run)


def _call_timeout(text: str | None) -> float | str | None:
    """``--call-timeout`` as seconds (``None``: no limit), or what is wrong with it (a str)."""
    if text is None:
        return DEFAULT_CALL_TIMEOUT
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        return f"--call-timeout: {text!r} is not a number of seconds above 0, nor 'none' (no limit)"
    return value


def _stop_stuck(problem: str) -> None:
    """A driver call that ignored its interrupt: say so and end the process (the call cannot be unwound).

    Called from the call timer's watchdog thread while the main thread is stuck in the driver, so it writes
    straight to file descriptor 2 (no lock the stuck thread could hold) and leaves without unwinding.
    """
    os.write(2, f"✗ the driver failed: {problem}; kvfsm test stopped here\n".encode())
    os._exit(EXIT_FINDINGS)


def _hypothesis_home() -> None:
    """Keep Hypothesis' files (its constants cache; kvfsm keeps no example database) out of the working directory:
    under $HYPOTHESIS_STORAGE_DIRECTORY if set, else $XDG_CACHE_HOME/kvfsm/hypothesis (~/.cache/kvfsm/hypothesis)."""
    from hypothesis.configuration import set_hypothesis_home_dir

    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        return
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    set_hypothesis_home_dir(cache / "kvfsm" / "hypothesis")


def run(args: argparse.Namespace) -> int:
    from ..testing.calls import DriverError

    timeout = _call_timeout(args.call_timeout)
    if isinstance(timeout, str):
        err.print(f"[red]kvfsm test: {escape(timeout)}[/]")
        return EXIT_USAGE
    args.call_timeout_given, args.call_timeout = args.call_timeout is not None, timeout
    _hypothesis_home()
    try:
        return _run(args)
    except DriverError as exc:  # a factory that raised or hung in a trace replay: the driver's, a finding
        out.print(f"[red]✗ the driver failed: {escape(str(exc))}[/]")
        return EXIT_FINDINGS


def _run(args: argparse.Namespace) -> int:
    from ..gen.diagram import to_svg
    from ..spec import load
    from ..spec.system import is_system_file
    from ..testing.bar import Bar, load_exemptions
    from ..testing.runner import STEPS, load_factory
    from ..testing.runner import run as run_machine

    if args.trace is not None:
        return _replay(args)
    if args.spec.is_file() and is_system_file(args.spec):
        return _cover_system(args)
    spec = load(args.spec)
    plain = [d for d in args.driver if "=" not in d]
    named = dict(d.split("=", 1) for d in args.driver if "=" in d)
    if len(plain) != 1 or len(named) != len(args.driver) - 1 or set(named) - set(spec.owns):
        names = ", ".join(spec.owns)
        err.print(
            "[red]kvfsm test: give one --driver MODULE:FACTORY for a machine spec"
            + (f", and --driver NAME=MODULE:FACTORY for what it owns (NAME: {escape(names)})" if names else "")
            + " (ROLE=MODULE:FACTORY is for a system file)[/]"
        )
        return EXIT_USAGE
    driver = plain[0]
    child = _owned_spec(args.spec, spec)
    if isinstance(child, str):
        err.print(f"[red]kvfsm test: {escape(child)}[/]")
        return EXIT_USAGE
    exempt = load_exemptions(args.exempt).get(spec.name, {}) if args.exempt is not None else {}
    factory = load_factory(driver)  # after every file is read: importing a driver may take seconds
    owned: tuple[Spec, OwnedFactory] | None = None
    if child is not None:
        ref = named.get(child[0])
        owned = (child[1], cast("OwnedFactory", load_factory(ref)) if ref is not None else _ledger(child[1]))
        args.owned_driver = f"{child[0]}={ref}" if ref is not None else None
    bar = Bar(args.min_coverage if args.min_coverage is not None else 1.0, exempt)
    with _progress(spec.name) as shown:
        report = run_machine(
            spec,
            factory,
            examples=args.examples,
            seed=args.seed,
            steps=args.steps or STEPS,
            bar=bar,
            call_timeout=args.call_timeout,
            on_stuck=_stop_stuck,
            on_example=shown,
            owned=owned,
        )
    svg_note = ""
    if args.coverage_svg is not None:
        data = to_svg(spec, coverage=report.coverage.taken())
        write_output(args.coverage_svg, data, "--coverage-svg")
        svg_note = str(args.coverage_svg)
    if args.format == "json":
        doc = {"driver": driver, **report.as_dict(), "coverage_svg": svg_note or None}
        out.print_json(json.dumps(doc))
    else:
        _render(args, driver, report)
        if svg_note:
            out.print(f"coverage diagram: {escape(svg_note)}")
    gaps = report.verdict.gaps if report.verdict is not None else ()
    return EXIT_OK if report.passed and not (args.strict and gaps) else EXIT_FINDINGS


def _owned_spec(path: Path, spec: Spec) -> tuple[str, Spec] | str | None:
    """``(owns: name, spec)`` of the machine ``spec`` owns, read from beside it (``<machine>.yaml``, else the
    file there whose ``machine:`` names it); None if it owns nothing; what is wrong, as a str."""
    from ..spec import load

    if not spec.owns:
        return None
    if len(spec.owns) > 1:
        return f"{spec.name} owns {', '.join(spec.owns)}; kvfsm test follows one owns: entry, test each on its own"
    rule = next(iter(spec.owns.values()))
    here = path.resolve().parent
    candidates = [here / f"{rule.machine}.yaml", *sorted(here.glob("*.yaml"))]
    for candidate in candidates:
        if candidate.is_file() and candidate.resolve() != path.resolve() and _names(candidate, rule.machine):
            return rule.name, load(candidate)
    return (
        f"{spec.name} owns instances of {rule.machine} ('owns: {rule.name}'), whose spec kvfsm test looks for beside "
        f"it: put it in {here / (rule.machine + '.yaml')}"
    )


def _names(path: Path, machine: str) -> bool:
    """Whether the spec file at ``path`` declares ``machine: <machine>`` (read without loading it)."""
    import re

    return re.search(rf"^machine:\s*{re.escape(machine)}\s*(#.*)?$", path.read_text(errors="replace"), re.M) is not None


def _ledger(spec: Spec) -> OwnedFactory:
    """The owned machine's drivers when none is given: ledgers of its actions (the family's rules still run)."""
    from ..testing import LedgerDriver

    return lambda _parent: LedgerDriver(spec)


@contextmanager
def _progress(name: str) -> Iterator[Callable[[int, int], None] | None]:
    """Examples run so far, as a rich bar on stderr when stderr is a terminal (and it clears when done); nothing
    otherwise, so a log or a pipe gets the verdict alone."""
    if not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(f"kvfsm test {name}: examples", total=None)

        def shown(n: int, of: int) -> None:
            progress.update(task, completed=n - 1, total=of)

        yield shown


def _render(args: argparse.Namespace, driver: str, report: Report) -> None:
    budget = (
        f"seed {report.seed}, {report.coverage.examples} example(s) of up to {report.steps} steps, "
        f"{report.planned} of them planned"
    )
    if report.driver_error:
        out.print(f"[red]✗ {escape(report.spec.name)}: the driver failed: {escape(report.driver_error)}[/] ({budget})")
        for line in report.story:
            out.print(f"  {escape(line)}")
        if report.found_by:
            out.print(f"  [dim](in the planned example for {escape(report.found_by)})[/]")
        out.print(f"[dim]repeat with: {escape(shlex.join(_again(args, driver, report)))}[/]")
    elif not report.diverged:
        verdict = report.verdict
        if report.passed:
            out.print(f"[green]✓ {escape(report.spec.name)}: the driver kept to the spec[/] ({budget})")
        else:
            out.print(
                f"[red]✗ {escape(report.spec.name)}: the driver kept to the spec, but the run left part of it "
                f"unexercised[/] ({budget})"
            )
        for gap in verdict.gaps if verdict is not None else ():
            mark = "[yellow]not reached[/]" if report.passed else "[red]not reached[/]"
            out.print(f"  {mark} {escape(gap.name)}: {escape(gap.why)}")
        for gap, reason in verdict.exempted if verdict is not None else ():
            out.print(f"  [dim]exempt {escape(gap.name)}: {escape(reason)}[/]")
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
        if report.found_by:
            out.print(f"  [dim](found by the planned example for {escape(report.found_by)})[/]")
        out.print(f"[dim]repeat with: {escape(shlex.join(_again(args, driver, report)))}[/]")
    _coverage(report)


def _again(args: argparse.Namespace, driver: str, report: Report) -> list[str]:
    """The command line that repeats this run exactly."""
    again = ["kvfsm", "test", str(args.spec), "--driver", driver, "--seed", str(report.seed)]
    if getattr(args, "owned_driver", None):
        again[5:5] = ["--driver", args.owned_driver]
    if args.examples:
        again += ["--examples", str(args.examples)]
    if args.call_timeout_given:
        again += ["--call-timeout", f"{args.call_timeout:g}" if args.call_timeout is not None else "none"]
    return again


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
    for phase, event, fired, moved in cov.phase_timeouts():
        mark = f"fired {fired}×, {moved} after moves inside it" if fired else "[red]never fired[/]"
        out.print(f"deadline of phase {escape(phase)} ({escape(event)}): {mark}")
    summary = cov.summary()
    names = {"edges": "edges", "timeouts": "deadlines", "ignored": "ignored pairs"}
    parts = [f"{names[k]} {done}/{total}" for k, (done, total) in summary.items() if total]
    if cov.expiries:
        moved = sum(cov.expiries_after_moves.values())
        parts.append(f"phase expiries {sum(cov.expiries.values())} ({moved} after moves inside)")
    parts += [f"{kind} {n}" for kind, n in sorted(cov.arrivals.items())]
    faults = ", ".join(f"{a} {n}" for a, n in sorted(cov.faults.items())) or "none"
    out.print(f"exercised: {' · '.join(parts)} · injected faults: {escape(faults)}")
    if report.owned is not None:
        owned = report.owned
        parts = [f"{names[k]} {done}/{total}" for k, (done, total) in owned.summary().items() if total]
        faults = ", ".join(f"{a} {n}" for a, n in sorted(owned.faults.items())) or "none"
        out.print(
            f"owned {escape(owned.spec.name)} (reported, not judged: its own kvfsm test plans its cover): "
            f"{' · '.join(parts)} · injected faults: {escape(faults)}"
        )


# -- --trace: an explorer trace replayed on drivers -------------------------------------------


def _replay(args: argparse.Namespace) -> int:
    from ..explore import check_sizes, read_trace
    from ..spec.system import is_system_file
    from ..testing.trace_replay import replay_trace

    options = ("examples", "steps", "seed", "coverage_svg", "min_coverage", "exempt")
    if _given(args, options, "--trace, which replays one fixed run"):
        return EXIT_USAGE
    if args.spec.is_file() and not is_system_file(args.spec):
        err.print(
            f"[red]kvfsm test: --trace replays a composition's trace, so {escape(str(args.spec))} must be a system "
            "file (with 'system:' and 'roles:'), such as the one 'kvfsm explore' wrote the trace from[/]"
        )
        return EXIT_USAGE
    from ..spec.system import load_system

    system = load_system(args.spec)
    check_sizes(system, None)  # a size too big to build says so first, before anything is expanded
    trace = read_trace(args.trace)  # before importing drivers, which may take seconds
    roles = _role_drivers(args, "with --trace")
    if roles is None:
        return EXIT_USAGE
    system, refs, factories = roles
    result = replay_trace(system, trace, factories, call_timeout=args.call_timeout, on_stuck=_stop_stuck)
    drivers = _driven_by(system, result.drivers, refs)
    if args.format == "json":
        out.print_json(json.dumps({"trace": str(args.trace), **result.as_dict(), "drivers": drivers}))
    else:
        _render_replay(result, drivers)
    return EXIT_OK if result.passed else EXIT_FINDINGS


def _given(args: argparse.Namespace, options: tuple[str, ...], mode: str) -> bool:
    """Whether any of ``options`` was given, which ``mode`` has no use for; says so if one was."""
    given = [f"--{name.replace('_', '-')}" for name in options if getattr(args, name) is not None]
    if given:
        verb = "does" if len(given) == 1 else "do"
        err.print(f"[red]kvfsm test: {', '.join(given)} {verb} not apply to {mode}[/]")
    return bool(given)


def _driven_by(system: System, drove: Mapping[str, str], refs: Mapping[str, str]) -> dict[str, str]:
    """role → what drove it, with the ``--driver`` reference it came from."""
    return {role: f"{drove[role]} ({refs[role]})" if role in refs else drove[role] for role in system.roles}


def _role_drivers(
    args: argparse.Namespace, mode: str
) -> tuple[System, dict[str, str], dict[str, DriverFactory]] | None:
    """The system file and its ``ROLE=MODULE:FACTORY`` options: (system, role → reference, role → factory);
    ``None`` after a usage error."""
    from ..spec.system import load_system
    from ..testing.runner import load_factory

    system = load_system(args.spec)
    refs: dict[str, str] = {}
    for text in args.driver:
        role, sep, ref = text.partition("=")
        if not sep or not role or not ref:
            err.print(
                f"[red]kvfsm test: --driver {escape(text)!r} names no role; {mode} write ROLE=MODULE:FACTORY, "
                f"e.g. --driver {escape(next(iter(system.roles)))}=my_drivers:make (roles: {escape(', '.join(system.roles))})[/]"
            )
            return None
        if role not in system.roles:
            err.print(
                f"[red]kvfsm test: --driver {escape(text)}: {escape(system.name)} has no role {escape(role)!r} "
                f"(its roles: {escape(', '.join(system.roles))})[/]"
            )
            return None
        if role in refs:
            err.print(f"[red]kvfsm test: two --driver options for role {escape(role)!r}; give one per role[/]")
            return None
        refs[role] = ref
    return system, refs, {role: load_factory(ref) for role, ref in refs.items()}


def _render_replay(result: TraceResult, drivers: dict[str, str]) -> None:
    from ..explore.trace import describe_step

    trace = result.trace
    on = ", ".join(f"{role}: {name}" for role, name in drivers.items())
    out.print(
        f"replaying {escape(trace.prop)} ({escape(trace.system)}, {len(trace.moves)} steps) "
        f"on {escape(result.system)}; {escape(on)}"
    )
    rows = [("#", "req", "role", "step", "called", "observe", "")]
    for s in result.steps:
        what = f"begin → {s.step.target}" if s.step.action == "begin" else describe_step(s.step)
        seen = (", ".join(s.observed) or "nothing") if s.observed is not None else "—"
        mark = "✓" if s.mismatch is None else "✗"
        rows.append((str(s.number or ""), s.step.request, s.step.role, what, s.call, seen, mark))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for n, row in enumerate(rows):
        line = "  ".join(c.rjust(w) if i == 0 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        done = result.steps[n - 1] if n else None
        style = "dim" if done is None else "red" if done.mismatch is not None else ""
        out.print(f"[{style}]{escape(line.rstrip())}[/]" if style else escape(line.rstrip()))
        if done is not None and done.mismatch is not None:
            m = done.mismatch
            pad = " " * (sum(widths[:3]) + 6)
            out.print(f"{pad}[red]{escape(m.what)}: expected {escape(m.expected)}, got {escape(m.actual)}[/]")
    left = len(trace.steps) - len(result.steps)
    if left:
        out.print(f"[dim]{left} step(s) not replayed[/]")
    if result.reproduced:
        out.print(f"[green]✓ {escape(result.summary)}[/]")
    elif result.verdict == "not reproduced":
        out.print(f"[red]✗ {escape(result.summary)}[/]")
    else:
        out.print(f"[red]✗ the drivers diverged from the trace at {escape(str(result.mismatch))}[/]")


# -- a system file: its trace set replayed on drivers -------------------------------------------


def _cover_system(args: argparse.Namespace) -> int:
    from ..testing.bar import Bar, load_exemptions
    from ..testing.trace_set import cover_system

    options = ("examples", "steps", "seed", "coverage_svg")
    if _given(args, options, "a system file, whose trace set is fixed by the system (no examples, no seed)"):
        return EXIT_USAGE
    exemptions = load_exemptions(args.exempt) if args.exempt is not None else {}  # before importing drivers
    roles = _role_drivers(args, "for a system file")
    if roles is None:
        return EXIT_USAGE
    system, refs, factories = roles
    exempt = exemptions.get(system.name, {})
    bar = Bar(args.min_coverage if args.min_coverage is not None else 1.0, exempt)
    result = cover_system(system, factories, bar=bar, call_timeout=args.call_timeout, on_stuck=_stop_stuck)
    drivers = _driven_by(system, result.drivers, refs)
    if args.format == "json":
        out.print_json(json.dumps({**result.as_dict(), "drivers": drivers}))
    else:
        _render_system(result, drivers)
    return EXIT_OK if result.passed and not (args.strict and result.gaps) else EXIT_FINDINGS


def _render_system(result: SystemCoverage, drivers: dict[str, str]) -> None:
    on = ", ".join(f"{role}: {name}" for role, name in drivers.items())
    moves = sum(len(r.trace.moves) for r in result.runs)
    traces = (
        f"{len(result.runs) + result.skipped} traces ({len(result.runs)} replayed)"
        if result.skipped
        else (f"{len(result.runs)} traces")
    )
    out.print(
        f"trace set of {escape(result.system)}: {traces}, {moves} steps, for "
        f"{len(result.reachable)} reachable items; {escape(on)}"
    )
    for n, r in enumerate(result.runs, 1):
        if r.mismatch is None:
            out.print(f"  ✓ #{n} {escape(r.goal.name)} ({len(r.trace.moves)} steps)")
        else:
            out.print(f"  [red]✗ #{n} {escape(r.goal.name)}: diverged at {escape(str(r.mismatch))}[/]")
    unreplayed = [item for item, why in result.gaps if why.startswith("not replayed")]
    for item, why in result.gaps:
        if not why.startswith("not replayed"):
            mark = "[yellow]not reached[/]" if result.cleared else "[red]not reached[/]"
            out.print(f"  {mark} {escape(item.name)}: {escape(why)}")
    if unreplayed:
        out.print(f"  [red]not reached[/] {len(unreplayed)} more item(s), in traces not replayed")
    for item, reason in result.exempted:
        out.print(f"  [dim]exempt {escape(item.name)}: {escape(reason)}[/]")
    if result.skipped:
        out.print(f"  [red]{result.skipped} trace(s) not replayed: a driver call hung, which ended the run[/]")
    if result.unreachable:
        names = ", ".join(i.name for i in result.unreachable)
        out.print(f"  [dim]no run of the system reaches (not required): {escape(names)}[/]")
    name = escape(result.system)
    if result.passed:
        out.print(f"[green]✓ {name}: {escape(result.summary())}[/]")
    elif result.diverged:
        out.print(f"[red]✗ {name}: the drivers diverged from the trace set: {escape(result.summary())}[/]")
    else:
        out.print(f"[red]✗ {name}: the drivers kept to every trace, but {escape(result.summary())}[/]")
