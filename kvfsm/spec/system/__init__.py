"""Compositions: several machine specs (roles) exchanging declared messages over a channel.

A system file names its roles (each a machine spec, path relative to the
system file; how many ranks it has, whether its process may crash), the
messages their transitions ``send`` (and how many sender ranks a receiver
waits for), what the channel may do to messages (lose, duplicate, reorder;
how many it holds), how many requests to explore, which timeouts outlast
which (``relations``), and the properties to check (``never``, built-ins,
``eventually``). Like the machine spec it splits into the model
(:mod:`.model`, with the channel's rules in :mod:`.channel` and the
properties' meaning in :mod:`.properties`), the loader (:mod:`.loader`,
KVF001 and KVF200) and the checks (:mod:`.checks`, KVF201–KVF215). It knows
nothing of the explorer.
"""

from __future__ import annotations

from pathlib import Path

from ..findings import Finding, SpecError
from .channel import Channel
from .checks import run_system_checks
from .loader import Draft, is_system_file, is_system_text, read_system_file, read_system_text
from .model import BUILTINS, LIVENESS, Condition, Message, Property, Role, System, TimeRelation
from .properties import LastStep, Snapshot, violation, violations

__all__ = [
    "BUILTINS",
    "LIVENESS",
    "Channel",
    "Condition",
    "LastStep",
    "Message",
    "Property",
    "Role",
    "Snapshot",
    "System",
    "TimeRelation",
    "check_system",
    "is_system_file",
    "is_system_text",
    "load_system",
    "parse_system",
    "read_system",
    "run_system_checks",
    "violation",
    "violations",
]


def _findings(draft: Draft) -> list[Finding]:
    """The draft's own findings, then the composition checks once the schema is clean."""
    if draft.schema_errors:
        return draft.findings
    return draft.findings + run_system_checks(draft.system, draft.missing)


def check_system(path: str | Path) -> list[Finding]:
    """Every finding for a system file: schema, the roles' own checks, and the composition checks."""
    try:
        return _findings(read_system_file(path))
    except SpecError as exc:
        return list(exc.findings)


def _checked(draft: Draft) -> System:
    errors = [f for f in _findings(draft) if f.severity == "error"]
    if errors:
        raise SpecError(errors)
    return draft.system


def load_system(path: str | Path) -> System:
    """Read and check a system file; raises :class:`SpecError` if the system or a role has errors."""
    return _checked(read_system_file(path))


def read_system(path: str | Path) -> tuple[System, list[Finding]]:
    """A system whose roles may fail their own checks, as written, with those errors: a seed's rejected shape.

    What the explorer then finds is what the rejected design does (e.g. the
    hang KVF107 warns of). Raises :class:`SpecError` if the file, a role's
    schema or the composition itself has errors: then there is nothing sound
    to explore.
    """
    draft = read_system_file(path)
    unreadable = draft.schema_errors or draft.missing
    fatal = draft.findings if unreadable else run_system_checks(draft.system, draft.missing)
    errors = [f for f in fatal if f.severity == "error"]
    if errors:
        raise SpecError(errors)
    return draft.system, [f for f in draft.findings if f.severity == "error"]


def parse_system(text: str, path: str = "<string>") -> System:
    """Parse system text (role paths relative to ``path``'s folder) and check it; raises on errors."""
    return _checked(read_system_text(text, path))
