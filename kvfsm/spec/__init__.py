"""The spec language: model, loader and static checks (knows nothing of the engine)."""

from __future__ import annotations

from pathlib import Path

from .checks import run_checks
from .findings import Finding, SpecError
from .loader import read, read_text
from .model import Edge, IgnoreRule, Loc, Phase, Resource, Send, Spec, State, Timeout, Transition
from .system import System, check_system, is_system_file, load_system

__all__ = [
    "Edge",
    "Finding",
    "IgnoreRule",
    "Loc",
    "Phase",
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
    "read_text",
    "run_checks",
    "verify",
    "well_formed",
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
    return verify(read(path))


def parse(text: str, path: str = "<string>") -> Spec:
    """Read and check spec text, as :func:`load` does a file; raises :class:`SpecError` on any error."""
    return verify(read_text(text, path))


STRUCTURAL = frozenset({"KVF001", "KVF101", "KVF105", "KVF106", "KVF110", "KVF111", "KVF118"})
"""Findings that make a spec unreadable as a machine (no single initial state, dangling names, a pair
with two targets or both handled and ignored, a final state that moves on, a phase whose deadline would
fire an event its state refuses or leave the instance in the phase with none): no engine may run it."""


def verify(spec: Spec) -> Spec:
    """``spec`` itself once the static checks find no error in it; raises :class:`SpecError` otherwise."""
    errors = _errors(spec)
    if errors:
        raise SpecError(errors)
    return spec


def well_formed(spec: Spec) -> Spec:
    """``spec`` itself unless it has a structural error (:data:`STRUCTURAL`); raises :class:`SpecError` then.

    The engine runs any well-formed spec, whoever built it (a file, text, or a
    model made in code), so it never meets a spec it would misread; design
    errors such as a state without a timeout are :func:`load`'s to refuse.
    """
    errors = [f for f in _errors(spec) if f.code in STRUCTURAL]
    if errors:
        raise SpecError(errors)
    return spec


def _errors(spec: Spec) -> list[Finding]:
    """The spec's error findings, computed once and remembered on the (immutable) spec."""
    cached: list[Finding] | None = spec.__dict__.get("_kvfsm_errors")
    if cached is None:
        cached = spec.__dict__["_kvfsm_errors"] = [f for f in run_checks(spec) if f.severity == "error"]
    return cached
