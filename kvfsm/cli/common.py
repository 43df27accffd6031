"""Shared by every command: the consoles, exit codes, and how a command registers."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from ..errors import KvfsmError
from ..spec.findings import READ_ERROR, Finding

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3
"""The one exit-code contract of every command: 0 clean; 1 findings, a violation, a divergence (or, with
``--strict``, a warning); 2 unusable input or usage (a missing or malformed file, an unknown option, an option
the chosen mode has no use for); 3 incomplete (nothing found, but the run was cut short before it could say
so). 130: interrupted (Ctrl-C)."""

EXIT_INTERRUPTED = 130
"""Ctrl-C stopped the run (128 + SIGINT, as a shell reports it); what was found was printed first."""

EXIT_CODES = (
    "exit status: 0 clean; 1 findings or violation (with --strict, warnings too); "
    "2 unusable input or usage; 3 incomplete (cut short, nothing found); 130 interrupted"
)
"""The contract in one line, the epilog of ``kvfsm --help`` and of each command's ``--help``."""

UNREADABLE = frozenset({READ_ERROR, "KVF200"})
"""Findings that say a file could not be read at all: the file named (KVF000) or a role spec a system names
(KVF200). Any of them makes a command's exit status 2, as a missing or bad path is a usage error."""


def unreadable(findings: Sequence[Finding]) -> bool:
    """Whether a file behind ``findings`` could not be read (exit 2 rather than 1)."""
    return any(f.code in UNREADABLE for f in findings)


out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Subparsers = Any
"""argparse's private _SubParsersAction; each command module's ``register(sub)`` adds itself to it."""

Command = Callable[[argparse.Namespace], int]


def refuse(command: str, option: str, mode: str) -> int:
    """Say that ``option`` does not apply to ``mode`` (one line, on stderr) and return the usage exit code."""
    err.print(f"[red]kvfsm {command}: {escape(option)} does not apply to {escape(mode)}[/]")
    return EXIT_USAGE


def add_strict(p: argparse.ArgumentParser) -> None:
    """The ``--strict`` option of a command whose findings may be warnings: warnings fail too (exit 1)."""
    p.add_argument("--strict", action="store_true", help="warnings fail too (exit 1 rather than 0)")


class OutputError(KvfsmError):
    """A file a command was told to write cannot be written (reported as a usage error, exit 2)."""


def write_output(path: Path, data: bytes | str, flag: str) -> None:
    """Write a command's output file (creating its folder), or say plainly why it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data, encoding="utf-8")
    except IsADirectoryError:
        raise OutputError(f"{flag} {path} is a directory; name a file in it") from None
    except OSError as exc:
        raise OutputError(f"cannot write {flag} {path}: {exc.strerror or exc}; choose a writable path") from None


def missing_extra(command: str, extra: str, exc: ImportError) -> int:
    """Say in one line which extra installs the module ``command`` could not import, and return the usage exit code.

    Only a third-party module that is really absent is reported so; any other
    ImportError (one of kvfsm's own modules, a broken install) is a bug and is
    raised again for the CLI's internal-error path.
    """
    module = (exc.name or "").partition(".")[0]
    if not module or module == "kvfsm" or find_spec(module) is not None:
        raise exc
    err.print(escape(f"kvfsm {command} needs {module}, which is not installed: pip install 'kvfsm[{extra}]'"))
    return EXIT_USAGE


def print_finding(f: Finding) -> None:
    """One finding as text, as every command shows findings: ``path:line: severity CODE message``, then its fix."""
    colour = "red" if f.severity == "error" else "yellow"
    where = f"{f.path}:{f.line}" if f.line else f.path
    out.print(f"[bold]{escape(where)}[/]: [{colour}]{f.severity} {f.code}[/] {escape(f.message)}")
    if f.fix:
        out.print(f"    [dim]fix:[/] {escape(f.fix)}")


def findings_json(files: Sequence[tuple[str, Sequence[Finding]]]) -> dict[str, Any]:
    """Findings per file as every command's ``--format json`` prints them.

    ``{"files": [{"path", "clean", "findings": [Finding.as_dict()]}], "errors", "warnings"}``;
    a command adds its own keys beside these.
    """
    every = [f for _path, fs in files for f in fs]
    errors = sum(f.severity == "error" for f in every)
    return {
        "files": [
            {"path": path, "clean": not any(f.severity == "error" for f in fs), "findings": [f.as_dict() for f in fs]}
            for path, fs in files
        ],
        "errors": errors,
        "warnings": len(every) - errors,
    }
