"""What a benchmark run returns: measured rows, pass/fail targets, and a plain-text table of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Row(NamedTuple):
    """One measured figure. ``ratio`` is ``value / value of the row named baseline`` (None if no baseline)."""

    section: str
    name: str
    value: float
    unit: str
    ratio: float | None = None
    baseline: str | None = None
    note: str = ""


class Target(NamedTuple):
    """One acceptance target from the issue, judged on this run's figures."""

    description: str
    measured: float
    threshold: float
    passed: bool

    @classmethod
    def at_most(cls, description: str, measured: float, threshold: float) -> Target:
        return cls(description, measured, threshold, measured <= threshold)


@dataclass
class BenchReport:
    """Everything one ``run()`` measured, on one machine, in one process."""

    quick: bool
    rows: list[Row] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    """Python, platform, CPU count, library versions, and the sizes used."""
    notes: list[str] = field(default_factory=list)
    """Method notes and anything skipped (e.g. python-statemachine not installed)."""
    figures: dict[str, float] = field(default_factory=dict)
    """The headline ratios under stable names (``lifecycle_vs_handwritten``, ``batch_vs_handwritten``, …)."""
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(t.passed for t in self.targets)

    def row(self, name: str) -> Row:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (NaN becomes None)."""

        def num(x: float | None) -> float | None:
            return None if x is None or math.isnan(x) else x

        return {
            "quick": self.quick,
            "passed": self.passed,
            "seconds": self.seconds,
            "environment": dict(self.environment),
            "rows": [{**r._asdict(), "value": num(r.value), "ratio": num(r.ratio)} for r in self.rows],
            "targets": [{**t._asdict(), "measured": num(t.measured)} for t in self.targets],
            "notes": list(self.notes),
            "figures": {name: num(value) for name, value in self.figures.items()},
        }


def fmt_number(value: float) -> str:
    """A figure with as many digits as it deserves."""
    if math.isnan(value):
        return "n/a"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if value < 1 else f"{value:.2f}"


def format_table(report: BenchReport) -> str:
    """The report as plain text: one table of figures, one of targets, then notes."""
    lines: list[str] = []
    width = max((len(r.name) for r in report.rows), default=10)
    section = None
    for r in report.rows:
        if r.section != section:
            section = r.section
            lines.append("")
            lines.append(f"== {section}")
        ratio = f"{fmt_number(r.ratio)}x {r.baseline}" if r.ratio is not None and r.baseline else ""
        lines.append(f"  {r.name:<{width}}  {fmt_number(r.value):>10} {r.unit:<12} {ratio}")
        if r.note:
            lines.append(f"  {'':<{width}}  {r.note}")
    lines.append("")
    lines.append("== targets")
    dwidth = max((len(t.description) for t in report.targets), default=10)
    for t in report.targets:
        mark = "PASS" if t.passed else "FAIL"
        lines.append(f"  {mark}  {t.description:<{dwidth}}  measured {fmt_number(t.measured)}")
    if report.figures:
        lines.append("")
        lines.append("== figures")
        fwidth = max(len(name) for name in report.figures)
        lines.extend(f"  {name:<{fwidth}}  {fmt_number(value)}" for name, value in report.figures.items())
    if report.notes:
        lines.append("")
        lines.append("== notes")
        lines.extend(f"  - {n}" for n in report.notes)
    lines.append("")
    env = ", ".join(f"{k} {v}" for k, v in report.environment.items())
    lines.append(f"{'quick' if report.quick else 'full'} run, {report.seconds:.0f} s; {env}")
    return "\n".join(lines).lstrip("\n")
