#!/usr/bin/env python3
"""Soak and overhead of the Mooncake store worker on a real mooncake_master (started on loopback if not given).

Usage: python benchmarks/mooncake_soak.py [--quick] [--json] [--requests N] [--fault-rate F] [--master HOST:PORT]
All logic lives in kvfsm.showcase.bench.mooncake; see docs/mooncake.md for what each figure means.
"""

import sys

from kvfsm.showcase.bench.mooncake import main

if __name__ == "__main__":
    sys.exit(main())
