"""pytest integration: model-based tests for a folder of specs, in one line.

In a test module (no plugin needed)::

    from kvfsm.testing.plugin import spec_tests
    test_specs = spec_tests("../specs", drivers={"kv_request": make_kv_driver})

collects one test per spec file. Or, with this module loaded as a pytest
plugin (``-p kvfsm.testing.plugin``, ``pytest_plugins`` in a conftest, or the
package's ``pytest11`` entry point), a line of pytest configuration::

    [tool.pytest.ini_options]
    kvfsm_specs = ["specs/*.yaml = my_connector.testing:make_driver"]

makes every matching spec file pytest visits a test item (so the folder must
be under a path pytest collects, e.g. ``testpaths = ["tests", "specs"]``).
Either way a test is one :func:`kvfsm.testing.run`, the same as ``kvfsm
test``, coverage verdict included: an edge, deadline or ignore rule never
exercised fails the test unless ``min_coverage`` or an exemption file
(``exempt=`` or the ``kvfsm_exempt`` ini option) lowers the bar.
``--kvfsm-examples N`` and ``--kvfsm-seed S`` turn it into a long campaign or
a repeat. Loaded but not configured, the plugin does nothing.
"""

from __future__ import annotations

import fnmatch
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from ..spec import load
from .bar import Bar, load_exemptions
from .contract import DriverFactory
from .runner import RunReport, load_factory, run

Drivers = Mapping[str, DriverFactory | str] | DriverFactory | str
"""One factory (or ``"MODULE:FACTORY"``) for every spec, or one per machine name or file stem."""

INI = "kvfsm_specs"
EXEMPT_INI = "kvfsm_exempt"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        INI,
        type="linelist",
        default=[],
        help="kvfsm model-based tests: lines 'GLOB = MODULE:FACTORY' (GLOB relative to the rootdir)",
    )
    parser.addini(
        EXEMPT_INI,
        type="string",
        default="",
        help="kvfsm model-based tests: a YAML exemption file (machine → {edge name: reason}), relative to the rootdir",
    )
    group = parser.getgroup("kvfsm", "kvfsm model-based tests")
    group.addoption("--kvfsm-examples", type=int, default=None, metavar="N", help="examples per spec (default 100)")
    group.addoption("--kvfsm-seed", type=int, default=None, metavar="S", help="seed, to repeat a run exactly")
    group.addoption(
        "--kvfsm-min-coverage",
        type=float,
        default=None,
        metavar="PERCENT",
        help="pass with only this share of edges, deadlines and ignore rules exercised (default 100)",
    )


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """A spec file that a ``kvfsm_specs`` line matches becomes a collector of one test."""
    lines = parent.config.getini(INI)
    if not lines or file_path.suffix not in (".yaml", ".yml"):
        return None
    root = parent.config.rootpath
    try:
        relative = file_path.relative_to(root).as_posix()
    except ValueError:
        return None
    for line in lines:
        pattern, factory = _parse_line(line)
        if fnmatch.fnmatch(relative, pattern):
            spec_file: SpecFile = SpecFile.from_parent(parent, path=file_path, factory=factory)
            return spec_file
    return None


def _parse_line(line: str) -> tuple[str, str]:
    pattern, sep, factory = line.partition("=")
    if not sep or not pattern.strip() or not factory.strip():
        raise pytest.UsageError(
            f"{INI} line {line!r} is not 'GLOB = MODULE:FACTORY'; e.g. 'specs/*.yaml = my_pkg.testing:make_driver'"
        )
    return pattern.strip(), factory.strip()


