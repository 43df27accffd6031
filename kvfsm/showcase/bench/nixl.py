"""Soak of the NIXL drivers: hundreds of concurrent READs with injected faults, real agents or embedded ones.

:func:`soak` keeps ``concurrency`` requests in flight on one decode rank
(this process) against a prefill engine of ``prefill_tp`` ranks (a
:class:`~kvfsm.harness.nixl.peer.PeerProcess` with real NIXL agents, or
:class:`~kvfsm.drivers.nixl.Fabric` agents in process), with a fraction of
requests hit by :class:`~kvfsm.harness.faults.FaultyAgent`. At the end it
waits out the prefill expiry and counts leaked blocks (holders left in either
pool), hung requests (still live on either side) and late ones (still
live after a step that began past their deadline), with latency percentiles.

``python benchmarks/nixl_soak.py`` runs it (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ...drivers.nixl import DataPlane, DecodeRank, Fabric, PeerInfo, PrefillRank, Topology
from ...drivers.nixl.decode import BlockReader
from ...drivers.nixl.prefill import engine_stats
from ...harness.load import closed_loop
from ...harness.nixl import faulty


class Prefill(Protocol):
    """The prefill engine a soak reads from: real ranks in a subprocess, or embedded ones."""

    peers: list[PeerInfo]

    def serve(self, requests: dict[str, int]) -> dict[str, list[list[int]]]: ...

    def stats(self) -> dict[str, Any]: ...


class EmbeddedPrefill:
    """Prefill ranks on a :class:`Fabric` in this process, with the :class:`PeerProcess` surface the soak uses."""

    def __init__(self, fabric: Fabric, topology: Topology, num_blocks: int, abort_timeout: float) -> None:
        params = {"abort_timeout": abort_timeout}
        self.ranks = [
            PrefillRank(r, topology, fabric.agent(f"prefill-{r}"), num_blocks, params=params)
            for r in range(topology.prefill_tp)
        ]
        self.peers = [
            PeerInfo("prefill", r.rank, r.agent.name, r.agent.metadata(), r.blocks.base, r.blocks.block_bytes)
            for r in self.ranks
        ]
        self.engine_id = "prefill"

    def serve(self, requests: dict[str, int]) -> dict[str, list[list[int]]]:
        out: dict[str, list[list[int]]] = {rid: [] for rid in requests}
        for rid, n in requests.items():
            for r in self.ranks:
                blocks = r.compute(rid, n)
                r.request_finished(rid, blocks)
                out[rid].append(blocks)
        return out

    def step(self) -> None:
        for r in self.ranks:
            r.step()

    def stats(self) -> dict[str, Any]:
        self.step()
        return engine_stats(self.ranks)


@dataclass
class SoakResult:
    """What a soak measured; ``ok`` is what the issue asks: no leak, no hang, nothing late."""

    transport: str
    requests: int
    concurrency: int
    fault_rate: float
    faults: dict[str, int] = field(default_factory=dict)
    decode_outcomes: dict[str, int] = field(default_factory=dict)
    prefill_outcomes: dict[str, int] = field(default_factory=dict)
    prefill_counts: dict[str, int] = field(default_factory=dict)
    prefill_anomalies: dict[str, int] = field(default_factory=dict)
    leaked_blocks: int = 0
    hung: int = 0
    late: int = 0
    blocks_verified: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.leaked_blocks == 0 and self.hung == 0 and self.late == 0


def soak(
    *,
    requests: int = 2048,
    concurrency: int = 512,
    fault_rate: float = 0.1,
    topology: Topology | None = None,
    blocks_per_request: int = 4,
    read_timeout: float = 5.0,
    abort_timeout: float = 3.0,
    seed: int = 0,
    real: bool = True,
    reader: type[BlockReader] = BlockReader,
    log: str | None = None,
) -> SoakResult:
    """Run ``requests`` loads, ``concurrency`` at a time, and count leaks, hangs and late finishes."""
    topo = topology or Topology(prefill_tp=2, decode_tp=1, mla=True, kv_bytes=4096)
    pool = requests * blocks_per_request
    result = SoakResult("nixl" if real else "embedded", requests, concurrency, fault_rate)
    if real:
        from ...drivers.nixl.agent import NixlAgent
        from ...harness.nixl.peer import PeerProcess

        prefill: Any = PeerProcess(topo, pool, abort_timeout=abort_timeout, log=None if log is None else Path(log))
        inner: DataPlane = NixlAgent(f"decode-soak-{seed}")
    else:
        fabric = Fabric()
        prefill = EmbeddedPrefill(fabric, topo, pool, abort_timeout)
        inner = fabric.agent("decode-0")
    try:
        agent = faulty(inner, fault_rate, seed)
        decode = DecodeRank(
            0, topo, agent, concurrency * blocks_per_request, params={"read_timeout": read_timeout}, reader=reader
        )
        if real:
            prefill.add_decode(agent.metadata())
        decode.handshake(prefill.peers)
        _run(result, prefill, decode, requests, concurrency, blocks_per_request, read_timeout, abort_timeout)
        result.faults = dict(agent.injected)
        result.blocks_verified = decode.driver.stats["blocks_verified"]
    finally:
        if real:
            prefill.stop()
    return result


def _run(
    result: SoakResult, prefill: Any, decode: DecodeRank, requests: int, concurrency: int, per_request: int,
    read_timeout: float, abort_timeout: float,
) -> None:  # fmt: skip
    def start(indices: range) -> list[Hashable]:
        keys: list[Hashable] = []
        for rid, ranks in prefill.serve({f"p-{i}": per_request for i in indices}).items():
            key = "d" + rid[1:]
            local = decode.blocks.pool.allocate(key, per_request)
            decode.start_load(key, rid, prefill.engine_id, local, ranks[0])
            keys.append(key)
        return keys

    def step() -> list[Hashable]:
        if isinstance(prefill, EmbeddedPrefill):
            prefill.step()
        ended: list[Hashable] = [str(key) for key in decode.step().recving]
        for key in ended:
            decode.blocks.pool.release(key)  # the scheduler frees the request's blocks
        return ended

    loop = closed_loop(
        requests, concurrency, start=start, step=step, deadline=read_timeout, give_up=60 + requests * 0.05,
        per_step=concurrency,
    )  # fmt: skip
    result.wall_s = loop.wall
    result.late = loop.late
    result.hung += len(loop.still_open) + decode.tracker.live()
    deadline = time.monotonic() + abort_timeout + 5.0
    stats = prefill.stats()
    while sum(stats["held"]) and time.monotonic() < deadline:
        time.sleep(0.05)
        stats = prefill.stats()
    result.hung += sum(stats["held"])
    result.leaked_blocks = len(decode.leaked()) + stats["leaked"]
    result.decode_outcomes = dict(decode.outcomes)
    result.prefill_outcomes = stats["outcomes"]
    result.prefill_counts = stats["counts"]
    result.prefill_anomalies = stats["anomalies"]
    if loop.latencies:
        ms = loop.ms()
        result.p50_ms, result.p99_ms, result.max_ms = ms["p50_ms"], ms["p99_ms"], ms["max_ms"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Soak the NIXL drivers with injected faults.")
    ap.add_argument("--quick", action="store_true", help="256 requests, 64 at a time")
    ap.add_argument("--requests", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--fault-rate", type=float, default=0.1)
    ap.add_argument("--embedded", action="store_true", help="in-process agents instead of real NIXL")
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args(argv)
    n, c = (256, 64) if opts.quick else (opts.requests, opts.concurrency)
    result = soak(requests=n, concurrency=c, fault_rate=opts.fault_rate, real=not opts.embedded)
    out = {**asdict(result), "ok": result.ok}
    sys.stdout.write((json.dumps(out) if opts.json else "\n".join(f"{k}: {v}" for k, v in out.items())) + "\n")
    return 0 if result.ok else 1
