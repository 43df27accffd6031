"""``kvfsm diagram``: draw a machine spec or a composition as SVG, PNG, PDF (any Graphviz format), DOT or Mermaid."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.markup import escape

from ..spec import is_system_file, read
from .common import EXIT_OK, Subparsers, out, write_output


def register(sub: Subparsers) -> None:
    p = sub.add_parser(
        "diagram",
        help="draw a spec, or a system file's roles and messages, as SVG, PNG, DOT, Mermaid, ...",
        description="Draw a machine spec, or a system file (each role a cluster, messages as edges between them).",
    )
    p.add_argument("spec", type=Path, metavar="SPEC", help="a machine spec or a system file")
    p.add_argument(
        "-f",
        "--format",
        default=None,
        metavar="FORMAT",
        help="svg, png, pdf or any format `dot -T?` lists; dot (the source); mermaid "
        "(default: from -o's extension, .mmd for Mermaid; svg on stdout)",
    )
    p.add_argument("-o", "--output", type=Path, default=None, help="file to write (default: stdout)")
    p.add_argument(
        "--rankdir", choices=("TB", "LR"), default="TB", help="layout: TB top to bottom (default), LR left to right"
    )
    p.add_argument("--ignores", action="store_true", help="also draw ignore rules (late events that are legal no-ops)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..gen.diagram import check_format, format_of, render
    from ..spec.system import read_system

    to_stdout = args.output is None or str(args.output) == "-"
    fmt = args.format or ("svg" if to_stdout else format_of(args.output)) or "svg"
    check_format(fmt, "" if args.format or to_stdout else f"the extension of -o {args.output}")
    drawing = read_system(args.spec)[0] if is_system_file(args.spec) else read(args.spec)
    data = render(drawing, fmt, ignores=args.ignores, rankdir=args.rankdir)
    if to_stdout:
        sys.stdout.buffer.write(data)
    else:
        write_output(args.output, data, "-o")
        out.print(f"wrote {escape(str(args.output))} ({fmt}, {len(data)} bytes)")
    return EXIT_OK
