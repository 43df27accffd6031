#!/usr/bin/env python3
"""Run the CPU-offload benchmarks: driver block copies vs one contiguous copy, and the connector's scheduler-side cost.

Usage: python benchmarks/offload.py [--quick] [--json]
All logic lives in kvfsm.showcase.bench.offload; docs/cpu_offload.md explains the figures.
"""

import sys

from kvfsm.showcase.bench.offload import main

if __name__ == "__main__":
    sys.exit(main())
