"""Run a generated state machine once, as ``kvfsm test`` and the pytest helpers do, and report.

One implementation for every front end: :func:`run` checks the driver once up
front (so a missing method is an error, not a hundred failing examples), runs
the path cover (planned examples that take every edge, deadline, ignore rule
and fault point), then Hypothesis with a known seed and no example database
(so a run is reproduced by its seed alone), judges the coverage against the
bar, and returns a :class:`RunReport` that the CLI renders and the pytest helpers
turn into a failure.
"""

from __future__ import annotations

import importlib
import random
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, reporting
from hypothesis import seed as use_seed
from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test

from ..engine import Tracker
from ..spec import Spec, load
from .bar import Bar, Verdict, check_exemptions, judge
from .calls import CallTimer, DriverError, DriverFault, Factory
from .calls import FactoryError as FactoryError  # its home before calls.py; importers keep working
from .contract import DriverFactory, ObservableDriver, OwnedFactory, can_inject_faults
from .cover import TraceStep, blocked_edges, path_cover
from .coverage import Coverage
from .family import FamilyMachine, engine_edges, family_cover, with_children
from .machine import KEYS, BudgetSpent, SpecMachine, check_driver, fault_targets, spec_machine
from .oracle import Move
from .story import SpecViolation

STEPS = 50
"""Steps per example (Hypothesis' own default for stateful tests)."""


@dataclass(frozen=True)
class RunReport:
    """The result of one run: passed or the failing story, the seed that reproduces it, the coverage.

    ``passed`` needs both: the driver kept to the spec, and the coverage cleared
    the bar (:attr:`verdict`).
    """

    spec: Spec
    passed: bool
    seed: int
    examples: int
    """The example budget (Hypothesis stops early only on a failure)."""
    steps: int
    coverage: Coverage
    story: tuple[str, ...] = ()
    """The shrunk failing example, one line per step; the last ends with what went wrong."""
    problems: tuple[str, ...] = ()
    """What went wrong, alone (the end of the story's last line)."""
    error: str = ""
    """Why it failed, when that is not a divergence with a story (e.g. a flaky driver)."""
    verdict: Verdict | None = None
    """What was never exercised and whether that clears the bar (None: a divergence ended the run first)."""
    planned: int = 0
    """Planned examples of the path cover that ran (they count among :attr:`coverage`'s examples)."""
    found_by: str = ""
    """The goal of the planned example that found the failure ("" if a random example did)."""
    driver_error: str = ""
    """The driver failed at run time (its factory raised, a call hung): which call of which object, and how.
    Set with :attr:`error`; :attr:`story` is then the example up to that call."""
    moved: tuple[tuple[Move, ...], ...] = ()
    """The transitions each line of :attr:`story` made, line by line (``kvfsm inspect --story`` draws them)."""
    owned: Coverage | None = None
    """The owned machine's coverage, when the spec owns one and its driver was given (``owned``); reported, not
    judged: the bar is the tested spec's, and the owned machine's own run (``kvfsm test`` of its spec) plans its
    cover."""

    @property
    def diverged(self) -> bool:
        """The driver (or the Tracker) disagreed with the spec, as opposed to falling short of the coverage bar."""
        return bool(self.story or self.error)

    def as_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.path,
            "machine": self.spec.name,
            "passed": self.passed,
            "seed": self.seed,
            "examples": self.examples,
            "steps": self.steps,
            "planned": self.planned,
            "failure": None
            if not self.diverged
            else {
                "story": list(self.story),
                "moves": [
                    [{"key": str(m.key), "event": m.event, "from": m.source, "to": m.target} for m in moves]
                    for moves in self.moved
                ],
                "problems": list(self.problems),
                "error": self.error,
                "found_in_example": self.coverage.examples,
                "found_by": self.found_by or None,
                "driver_error": self.driver_error or None,
            },
            "coverage": self.coverage.as_dict(),
            "coverage_verdict": self.verdict.as_dict() if self.verdict is not None else None,
            "owned_coverage": self.owned.as_dict() if self.owned is not None else None,
        }


