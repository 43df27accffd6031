"""Run a pytest selection N times while busy-loop processes take every core: a test that fails here is a defect.

    python benchmarks/under_load.py --runs 20 --hogs 4 -- tests/test_pd.py -k killed

Each run is a fresh ``pytest`` process; the hogs (``--hogs``, default twice
the cores) spin for the whole campaign, so the tests see a machine loaded as a
busy CI runner is. Prints one line per run and, for each failing run, the tail
of its output; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import time


def _spin() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="pytest runs (default 20)")
    parser.add_argument("--hogs", type=int, default=2 * (os.cpu_count() or 1), help="busy-loop processes")
    parser.add_argument("pytest_args", nargs="+", help="what to pass to pytest (after --)")
    args = parser.parse_args(argv)
    hogs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(args.hogs)]
    for hog in hogs:
        hog.start()
    failed = 0
    began = time.monotonic()
    try:
        for run in range(1, args.runs + 1):
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.pytest_args],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
            load = os.getloadavg()[0]
            print(f"run {run:2}/{args.runs}: exit {proc.returncode}, {time.monotonic() - t0:6.1f} s, "
                  f"load {load:4.1f}: {tail[0]}", flush=True)  # fmt: skip
            if proc.returncode != 0:
                failed += 1
                print("\n".join(proc.stdout.splitlines()[-60:]), proc.stderr[-4000:], sep="\n", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
    print(f"{args.runs - failed}/{args.runs} runs passed with {args.hogs} hogs on {os.cpu_count()} cores "
          f"in {time.monotonic() - began:.0f} s", flush=True)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
