#!/usr/bin/env python3
"""The PD control plane under abuse: 100,000 malformed messages at a live listener, then P/D soaks at concurrency 512.

Usage: python benchmarks/pd_soak.py [--messages N] [--requests N] [--concurrency C] [--fault-rate F] [--json]
All logic lives in kvfsm.showcase.bench.pd; docs/wire.md and docs/demo.md explain the figures.
"""

import sys

from kvfsm.showcase.bench.pd import main

if __name__ == "__main__":
    sys.exit(main())
