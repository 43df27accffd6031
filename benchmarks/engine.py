#!/usr/bin/env python3
"""Run the engine benchmarks: the same as ``python -m kvfsm.showcase.bench`` and ``kvfsm bench``.

Usage: python benchmarks/engine.py [--quick] [--json] [--spec PATH]
All logic lives in kvfsm.showcase.bench; see benchmarks/README.md for what each figure means.
"""

import sys

from kvfsm.showcase.bench.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
