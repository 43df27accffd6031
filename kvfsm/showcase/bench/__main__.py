"""``python -m kvfsm.showcase.bench [--quick] [--json]``: run the benchmark and print its table (or JSON).

Exits 1 when a full run misses a target; a quick run always exits 0 (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import sys

from . import format_table, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfsm.showcase.bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, figures not meaningful")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--spec", help="path of kv_request.yaml (default: the bundled one)")
    args = parser.parse_args(argv)

    def progress(label: str, done: int, total: int) -> None:
        if label != "done":
            print(f"[{done + 1}/{total}] {label}", file=sys.stderr, flush=True)

    report = run(quick=args.quick, progress=progress, spec_path=args.spec)
    print(json.dumps(report.as_dict(), indent=2, ensure_ascii=False) if args.json else format_table(report))
    return 1 if not args.quick and not report.passed else 0


if __name__ == "__main__":
    sys.exit(main())
