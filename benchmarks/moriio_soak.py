#!/usr/bin/env python3
"""Soak of the MoRIIO drivers (seed 001): 1P1D at high concurrency with injected faults; leaks, hangs, latency.

Usage: python benchmarks/moriio_soak.py [--requests N] [--concurrency C] [--fault-rate F] [--backend real|embedded]
                                        [--mode write|read] [--pre-fix] [--kill-at S] [--json]

The real backend runs the prefill engine in a process of its own on Mooncake's
TransferEngine (tcp, P2PHANDSHAKE) and the decode engine here on another;
faults: failed and raising writes, lost and duplicated write_done and
remote_blocks (a remote that never sends its blocks); ``--kill-at`` SIGKILLs the
prefill that many seconds in. ``--pre-fix`` runs seed 001's prefill instead.
Exit 0 only when nothing leaked or hung and every request finished within its
deadline. docs/moriio.md explains the figures.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvfsm.drivers.moriio.cluster import FAST, MOONCAKE, embedded_run, mooncake_run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--fault-rate", type=float, default=0.1)
    ap.add_argument("--backend", choices=("real", "embedded"), default="real")
    ap.add_argument("--mode", choices=("write", "read"), default="write")
    ap.add_argument("--pre-fix", action="store_true")
    ap.add_argument("--kill-at", type=float, default=None, metavar="S")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args(argv)
    sizes = {"requests": opts.requests, "concurrency": opts.concurrency, "fault_rate": opts.fault_rate,
             "seed": opts.seed, "pre_fix": opts.pre_fix, "kill_at": opts.kill_at}  # fmt: skip
    if opts.backend == "real":
        if opts.mode != "write":
            ap.error("the real backend (Mooncake TransferEngine) runs WRITE mode")
        result = mooncake_run(**sizes, timeouts=MOONCAKE)
    else:
        result = embedded_run(opts.mode, **sizes, timeouts=FAST)
    summary = {"backend": opts.backend, "mode": opts.mode, "pre_fix": opts.pre_fix, **result.summary()}
    if opts.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>22}  {value}")
    clean = result.leaked_blocks == 0 and result.hung == 0 and result.late == 0 and result.finished == opts.requests
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
