"""Findings: what the loader, the static checks and the log check (``kvfsm replay``, KVF3xx) report."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..errors import SpecError

__all__ = ["READ_ERROR", "Finding", "Severity", "SpecError"]

Severity = Literal["error", "warning"]

READ_ERROR = "KVF000"
"""The file could not be read at all (missing, unreadable): a usage/IO error, not a finding."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem in a spec or a transition log: a stable code, where it is, what is wrong and how to mend it."""

    code: str
    severity: Severity
    path: str
    line: int
    message: str
    fix: str = ""
    col: int = 1

    def __str__(self) -> str:
        text = f"{self.path}:{self.line}: {self.message} ({self.code})."
        return f"{text} {self.fix}" if self.fix else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