class SpecFile(pytest.File):
    """A spec file collected through ``kvfsm_specs``: one model-based test of its driver."""

    def __init__(self, *, factory: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factory = factory

    def collect(self) -> Iterable[pytest.Item]:
        yield SpecItem.from_parent(self, name=f"model[{self.path.stem}]", factory=self.factory)


class SpecFailed(Exception):
    """A model-based run that failed; carries its report for :meth:`SpecItem.repr_failure`."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SpecItem(pytest.Item):
    def __init__(self, *, factory: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.factory = factory

    def runtest(self) -> None:
        factory = load_factory(self.factory, search=self.config.rootpath)
        exempt = self.config.getini(EXEMPT_INI)
        report = _run(self.path, factory, self.config, exempt=self.config.rootpath / exempt if exempt else None)
        if not report.passed:
            raise SpecFailed(failure_text(report))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, SpecFailed):
            return excinfo.value.message
        return str(super().repr_failure(excinfo, style))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"kvfsm model test of {self.path.name} with {self.factory}"


def spec_tests(
    specs: str | Path | Iterable[str | Path],
    drivers: Drivers,
    *,
    examples: int | None = None,
    seed: int | None = None,
    min_coverage: float = 1.0,
    exempt: str | Path | Mapping[str, Mapping[str, str]] | None = None,
) -> Callable[..., None]:
    """A pytest test function with one case per spec file: assign it to a ``test_*`` name.

    ``specs``: spec files, folders (every ``*.yaml`` in them) or globs, relative
    to the calling module's folder. ``drivers``: see :data:`Drivers`.
    ``min_coverage`` (0 to 1) and ``exempt`` (an exemption file, relative to
    the module's folder, or machine → {name: reason}) lower the coverage bar.
    """
    caller = Path(sys._getframe(1).f_globals.get("__file__", "."))
    base = caller.resolve().parent
    paths = _spec_paths(specs, base)
    exemptions = exempt if exempt is None or isinstance(exempt, Mapping) else base / exempt

    @pytest.mark.parametrize("kvfsm_spec", paths, ids=[p.stem for p in paths])
    def test_spec_model(kvfsm_spec: Path, request: pytest.FixtureRequest) -> None:
        spec = load(kvfsm_spec)
        factory = _driver_for(drivers, spec.name, kvfsm_spec)
        report = _run(kvfsm_spec, factory, request.config, examples, seed, min_coverage, exemptions)
        if not report.passed:
            pytest.fail(failure_text(report), pytrace=False)

    return test_spec_model


def _spec_paths(specs: str | Path | Iterable[str | Path], base: Path) -> list[Path]:
    items = [specs] if isinstance(specs, str | Path) else list(specs)
    paths: list[Path] = []
    for item in items:
        path = base / item
        if path.is_dir():
            found = sorted([*path.glob("*.yaml"), *path.glob("*.yml")])
        elif any(c in str(item) for c in "*?["):
            found = sorted(base.glob(str(item)))
        else:
            found = [path]
        if not found:
            raise FileNotFoundError(f"kvfsm spec_tests: {item!r} names no spec file (looked in {base})")
        paths += found
    return paths


def _driver_for(drivers: Drivers, machine: str, path: Path) -> DriverFactory:
    chosen: DriverFactory | str
    if isinstance(drivers, Mapping):
        found = drivers.get(machine, drivers.get(path.stem))
        if found is None:
            known = ", ".join(map(repr, drivers)) or "none"
            pytest.fail(
                f"no driver for machine {machine!r} ({path}); add it to drivers= (given: {known})", pytrace=False
            )
        chosen = found
    else:
        chosen = drivers
    return load_factory(chosen) if isinstance(chosen, str) else chosen


def _run(
    path: Path,
    factory: DriverFactory,
    config: pytest.Config,
    examples: int | None = None,
    seed: int | None = None,
    min_coverage: float = 1.0,
    exempt: Path | Mapping[str, Mapping[str, str]] | None = None,
) -> RunReport:
    option_examples = config.getoption("kvfsm_examples", default=None)
    option_seed = config.getoption("kvfsm_seed", default=None)
    option_bar = config.getoption("kvfsm_min_coverage", default=None)
    spec = load(path)
    exemptions = load_exemptions(exempt) if isinstance(exempt, Path) else exempt or {}
    bar = Bar(option_bar / 100 if option_bar is not None else min_coverage, dict(exemptions.get(spec.name, {})))
    return run(
        spec,
        factory,
        examples=option_examples if option_examples is not None else examples,
        seed=option_seed if option_seed is not None else seed,
        bar=bar,
    )


def failure_text(report: RunReport) -> str:
    """The failing story (or what the run never exercised) as pytest shows it, with how to repeat the run."""
    if not report.diverged and report.verdict is not None:
        lines = [
            f"{report.spec.path}: the driver kept to spec {report.spec.name!r}, but the run left part of it unexercised:"
        ]
        lines += [f"  not reached: {g.name}: {g.why}" for g in report.verdict.gaps]
        lines.append("exercise it, or exempt it on purpose (exempt=, kvfsm_exempt, or --kvfsm-min-coverage)")
        return "\n".join(lines)
    run = f"seed {report.seed}, failed in example {report.coverage.examples} of {report.examples}"
    if report.driver_error:  # its factory raised, or a call hung: the driver's own failure, no divergence
        lines = [f"{report.spec.path}: the driver failed ({run}): {report.driver_error}"]
        lines += [f"  {line}" for line in report.story]
        lines.append(f"repeat with --kvfsm-seed {report.seed} (or kvfsm test ... --seed {report.seed})")
        return "\n".join(lines)
    lines = [f"{report.spec.path}: the driver diverged from spec {report.spec.name!r} ({run}):"]
    lines += [f"  {line}" for line in report.story] or [f"  {report.error}"]
    lines.append(f"repeat with --kvfsm-seed {report.seed} (or kvfsm test ... --seed {report.seed})")
    return "\n".join(lines)
