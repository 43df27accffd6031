#!/usr/bin/env python3
"""How many examples model-based tests take to find each seeded bug of the test suite, with and without the path cover.

Usage: python benchmarks/testing.py [--seeds N] [--quick] [--only NAME] [--generator random|"path cover"] [--json]
The logic lives in kvfsm.showcase.bench.testing; the drivers are the test
suite's (tests/buggy_drivers.py); docs/testing.md §4 explains the figures.
"""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import buggy_drivers as b  # noqa: E402

import kvfsm  # noqa: E402
from kvfsm.showcase.bench.testing import Case, main  # noqa: E402

CPU_HIT = kvfsm.parse(b.CPU_HIT_SPEC, "cpu_hit_load.yaml")
PRODUCER = kvfsm.parse(b.PRODUCER_SPEC, "kv_producer.yaml")

CASES = [
    Case("kv_request: seed 000, dec skipped on a put error", b.KV_REQUEST, b.SkipsDecOnPutError, buggy=True),
    Case("kv_request: task_done frees the blocks twice", b.KV_REQUEST, b.TaskDoneFreesBlocks, buggy=True),
    Case("cpu_hit_load: seed 003, pin kept between phases", CPU_HIT, b.UnpinsOnlyLoadedHits, buggy=True),
    Case("kv_producer: write closed twice on success", PRODUCER, b.ClosesWriteTwice, buggy=True),
    Case("kv_request: correct StoreSender", b.KV_REQUEST, b.StoreSender, buggy=False),
    Case("cpu_hit_load: correct CpuHitLoader", CPU_HIT, b.CpuHitLoader, buggy=False),
    Case("kv_producer: correct Producer", PRODUCER, b.Producer, buggy=False),
]

if __name__ == "__main__":
    sys.exit(main(CASES))
