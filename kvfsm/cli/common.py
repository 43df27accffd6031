"""Shared by every command: the consoles, exit codes, and how a command registers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from rich.console import Console

from ..errors import KvfsmError

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Subparsers = Any
"""argparse's private _SubParsersAction; each command module's ``register(sub)`` adds itself to it."""

Command = Callable[[argparse.Namespace], int]


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
    err.print(f"kvfsm {command} needs {module}, which is not installed: pip install 'kvfsm[{extra}]'")
    return EXIT_USAGE
