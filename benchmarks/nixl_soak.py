#!/usr/bin/env python3
"""Soak of the NIXL drivers on real NIXL agents (prefill ranks in a subprocess): leaks, hangs, latency.

Usage: python benchmarks/nixl_soak.py [--quick] [--json] [--requests N] [--concurrency C] [--fault-rate F] [--embedded]
All logic lives in kvfsm.showcase.bench.nixl; see docs/nixl.md for what each figure means.
"""

import os
import sys

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvfsm.showcase.bench.nixl import main

if __name__ == "__main__":
    sys.exit(main())
