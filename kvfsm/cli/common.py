"""Shared by every command: the consoles, exit codes, and how a command registers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rich.console import Console

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

Subparsers = Any
"""argparse's private _SubParsersAction; each command module's ``register(sub)`` adds itself to it."""

Command = Callable[[argparse.Namespace], int]
