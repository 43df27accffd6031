"""Ready-made 1P1D runs of the MoRIIO drivers: in one process (embedded or NIXL agents), or across two (Mooncake).

What the tests, the soak benchmark and ``kvfsm demo --driver moriio`` run:
:func:`embedded_run` and :func:`mooncake_run` build a prefill and a decode
engine with a shared :class:`~kvfsm.drivers.moriio.faults.FaultPlan`,
optionally a prefill the caller names (seed 001's pre-fix shape), optionally a
prefill that dies mid-run, and return the
:class:`~kvfsm.drivers.moriio.load.LoadResult`. Timeouts are scaled down from
vLLM's 30 s / 60 s so a run takes seconds; their order is the one the specs ask
for (the decode side waits longer than the prefill side may still write).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...drivers.fabric import Fabric
from ...drivers.moriio.consumer import DecodeEngine
from ...drivers.moriio.faults import READ_FAULTS, WRITE_FAULTS, FaultPlan, FaultyTransport
from ...drivers.moriio.load import LoadResult, run_load
from ...drivers.moriio.plane import PlaneTransport
from ...drivers.moriio.producer import PrefillEngine


@dataclass(frozen=True)
class Timeouts:
    """The specs' params for a run: the producer's ``defer_timeout``/``transfer_timeout``, the consumer's wait."""

    defer: float = 0.5
    transfer: float = 0.5
    recv: float = 1.2

    def producer(self, mode: str) -> dict[str, float]:
        if mode == "write":
            return {"defer_timeout": self.defer, "transfer_timeout": self.transfer}
        return {"defer_timeout": self.defer + self.transfer}

    def consumer(self, mode: str) -> dict[str, float]:
        return {"recv_timeout": self.recv} if mode == "write" else {"transfer_timeout": self.transfer}

    def deadline(self, mode: str) -> float:
        """How long a request may take on the decode side: its own timeout, plus 0.5 s for the step that notices it.

        The step that expires a dead peer's loads handles hundreds at once; on two busy cores it took over 0.25 s.
        """
        return (self.recv if mode == "write" else self.transfer) + 0.5


FAST = Timeouts()
MOONCAKE = Timeouts(defer=1.0, transfer=2.0, recv=4.0)
DEAD_PEER: dict[str, Any] = {
    "live": 0, "queued": 0, "held_blocks": 0, "outcomes": {}, "anomalies": {}, "errors": 0,
    "tracker_seconds": 0.0, "counts": {}, "faults": {}, "dead": True,
}  # fmt: skip
"""What a dead prefill can say about itself: nothing (a run with a killed peer judges the decode side)."""


def default_faults(mode: str) -> tuple[str, ...]:
    return WRITE_FAULTS if mode == "write" else READ_FAULTS


def embedded_run(
    mode: str = "write",
    *,
    requests: int = 600,
    concurrency: int = 128,
    blocks_per_request: int = 2,
    block_bytes: int = 1024,
    fault_rate: float = 0.1,
    faults: Sequence[str] | None = None,
    seed: int = 1,
    timeouts: Timeouts = FAST,
    prefill: str | None = None,
    prefill_headroom: float = 1.25,
    kill_after: int | None = None,
) -> LoadResult:
    """One run in this process. ``prefill``: another prefill than the bundled one (:func:`prefill_variant`);
    ``kill_after``: the prefill dies once that many requests have ended."""
    fabric = Fabric()
    plan = FaultPlan(fault_rate, faults if faults is not None else default_faults(mode), seed)
    pt = FaultyTransport(PlaneTransport(fabric.agent("prefill")), plan)
    dt = FaultyTransport(PlaneTransport(fabric.agent("decode")), plan)
    prefill_blocks = int(concurrency * blocks_per_request * prefill_headroom)
    extra = prefill_variant(prefill, mode)
    params = None if extra else timeouts.producer(mode)
    engine = PrefillEngine(pt, prefill_blocks, block_bytes, mode=mode, params=params, **extra)
    decode = DecodeEngine(
        dt, concurrency * blocks_per_request, block_bytes, "prefill", mode=mode, params=timeouts.consumer(mode)
    )
    dead = False

    def tick(ended: int) -> None:
        nonlocal dead
        if kill_after is not None and not dead and ended >= kill_after:
            fabric.dead.add("prefill")
            dead = True

    def step_prefill() -> None:
        if not dead:
            engine.step()

    return run_load(
        decode, "prefill", requests=requests, concurrency=concurrency, blocks_per_request=blocks_per_request,
        deadline=timeouts.deadline(mode), settle=timeouts.defer + timeouts.transfer + 0.5, step_prefill=step_prefill,
        prefill_stats=lambda: DEAD_PEER if dead else engine.stats(), faults=lambda: _merge(pt, dt), tick=tick,
    )  # fmt: skip


