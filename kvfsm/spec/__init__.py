"""The spec language: model, loader and static checks (knows nothing of the engine)."""

from __future__ import annotations

from pathlib import Path

from .checks import run_checks
from .findings import Finding, SpecError
from .loader import parse, read
from .model import Edge, IgnoreRule, Loc, Resource, Spec, State, Timeout, Transition

__all__ = [
    "Edge",
    "Finding",
    "IgnoreRule",
    "Loc",
    "Resource",
    "Spec",
    "SpecError",
    "State",
    "Timeout",
    "Transition",
    "check",
    "load",
    "parse",
    "read",
    "run_checks",
]


def check(path: str | Path) -> list[Finding]:
    """Every finding for a spec file: schema errors (KVF001) or the static checks."""
    try:
        spec = read(path)
    except SpecError as exc:
        return list(exc.findings)
    return run_checks(spec)


def load(path: str | Path) -> Spec:
    """Read and check a spec file; raises :class:`SpecError` if any check finds an error."""
    spec = read(path)
    errors = [f for f in run_checks(spec) if f.severity == "error"]
    if errors:
        raise SpecError(errors)
    return spec
