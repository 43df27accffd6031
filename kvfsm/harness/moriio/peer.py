"""A MoRIIO prefill engine on the real Mooncake TransferEngine, in a peer process of its own.

``python -m kvfsm.harness.moriio.peer`` builds a
:class:`~kvfsm.drivers.moriio.producer.PrefillEngine` over a
:class:`~kvfsm.drivers.moriio.plane.PlaneTransport` over a
:class:`~kvfsm.drivers.mooncake.agent.MooncakeAgent` (behind a
:class:`~kvfsm.harness.faults.FaultyAgent` when faults are named),
says its transport's name as its hello, and steps the engine until stdin
closes. Requests (``prefill``), ``remote_blocks``, ``release`` and
``stats_query`` reach it over its ZMQ socket, like any other message.
``--prefill module:function`` runs another prefill the caller names (seed
001's shape: ``kvfsm.showcase.moriio_seed:pre_fix_prefill``).
:class:`PeerProcess` starts it and waits for its name with a deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .. import peer


class PeerProcess(peer.PeerProcess):
    """A prefill engine in its own process; :attr:`name` is its transport's name (what the decode side posts to)."""

    def __init__(
        self,
        *,
        blocks: int,
        block_bytes: int,
        mode: str = "write",
        params: dict[str, float] | None = None,
        fault_rate: float = 0.0,
        faults: tuple[str, ...] = (),
        fault_seed: int = 0,
        prefill: str | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        args = [
            "--mode", mode, "--blocks", str(blocks), "--block-bytes", str(block_bytes),
            "--params", json.dumps(params or {}), "--fault-rate", str(fault_rate), "--faults", ",".join(faults),
            "--fault-seed", str(fault_seed),
        ]  # fmt: skip
        if prefill is not None:
            args += ["--prefill", prefill]
        env = {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        super().__init__("kvfsm.harness.moriio.peer", args, env=env, start_timeout=start_timeout)
        self.name: str = self.hello["name"]


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m {__name__}")
    ap.add_argument("--mode", choices=["write", "read"], default="write")
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--params", default="{}")
    ap.add_argument("--fault-rate", type=float, default=0.0)
    ap.add_argument("--faults", default="")
    ap.add_argument("--fault-seed", type=int, default=0)
    ap.add_argument("--prefill", default=None, help="another prefill, as 'module:function' (cluster.prefill_variant)")
    opts = ap.parse_args(argv)
    from ...drivers.mooncake.agent import UNREACHABLE, MooncakeAgent
    from ...drivers.moriio.plane import PlaneTransport
    from ...drivers.moriio.producer import PrefillEngine
    from ..faults import FaultyAgent
    from .cluster import fault_plan, faulty, prefill_variant

    base = MooncakeAgent()
    agent: MooncakeAgent | FaultyAgent = base
    kinds = tuple(k for k in opts.faults.split(",") if k)
    if kinds:
        agent = faulty(base, fault_plan(opts.fault_rate, kinds, opts.fault_seed), UNREACHABLE)
    transport = PlaneTransport(agent)
    extra = prefill_variant(opts.prefill, opts.mode)
    params = None if extra else json.loads(opts.params)
    engine = PrefillEngine(
        transport, opts.blocks, opts.block_bytes, mode=opts.mode, params=params,
        faults=agent.injected if isinstance(agent, FaultyAgent) else None, **extra,
    )  # fmt: skip

    def step() -> None:
        engine.step()
        if engine.tracker.live() == 0 and not engine.queued:
            base.mailbox.wait(0.005)
        else:
            time.sleep(0.001)

    peer.say({"name": base.name, "pid": os.getpid()})
    peer.serve(tick=step, every=0)
    engine.tracker.close()
    base.close()
    os._exit(0)  # the TransferEngine's teardown at interpreter exit is not needed


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