def prefill_variant(ref: str | None, mode: str) -> dict[str, Any]:
    """The :class:`PrefillEngine` arguments (``spec``, ``driver``) that ``ref``, ``"module:function"``, gives for
    ``mode``; none for ``None`` (the bundled spec and driver).

    The caller names the variant, so the load runner runs a prefill shaped like a known bug
    (``kvfsm.showcase.moriio_seed:pre_fix_prefill``, seed 001) without the drivers importing the showcase, and a
    prefill in a process of its own (:class:`~.peer.PeerProcess`) gets the same by name.
    """
    if ref is None:
        return {}
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(
            f"prefill {ref!r}: name it as 'module:function', e.g. 'kvfsm.showcase.moriio_seed:pre_fix_prefill'"
        )
    made: dict[str, Any] = getattr(importlib.import_module(module), name)(mode)
    return made


def mooncake_run(
    *,
    requests: int = 600,
    concurrency: int = 128,
    blocks_per_request: int = 2,
    block_bytes: int = 4096,
    fault_rate: float = 0.1,
    faults: Sequence[str] = WRITE_FAULTS,
    seed: int = 1,
    timeouts: Timeouts = MOONCAKE,
    prefill: str | None = None,
    kill_after: int | None = None,
) -> LoadResult:
    """One WRITE-mode run on real TransferEngines: the prefill in a process of its own, the decode side here.
    ``prefill`` as for :func:`embedded_run`."""
    from ...drivers.mooncake.agent import UNREACHABLE, MooncakeAgent
    from .peer import PeerProcess

    plan = FaultPlan(fault_rate, faults, seed)
    with PeerProcess(
        blocks=int(concurrency * blocks_per_request * 1.25), block_bytes=block_bytes,
        params=timeouts.producer("write"), fault_rate=fault_rate, faults=tuple(faults), fault_seed=seed,
        prefill=prefill,
    ) as peer:  # fmt: skip
        base = MooncakeAgent()
        dt = FaultyTransport(PlaneTransport(base), plan, UNREACHABLE)
        decode = DecodeEngine(
            dt, concurrency * blocks_per_request, block_bytes, peer.name, params=timeouts.consumer("write")
        )
        dead = False

        def tick(ended: int) -> None:
            nonlocal dead
            if kill_after is not None and not dead and ended >= kill_after:
                peer.kill()
                dead = True

        try:
            result = run_load(
                decode, peer.name, requests=requests, concurrency=concurrency, blocks_per_request=blocks_per_request,
                deadline=timeouts.deadline("write"), settle=timeouts.defer + timeouts.transfer + 0.5,
                faults=lambda: dict(dt.injected), tick=tick,
                prefill_stats=(lambda: DEAD_PEER) if kill_after is not None else None,
            )  # fmt: skip
        finally:
            base.close()
    prefill_faults = result.prefill.get("faults", {})
    result.faults = {**result.faults, **prefill_faults}
    return result


def _merge(*transports: FaultyTransport) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in transports:
        for k, v in t.injected.items():
            out[k] = out.get(k, 0) + v
    return out


def nixl_run(
    mode: str = "read",
    *,
    requests: int = 300,
    concurrency: int = 64,
    blocks_per_request: int = 2,
    block_bytes: int = 1024,
    fault_rate: float = 0.1,
    seed: int = 1,
    timeouts: Timeouts = Timeouts(defer=1.0, transfer=1.0, recv=2.5),
) -> LoadResult:
    """One run on two real NIXL agents (UCX, DRAM) in this process, READ or WRITE mode; imports ``nixl``.

    Run it in a process of its own and leave with ``os._exit``: NIXL's UCX
    teardown at interpreter exit is not needed and can fault.
    """
    from ...drivers.nixl.agent import NixlAgent

    plan = FaultPlan(fault_rate, default_faults(mode), seed)
    p, d = PlaneTransport(NixlAgent("moriio-prefill")), PlaneTransport(NixlAgent("moriio-decode"))
    pt, dt = FaultyTransport(p, plan), FaultyTransport(d, plan)
    prefill = PrefillEngine(
        pt, int(concurrency * blocks_per_request * 1.25), block_bytes, mode=mode, params=timeouts.producer(mode)
    )
    decode = DecodeEngine(
        dt, concurrency * blocks_per_request, block_bytes, p.name, mode=mode, params=timeouts.consumer(mode)
    )
    p.add_peer(d.metadata())
    d.add_peer(p.metadata())
    return run_load(
        decode, p.name, requests=requests, concurrency=concurrency, blocks_per_request=blocks_per_request,
        deadline=timeouts.deadline(mode), settle=timeouts.defer + timeouts.transfer + 0.5,
        step_prefill=prefill.step, prefill_stats=prefill.stats, faults=lambda: _merge(pt, dt),
    )  # fmt: skip
