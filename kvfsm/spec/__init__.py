"""The spec language: model, loader and static checks (knows nothing of the engine)."""

from __future__ import annotations

from pathlib import Path

from .checks import run_checks
from .findings import Finding, SpecError
from .loader import parse, read
from .model import Edge, IgnoreRule, Loc, Resource, Send, Spec, State, Timeout, Transition
from .system import System, check_system, is_system_file, load_system

__all__ = [
    "Edge",
    "Finding",
    "IgnoreRule",
    "Loc",
    "Resource",
    "Send",
    "Spec",
    "SpecError",
    "State",
    "System",
    "Timeout",
    "Transition",
    "check",
    "check_system",
    "is_system_file",
    "load",
    "load_system",
    "parse",
    "read",
    "run_checks",
]


def check(path: str | Path) -> list[Finding]:
    """Every finding for a spec file: schema errors (KVF001) or the static checks.

    A system file (a composition of roles, see :mod:`kvfsm.spec.system`) gets
    its own schema, its roles' checks and the composition checks (KVF2xx).
    """
    if is_system_file(path):
        return check_system(path)
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
