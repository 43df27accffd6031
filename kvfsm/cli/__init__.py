"""The ``kvfsm`` command: renders what the library returns; never shows a traceback for bad input.

Each command is a module of this package with a ``register(sub)`` function;
they are found by name, so a command is added by adding its module.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
from collections.abc import Sequence

from rich.markup import escape

from ..errors import KvfsmError
from ..spec import SpecError
from .common import EXIT_CODES, EXIT_INTERRUPTED, EXIT_USAGE, Command, err, unreadable

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="kvfsm",
        description="Declared, checked state machines for the KV-cache lifecycle of LLM-serving requests.",
        epilog=f"Every command keeps one contract; {EXIT_CODES}. --format json prints the JSON document alone on "
        "stdout (notes and progress go to stderr).",
    )
    parser.add_argument("--version", action="version", version=f"kvfsm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_") and info.name != "common":
            importlib.import_module(f"{__name__}.{info.name}").register(sub)
    for command in sub.choices.values():  # the contract, stated once, under each command's own epilog
        command.epilog = f"{command.epilog}\n\n{EXIT_CODES}" if command.epilog else EXIT_CODES
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run: Command = args.run
    try:
        return run(args)
    except SpecError as exc:  # a spec the command was given cannot be used: its findings are `kvfsm check`'s to report
        for f in exc.findings:
            err.print(f"[red]{escape(str(f))}[/]")
        if not unreadable(exc.findings):
            err.print(f"[red]kvfsm {args.command}: the spec fails its checks, so it cannot be used (exit 2)[/]")
        return EXIT_USAGE
    except (KvfsmError, OSError) as exc:
        err.print(f"[red]kvfsm {args.command}: {escape(str(exc))}[/]")
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except MemoryError:  # every input is bounded; what is left is a search or a run asked to be this big
        err.print(
            f"[red]kvfsm {args.command}: out of memory; ask for less (fewer requests or states, a smaller run)[/]"
        )
        return EXIT_USAGE
    except Exception as exc:  # an internal bug: say so plainly; the traceback is opt-in
        if os.environ.get("KVFSM_DEBUG"):
            raise
        err.print(
            f"[red]kvfsm {args.command}: internal error {type(exc).__name__}: {escape(str(exc))}[/] "
            "(set KVFSM_DEBUG=1 for the traceback, and please report it)"
        )
        return EXIT_USAGE
