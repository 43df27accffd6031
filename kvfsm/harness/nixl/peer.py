"""Prefill ranks with real NIXL agents in a peer process, driven over a pipe: the far side of the real-agent tests.

``python -m kvfsm.harness.nixl.peer`` hosts one
:class:`~kvfsm.drivers.nixl.prefill.PrefillRank` per prefill TP rank, each with
its own :class:`~kvfsm.drivers.nixl.agent.NixlAgent`, says the ranks' agents as
its hello, and steps them every couple of milliseconds (notifications in,
expiries, finished requests) while it answers commands, until stdin closes.
:class:`PeerProcess` starts it and has one method per command.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path
from typing import Any

from ...drivers.nixl.decode import PeerInfo
from ...drivers.nixl.topology import Topology
from .. import peer

ENV = {"UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
"""Set in the peer's environment before it imports ``nixl`` (see :mod:`kvfsm.drivers.nixl.agent`)."""


class PeerProcess(peer.PeerProcess):
    """A prefill engine of ``topology.prefill_tp`` ranks with real NIXL agents, in its own process."""

    def __init__(
        self,
        topology: Topology,
        num_blocks: int,
        *,
        engine_id: str = "prefill",
        abort_timeout: float = 480.0,
        early_within: float | None = None,
        log: Path | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        """``abort_timeout`` and ``early_within`` are the ranks' ``nixl_prefill`` params (``None``: the spec's)."""
        self.engine_id = engine_id
        args = [
            "--engine", engine_id, "--prefill-tp", str(topology.prefill_tp), "--decode-tp", str(topology.decode_tp),
            "--kv-bytes", str(topology.kv_bytes), "--blocks", str(num_blocks), "--abort-timeout", str(abort_timeout),
        ]  # fmt: skip
        if early_within is not None:
            args += ["--early-within", str(early_within)]
        if topology.mla:
            args.append("--mla")
        super().__init__("kvfsm.harness.nixl.peer", args, env=ENV, log=log, start_timeout=start_timeout)
        self.peers = [PeerInfo.from_json(p) for p in self.hello["peers"]]

    def add_decode(self, metadata: bytes) -> None:
        self.call("add_peer", metadata=base64.b64encode(metadata).decode())

    def serve(self, requests: dict[str, int]) -> dict[str, list[list[int]]]:
        """Compute each request's blocks on every rank and hold them for the decode side; the block ids per rank."""
        blocks: dict[str, list[list[int]]] = self.call("serve", requests=requests)["blocks"]
        return blocks

    def compute(self, requests: dict[str, int]) -> dict[str, list[list[int]]]:
        """Compute each request's blocks on every rank without holding them yet (the step that hands
        request_finished's blocks to the worker has not come): the block ids per rank."""
        blocks: dict[str, list[list[int]]] = self.call("compute", requests=requests)["blocks"]
        return blocks

    def hold(self, request_ids: list[str]) -> None:
        """request_finished for requests :meth:`compute` computed: each rank begins holding their blocks."""
        self.call("hold", request_ids=request_ids)

    def stats(self) -> dict[str, Any]:
        """Held requests, leaked holders, outcomes, counts and anomalies, summed over the ranks."""
        return self.call("stats")


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__name__}")
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prefill-tp", type=int, required=True)
    ap.add_argument("--decode-tp", type=int, required=True)
    ap.add_argument("--kv-bytes", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--abort-timeout", type=float, required=True)
    ap.add_argument("--early-within", type=float)
    ap.add_argument("--mla", action="store_true")
    opts = ap.parse_args(argv)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    from ...drivers.nixl.agent import NixlAgent
    from ...drivers.nixl.prefill import PrefillRank, engine_stats

    topology = Topology(opts.prefill_tp, opts.decode_tp, opts.mla, opts.kv_bytes)
    params = {"abort_timeout": opts.abort_timeout}
    if opts.early_within is not None:
        params["early_within"] = opts.early_within
    ranks = [
        PrefillRank(r, topology, NixlAgent(f"{opts.engine}-{r}-{os.getpid()}"), opts.blocks, params=params)
        for r in range(opts.prefill_tp)
    ]
    computed: dict[str, list[list[int]]] = {}
    """Requests ``compute`` computed and ``hold`` has not held yet: their blocks per rank."""

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "add_peer":
            for r in ranks:
                r.agent.add_peer(base64.b64decode(cmd["metadata"]))
            return {}
        if op in ("serve", "compute"):
            out: dict[str, list[list[int]]] = {}
            for rid, n in cmd["requests"].items():
                out[rid] = []
                for r in ranks:
                    blocks = r.compute(rid, n)
                    if op == "serve":
                        r.request_finished(rid, blocks)
                    out[rid].append(blocks)
            if op == "compute":
                computed.update(out)
            return {"blocks": out}
        if op == "hold":
            for rid in cmd["request_ids"]:
                for r, blocks in zip(ranks, computed.pop(rid), strict=True):
                    r.request_finished(rid, blocks)
            return {}
        if op == "abort":
            for r in ranks:
                r.abort(cmd["request_id"])
            return {}
        if op == "stats":
            return engine_stats(ranks)
        raise ValueError(f"unknown command {op!r}")

    def step() -> None:
        for r in ranks:
            r.step()

    peer.say({"peers": [
        PeerInfo(opts.engine, r.rank, r.agent.name, r.agent.metadata(), r.blocks.base, r.blocks.block_bytes).to_json()
        for r in ranks
    ]})  # fmt: skip
    peer.serve(handle, tick=step)
    for r in ranks:
        r.tracker.close()
    os._exit(0)  # NIXL's UCX teardown at interpreter exit is not needed, and can fault


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
