"""Ready-made 1P1D runs of the MoRIIO drivers: in one process (embedded or NIXL agents), or across two (Mooncake).

What the tests, the soak benchmark and ``kvfsm demo --driver moriio`` run:
:func:`embedded_run` and :func:`mooncake_run` build a prefill and a decode
engine with a shared :class:`~kvfsm.harness.faults.FaultPlan` (each agent behind a
:class:`~kvfsm.harness.faults.FaultyAgent`),
optionally a prefill the caller names (seed 001's pre-fix shape), optionally a
prefill that dies mid-run, and return the
:class:`~kvfsm.harness.moriio.load.LoadResult`. Timeouts are scaled down from
vLLM's 30 s / 60 s so a run takes seconds; their order is the one the specs ask
for (the decode side waits longer than the prefill side may still write).
"""

from __future__ import annotations

import importlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ...drivers.dataplane import DataPlane
from ...drivers.fabric import Fabric
from ...drivers.moriio.consumer import DecodeEngine
from ...drivers.moriio.messages import fault_label
from ...drivers.moriio.plane import PlaneTransport
from ...drivers.moriio.producer import PrefillEngine
from ...testing.clock import VirtualClock
from ..faults import FaultPlan, FaultyAgent
from .load import LoadResult, run_load

WRITE_FAULTS = (
    "failed_write", "raising_write", "lost_write_done", "duplicate_write_done", "lost_remote_blocks",
    "duplicate_remote_blocks",
)  # fmt: skip
"""The faults of a WRITE-mode run: writes that fail or raise at the post, messages lost or sent twice."""
READ_FAULTS = ("failed_read", "raising_read", "lost_release", "duplicate_release")
"""The faults of a READ-mode run."""


def faulty(agent: DataPlane, plan: FaultPlan, unreachable: str | None = None) -> FaultyAgent:
    """``agent`` behind the plan's faults, MoRIIO's messages named by their transfer id (one fault per transfer)."""
    return FaultyAgent(agent, plan, label=fault_label, unreachable=unreachable)


def fault_plan(rate: float, kinds: Sequence[str], seed: int) -> FaultPlan:
    """A plan over MoRIIO's faults (a misspelt one is refused)."""
    return FaultPlan(rate, kinds, seed, known=WRITE_FAULTS + READ_FAULTS)


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
VIRTUAL_STEP = 0.001
"""Seconds a step of an :func:`embedded_run` on a virtual clock takes: about what one takes at concurrency 512."""
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
    clock: VirtualClock | None = None,
) -> LoadResult:
    """One run in this process. ``prefill``: another prefill than the bundled one (:func:`prefill_variant`);
    ``kill_after``: the prefill dies once that many requests have ended; ``clock``: the run's time, moved
    :data:`VIRTUAL_STEP` a step, instead of the wall clock (the same deadlines fire in every run, however busy
    the machine; latencies are then virtual too)."""
    fabric = Fabric()
    now: Callable[[], float] = clock if clock is not None else time.monotonic
    wait: Callable[[float], object] = clock.advance if clock is not None else time.sleep
    plan = fault_plan(fault_rate, faults if faults is not None else default_faults(mode), seed)
    pa, da = faulty(fabric.agent("prefill"), plan), faulty(fabric.agent("decode"), plan)
    pt, dt = PlaneTransport(pa), PlaneTransport(da)
    prefill_blocks = int(concurrency * blocks_per_request * prefill_headroom)
    extra = prefill_variant(prefill, mode)
    params = None if extra else timeouts.producer(mode)
    engine = PrefillEngine(pt, prefill_blocks, block_bytes, mode=mode, params=params, **extra, clock=now)
    decode = DecodeEngine(
        dt, concurrency * blocks_per_request, block_bytes, "prefill", mode=mode, params=timeouts.consumer(mode),
        clock=now,
    )  # fmt: skip
    dead = False

    def tick(ended: int) -> None:
        nonlocal dead
        if kill_after is not None and not dead and ended >= kill_after:
            fabric.dead.add("prefill")
            dead = True

    def step_prefill() -> None:
        if clock is not None:
            clock.advance(VIRTUAL_STEP)
        if not dead:
            engine.step()

    return run_load(
        decode, "prefill", requests=requests, concurrency=concurrency, blocks_per_request=blocks_per_request,
        deadline=timeouts.deadline(mode), settle=timeouts.defer + timeouts.transfer + 0.5, step_prefill=step_prefill,
        prefill_stats=lambda: DEAD_PEER if dead else engine.stats(), faults=lambda: _merge(pa, da), tick=tick,
        clock=now, wait=wait,
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

    plan = fault_plan(fault_rate, faults, seed)
    with PeerProcess(
        blocks=int(concurrency * blocks_per_request * 1.25), block_bytes=block_bytes,
        params=timeouts.producer("write"), fault_rate=fault_rate, faults=tuple(faults), fault_seed=seed,
        prefill=prefill,
    ) as peer:  # fmt: skip
        base = MooncakeAgent()
        da = faulty(base, plan, UNREACHABLE)
        dt = PlaneTransport(da)
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
                faults=lambda: dict(da.injected), tick=tick,
                prefill_stats=(lambda: DEAD_PEER) if kill_after is not None else None,
            )  # fmt: skip
        finally:
            base.close()
    prefill_faults = result.prefill.get("faults", {})
    result.faults = {**result.faults, **prefill_faults}
    return result


def _merge(*agents: FaultyAgent) -> dict[str, int]:
    return dict(sum((a.injected for a in agents), Counter()))


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

    plan = fault_plan(fault_rate, default_faults(mode), seed)
    pa, da = faulty(NixlAgent("moriio-prefill"), plan), faulty(NixlAgent("moriio-decode"), plan)
    p, d = pt, dt = PlaneTransport(pa), PlaneTransport(da)
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
        step_prefill=prefill.step, prefill_stats=prefill.stats, faults=lambda: _merge(pa, da),
    )  # fmt: skip
