#!/usr/bin/env python3
"""Seed 002 on SGLang's own classes, soaked: rooms with an abort drawn at random, as merged and as corrected.

Usage (in SGLang's venv, which ./dev.sh builds): .venv/sglang/bin/python benchmarks/sglang_soak.py
    [--rooms N] [--long] [--seed S] [--protocols merged_fix corrected] [--json]

Each protocol gets a decode server and two prefill servers of SGLang 0.5.23
(kvfsm.adapters.sglang_pair), each room a fault from FAULTS; the figures are
the corrupted pages counted by bytes in decode's KV buffers, the pages still
held at the end, and rooms per second. --long runs 20,000 rooms a protocol
(the default is 1,000, what CI's test runs). docs/sglang.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

from kvfsm.adapters.sglang_pair import FAULTS, Pair, soak
from kvfsm.replay import check_log
from kvfsm.spec.bundled import SPECS
from kvfsm.spec.system import load_system


def run(protocol: str, rooms: int, seed: int, port: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as journals:
        started = time.perf_counter()
        pair = Pair(protocol, journals, name=protocol, prefills=2, pages=4, pages_per_room=4, base_port=port)
        up = time.perf_counter() - started
        try:
            began = time.perf_counter()
            result = soak(pair, rooms, seed=seed)
            seconds = time.perf_counter() - began
        finally:
            summaries = pair.close()
        findings = 0
        system = load_system(SPECS / "pd_abort" / f"{protocol}.yaml")
        for name, path in pair.journals.items():
            findings += check_log(system.roles["decode" if name == "decode" else "prefill"].spec, path).total
    return {
        "protocol": protocol,
        **result,
        "corrupted_pages": sum(result["corrupted"].values()),
        "held_pages": sum(s["held_pages"] for s in summaries.values()),
        "refused": sum(len(s["refused"]) for s in summaries.values()),
        "journal_findings": findings,
        "seconds": round(seconds, 2),
        "rooms_per_s": round(rooms / seconds),
        "startup_s": round(up, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=1000)
    parser.add_argument("--long", action="store_true", help="20,000 rooms a protocol")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--protocols", nargs="+", default=["merged_fix", "corrected"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rooms = 20_000 if args.long else args.rooms
    rows = [run(p, rooms, args.seed, 19200 + 10 * i) for i, p in enumerate(args.protocols)]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'protocol':<11} {'rooms':>6} {'corrupted pages':>16} " + " ".join(f"{f:>19}" for f in FAULTS))
        for r in rows:
            per = " ".join(f"{r['corrupted'][f]:>9} of {4 * r['drawn'][f]:>6}" for f in FAULTS)
            print(f"{r['protocol']:<11} {r['rooms']:>6} {r['corrupted_pages']:>16} {per}")
        for r in rows:
            print(
                f"{r['protocol']}: {r['rooms_per_s']} rooms/s ({r['seconds']} s, servers up in {r['startup_s']} s); "
                f"pages held at the end {r['held_pages']}, refused events {r['refused']}, "
                f"journal findings {r['journal_findings']}"
            )
    bad = [r for r in rows if r["held_pages"] or r["refused"] or r["journal_findings"]]
    corrected = [r for r in rows if r["protocol"] == "corrected" and r["corrupted_pages"]]
    return 1 if bad or corrected else 0


if __name__ == "__main__":
    sys.exit(main())
