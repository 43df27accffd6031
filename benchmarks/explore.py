#!/usr/bin/env python3
"""Run the explorer benchmark: kvfsm against SPIN (plain and best settings) on the PD systems, 1 to 6 requests.

Usage: python benchmarks/explore.py [--quick] [--requests N] [--time-limit S] [--no-spin] [--json] [--systems ...]
All logic lives in kvfsm.showcase.bench.explore; docs/pd_abort.md and docs/explore.md explain the figures.
"""

import sys

from kvfsm.showcase.bench.explore import main

if __name__ == "__main__":
    sys.exit(main())
