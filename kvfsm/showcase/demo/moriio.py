"""The ledger of ``kvfsm demo --driver moriio``: what a 1P1D MoRIIO run left behind, as one JSON-able dict."""

from __future__ import annotations

from typing import Any

from ...harness.moriio.load import LoadResult


def moriio_ledger(
    result: LoadResult, *, mode: str, backend: str, pre_fix: bool, seed: int, fault_rate: float
) -> dict[str, Any]:
    """Requests by outcome on both sides, blocks leaked, requests hung or late, faults, latency, kvfsm's cost.

    Clean when nothing leaked, hung, finished late or failed its byte check,
    and every request ended.
    """
    corrupted = int(result.decode["blocks_wrong"])
    clean = (
        result.finished == result.requests
        and result.leaked_blocks == 0
        and result.hung == 0
        and result.late == 0
        and corrupted == 0
    )
    return {
        "driver": "moriio", "mode": mode, "backend": backend, "pre_fix": pre_fix, "seed": seed,
        "requests": result.requests, "concurrency": result.concurrency, "finished": result.finished,
        "fault_rate": fault_rate, "decode_outcomes": result.decode["outcomes"],
        "prefill_outcomes": result.prefill["outcomes"], "leaked_blocks": result.leaked_blocks, "hung": result.hung,
        "late": result.late, "corrupted": corrupted, "verified_blocks": result.decode["verified_blocks"],
        "faults_injected": result.faults,
        "latency_ms": {q: round(1e3 * result.percentile(n), 2) for q, n in (("p50", 50), ("p99", 99))}
        | {"max": round(1e3 * max(result.latencies, default=0.0), 2)},
        "kvfsm_us_per_request": round(result.kvfsm_us_per_request, 1), "seconds": round(result.wall, 2),
        "clean": clean,
    }  # fmt: skip
