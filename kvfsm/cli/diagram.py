"""``kvfsm diagram``: draw a spec as SVG, DOT or Mermaid."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.markup import escape

from ..spec import read
from .common import EXIT_OK, Subparsers, out, write_output


def register(sub: Subparsers) -> None:
    p = sub.add_parser("diagram", help="draw a spec as SVG, DOT or Mermaid")
    p.add_argument("spec", type=Path, metavar="SPEC")
    p.add_argument("-f", "--format", choices=("svg", "dot", "mermaid"), default="svg")
    p.add_argument("-o", "--output", type=Path, default=None, help="file to write (default: stdout)")
    p.add_argument("--ignores", action="store_true", help="also draw ignore rules (late events that are legal no-ops)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..gen.diagram import render

    spec = read(args.spec)
    data = render(spec, args.format, ignores=args.ignores)
    if args.output is None or str(args.output) == "-":
        sys.stdout.buffer.write(data)
    else:
        write_output(args.output, data, "-o")
        out.print(f"wrote {escape(str(args.output))} ({args.format}, {len(data)} bytes)")
    return EXIT_OK