def load_factory(ref: str, search: Path | None = None) -> DriverFactory:
    """Resolve ``MODULE:FACTORY`` (``FACTORY`` may be dotted), importing from ``search`` (default: the current directory)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise FactoryError(
            f"--driver {ref!r} is not MODULE:FACTORY; write e.g. --driver my_drivers:make_driver, where "
            "my_drivers.py is importable from the current directory and make_driver() returns a fresh driver"
        )
    cwd = str(search if search is not None else Path.cwd())
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise FactoryError(
            f"cannot import driver module {module_name!r} (searched {cwd} and sys.path): {exc}"
        ) from None
    except Exception as exc:
        raise FactoryError(f"importing driver module {module_name!r} raised {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"module {module_name!r} has no {attr!r} (looked for {part!r}); check --driver {ref}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"{ref} is a {type(obj).__name__}, not a callable that returns a driver")
    factory: DriverFactory = obj
    return factory


def probe(spec: Spec, factory: DriverFactory | Factory, params: Mapping[str, float] | None = None) -> ObservableDriver:
    """Make one driver and bind it, so a bad driver fails once, clearly, before any example runs; returns it.

    Raises :class:`DriverError` if the factory raises (or, timed, hangs), and
    BindingError if the driver lacks what the spec and the test need.
    """
    made = factory if isinstance(factory, Factory) else Factory(factory)
    driver: ObservableDriver = made.make("to check the driver before any example")
    Tracker(spec, driver, params=params).close()  # BindingError names every missing action
    check_driver(spec, driver)
    return driver


def run(
    spec: Spec | str | Path,
    factory: DriverFactory,
    *,
    examples: int | None = None,
    seed: int | None = None,
    steps: int = STEPS,
    params: Mapping[str, float] | None = None,
    keys: int = KEYS,
    bar: Bar | None = None,
    cover: bool = True,
    call_timeout: float | None = None,
    on_stuck: Callable[[str], None] | None = None,
    on_example: Callable[[int, int], None] | None = None,
    owned: tuple[Spec | str | Path, OwnedFactory] | None = None,
) -> RunReport:
    """Model-test the drivers ``factory`` makes against ``spec``; returns a :class:`RunReport`.

    ``examples`` is the whole run, exactly, by default the current Hypothesis
    profile's ``max_examples`` (100 unless a profile says otherwise): the path
    cover's planned examples first, then random ones for the rest (at least
    one; the plan is never cut short, so a run is at least the planned examples
    and one more), so covering every edge costs no more than the random run alone; ``seed`` defaults to a random one, reported so the run can be
    repeated exactly. ``bar`` is the coverage the run must reach (default:
    everything); ``cover=False`` runs the random examples alone, with no plan
    (what the generator did before it had a path cover: for comparisons).

    ``call_timeout`` (seconds) bounds each call into the driver: the factory,
    ``observe``, a hook, a Tracker call running its actions
    (:class:`~kvfsm.testing.calls.CallTimer`; main thread only). A driver that
    fails at run time (its factory raises, on the first call or a later one,
    or a call does not return in time) ends the run with a failing report
    whose :attr:`RunReport.driver_error` names the call; ``on_stuck`` is called
    instead for a call that does not stop even when interrupted. ``on_example(n, of)``
    is called as example ``n`` of ``of`` starts (progress).

    ``owned``: for a spec that owns another machine (``owns:``), that
    machine's spec and a factory of its drivers, called with the parent's
    driver of the same example. Both drivers are then tested
    together, with the family rules (:mod:`kvfsm.testing.family`); the
    report's coverage is the parent's, :attr:`RunReport.owned` the child's.
    """
    if not isinstance(spec, Spec):
        spec = load(spec)
    bar = bar if bar is not None else Bar()
    check_exemptions(Coverage(spec), bar.exempt)
    chosen = seed if seed is not None else random.SystemRandom().randrange(2**32)
    made = Factory(factory, CallTimer(call_timeout, on_stuck=on_stuck))
    child = None
    if owned is not None:
        child_spec = owned[0] if isinstance(owned[0], Spec) else load(owned[0])
        child = (child_spec, Factory(owned[1], made.timer))
    try:
        driver = probe(spec, made, params)
        if child is not None:
            parent_driver = driver
            child_driver = probe(child[0], Factory(lambda: child[1].factory(parent_driver), made.timer))
    except DriverError as exc:
        failed = DriverFault(str(exc))
        return _driver_failed(spec, chosen, examples, steps, Coverage(spec), failed, 0)
    machine = spec_machine(spec, made, params=params, keys=keys, steer=cover, owned=child)
    machine.call_timer = made.timer
    machine.blocked = blocked_edges(spec, driver) | (engine_edges(spec) if child is not None else {})
    budget = examples if examples is not None else Settings().max_examples
    faults = fault_targets(spec) if can_inject_faults(driver) else ()
    plans = path_cover(spec, params, machine.keys, blocked=machine.blocked, faults=faults) if cover else []
    if issubclass(machine, FamilyMachine):
        plans = [with_children(machine, plan) for plan in plans]
        if cover and child is not None:
            child_faults = fault_targets(child[0]) if can_inject_faults(child_driver) else ()
            plans += family_cover(machine, machine.blocked, child_faults, faults)
    total = max(budget, len(plans) + 1)
    machine.on_example = (lambda n: on_example(n, total)) if on_example is not None else None
    config = Settings(
        max_examples=total - len(plans),
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        print_blob=False,
        phases=(Phase.explicit, Phase.generate),
    )
    try:
        for n, plan in enumerate(plans, 1):
            found = play(machine, plan.steps)
            if found is not None:
                found = tidy(machine, found)
                return RunReport(
                    spec, False, chosen, budget, steps, machine.coverage, found.story, found.problems, str(found),
                    planned=n, found_by=plan.goal, moved=found.moved,
                )  # fmt: skip
        machine.limit, machine.failed = total, False
        try:
            try:
                with reporting.with_reporter(_silent):
                    run_state_machine_as_test(use_seed(chosen)(machine), settings=config)
            finally:  # tidying replays an example: outside the budget, and not progress
                machine.limit, machine.on_example = None, None
        except BudgetSpent:  # every example asked for has run
            pass
        except SpecViolation as exc:
            exc = tidy(machine, exc)
            return RunReport(
                spec, False, chosen, budget, steps, machine.coverage, exc.story, exc.problems, str(exc),
                planned=len(plans), moved=exc.moved,
            )  # fmt: skip
        except Exception as exc:  # Hypothesis' own verdicts (e.g. a driver that does not repeat itself)
            error = f"{type(exc).__name__}: {exc}"
            return RunReport(spec, False, chosen, budget, steps, machine.coverage, error=error, planned=len(plans))
    except DriverFault as fault:  # from an example, or a replay while tidying: the driver's own failure
        return _driver_failed(spec, chosen, budget, steps, machine.coverage, fault, len(plans))
    verdict = judge(machine.coverage, bar, machine.blocked)
    owned_coverage = machine.child_coverage if issubclass(machine, FamilyMachine) else None
    return RunReport(
        spec, verdict.cleared, chosen, budget, steps, machine.coverage, verdict=verdict, planned=len(plans),
        owned=owned_coverage,
    )  # fmt: skip


def _driver_failed(
    spec: Spec, seed: int, examples: int | None, steps: int, coverage: Coverage, fault: DriverFault, planned: int
) -> RunReport:
    """The report of a run the driver itself ended (a factory that raised, a call that hung)."""
    budget = examples if examples is not None else Settings().max_examples
    return RunReport(
        spec, False, seed, budget, steps, coverage, fault.story, (fault.problem,), fault.problem,
        planned=planned, driver_error=fault.problem, moved=fault.moved,
    )  # fmt: skip


def play(machine: type[SpecMachine], trace: Sequence[TraceStep]) -> SpecViolation | None:
    """Run ``trace`` on a fresh ``machine``, checking after each step as Hypothesis does; the divergence, if any.

    Counted in ``machine.coverage``, as an example of the run.
    """
    m = machine()
    try:
        for name, args in trace:
            if name != "teardown":
                getattr(m, name)(*args)
                m.agrees_with_spec()
        m.teardown()
    except SpecViolation as exc:
        return exc
    return None


def replay(machine: type[SpecMachine], trace: Sequence[TraceStep]) -> SpecViolation | None:
    """:func:`play` on a copy of ``machine`` that counts its coverage apart (for shrinking, which is no example)."""
    fresh = {"coverage": Coverage(machine.spec)}
    if issubclass(machine, FamilyMachine):
        fresh["child_coverage"] = Coverage(machine.child_spec)
    return play(type(machine.__name__, (machine,), fresh), trace)


def tidy(machine: type[SpecMachine], found: SpecViolation) -> SpecViolation:
    """The shortest story that still shows the same problem.

    Drops steps one at a time, merges consecutive clock moves, then renames
    the keys to ``req-1``, ``req-2``… in order of use, keeping each change
    that replays to the same first problem (numbers aside: block ids, key
    suffixes, times). Replays take milliseconds, so this runs instead of
    Hypothesis' own shrinker, which is slow on long stateful examples and
    cannot delete a step that holds an example's first choice of rules.
    """
    want = _signature(found)
    best = found
    shorter = True
    while shorter:
        shorter = False
        i = 0
        while i < len(best.trace):
            for candidate in _without(best.trace, i):
                got = replay(machine, candidate)
                if got is not None and _signature(got) == want and len(got.trace) < len(best.trace):
                    best, shorter = got, True
                    break
            else:
                i += 1
    renamed = replay(machine, _first_keys(machine.keys, best.trace))
    return renamed if renamed is not None and _signature(renamed) == want else best


def _without(trace: Sequence[TraceStep], i: int) -> Iterator[list[TraceStep]]:
    """Simpler traces around step ``i``: without it, or with it merged into the next clock move."""
    yield [*trace[:i], *trace[i + 1 :]]
    here, after = trace[i], trace[i + 1] if i + 1 < len(trace) else None
    if after is not None and here[0] == after[0] == "advance" and here[1][1] is None:
        dt = float(here[1][0]) + float(after[1][0])  # type: ignore[arg-type]
        yield [*trace[:i], ("advance", (dt, after[1][1])), *trace[i + 2 :]]


def _signature(d: SpecViolation) -> str:
    """The first problem's first clause, numbers blanked: what "the same failure" means to :func:`tidy`."""
    first = d.problems[0].split("; ")[0] if d.problems else ""
    return _NUMBER.sub("#", first)


_NUMBER = re.compile(r"\d+(\.\d+)?")


def _first_keys(keys: Sequence[str], trace: Sequence[TraceStep]) -> list[TraceStep]:
    """The trace with its keys renamed to the first ones, in order of first use."""
    names: dict[object, str] = {}
    for _name, args in trace:
        for a in args:
            if a in keys and a not in names:
                names[a] = keys[len(names)]
    return [(name, tuple(names.get(a, a) if a in names else a for a in args)) for name, args in trace]


def _silent(_text: object) -> None:
    """Hypothesis prints the failing example as Python calls; the RunReport tells it as a story instead."""
