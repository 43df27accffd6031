"""``kvfsm demo --engine vllm``: kvfsm's connectors in real vLLM engines under the demo's faults, and the ledger a
user would check: the tokens, the engines' own block pools, the requests that never ended.

Parts, each on engines of its own (the tiny model, made in a temporary folder):

- ``baseline``: one engine without a connector: the tokens every other part must reproduce;
- ``offload``: the CPU-offload connector, two passes with vLLM's prefix cache reset in between, so the second
  is served from kvfsm's CPU tier;
- one P/D pair per connector (``nixl``: the decode side READs; ``moriio``: the prefill WRITEs, seed 001's
  connector), prefill and decode in two processes: every prompt served P then D (NIXL's notifications lost at the
  fault rate); then decode requests aborted while their transfers are stuck; then the prefill killed with
  transfers in flight.

A part is clean when every request that finished normally generated the baseline's tokens, every engine that is
still alive holds no block (vLLM's ``BlockPool``, read after the part), no connector instance is live, and every
request ended within its connector's deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .offline import ENGINE_ENV, prefix_prompts
from .tiny_model import make_tiny_model

Progress = Callable[[str], None]


@dataclass
class PartLedger:
    """One part's outcome, in the terms a user checks."""

    name: str
    what: str
    requests: int = 0
    compared: int = 0
    """Requests that finished normally, so their tokens are compared with the baseline."""
    identical: int = 0
    ended_otherwise: dict[str, int] = field(default_factory=dict)
    """Requests that ended another way (aborted, error), by vLLM's finish reason."""
    hung: int = 0
    """Requests that did not end, or ended after their connector's deadline."""
    blocks_held: dict[str, int] = field(default_factory=dict)
    """Per engine still alive: vLLM blocks not free after the part (the null block excepted)."""
    live: dict[str, int] = field(default_factory=dict)
    """Per engine still alive: connector instances not in a final state."""
    counters: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    """Why the part could not finish (an engine that did not answer, requests that never ended)."""
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return (
            not self.error
            and self.identical == self.compared
            and self.hung == 0
            and not any(self.blocks_held.values())
            and not any(self.live.values())
        )


@dataclass
class EngineLedger:
    """Every part, and whether all are clean."""

    prompts: int
    fault_rate: float
    parts: list[PartLedger] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return all(p.clean for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for part, raw in zip(self.parts, out["parts"], strict=True):
            raw["clean"] = part.clean
        out["clean"] = self.clean
        return out


def _offline(model: Path, connector: str, prefixes: int, per_prefix: int, logs: Path) -> dict[str, Any]:
    """One engine in a process of its own (vLLM keeps one connector per process): its JSON run."""
    out = logs / f"offline-{connector}.json"
    cmd = [sys.executable, "-m", "kvfsm.showcase.engine.offline", str(model), "--connector", connector,
           "--prefixes", str(prefixes), "--per-prefix", str(per_prefix), "--json", str(out)]  # fmt: skip
    with (logs / f"offline-{connector}.log").open("wb") as log:
        proc = subprocess.run(cmd, env={**os.environ, **ENGINE_ENV}, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    if proc.returncode != 0:
        tail = (logs / f"offline-{connector}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"the {connector} engine failed ({proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _offload_part(run: dict[str, Any], baseline: list[list[int]]) -> PartLedger:
    stats = run["stats"]
    part = PartLedger("offload", "offload, pass 2 from CPU")
    for tokens in run["passes"]:
        part.requests += len(tokens)
        part.compared += len(tokens)
        part.identical += sum(a == b for a, b in zip(tokens, baseline, strict=True))
    part.blocks_held = {"engine": run["gpu_blocks"] - 1 - run["gpu_blocks_free_after"]}
    part.live = {"engine": int(stats.get("live", 0))}
    part.counters = {k: stats[k] for k in ("hits", "blocks_loaded", "stores_done", "loads_failed") if k in stats}
    part.seconds = round(run["seconds"], 1)
    return part


def _pd_parts(connector: str, pd_run: Any, baseline: list[list[int]], deadline: float, lost: float) -> list[PartLedger]:
    """The P/D run's phases as ledger parts."""
    what = {
        "serve": "serve" + (f", {lost:.0%} notifs lost" if lost else ""),
        "abort": "aborts mid-transfer",
        "kill": "prefill killed",
    }
    parts = []
    for phase in pd_run.phases:
        part = PartLedger(f"{connector}.{phase.name}", f"{connector}: {what[phase.name]}")
        part.requests = len(phase.requests)
        for r in phase.requests:
            if r.finish_reason == "length":
                part.compared += 1
                part.identical += r.tokens == baseline[r.prompt]
            else:
                part.ended_otherwise[r.finish_reason] = part.ended_otherwise.get(r.finish_reason, 0) + 1
            if phase.name != "serve" and r.seconds > deadline:
                part.hung += 1
        for role, stats in phase.engines.items():
            part.blocks_held[role] = stats["gpu_blocks"] - 1 - stats["free_blocks"]
            part.live[role] = int(stats["connector"].get("live", 0))
        if not phase.settled and not any(part.blocks_held.values()) and not any(part.live.values()):
            part.hung += 1  # the engines never went idle: something is still held or running
        part.seconds = phase.seconds
        parts.append(part)
    return parts


def run_engine_demo(
    *,
    prefixes: int = 4,
    per_prefix: int = 6,
    fault_rate: float = 0.1,
    connectors: Sequence[str] = ("nixl", "moriio"),
    progress: Progress | None = None,
) -> EngineLedger:
    """Every part on fresh engines; ``progress`` hears each part's name as it starts."""
    from ...harness.peer import PeerError
    from .pd import PDOptions
    from .pd import run as pd_run

    say = progress or (lambda _msg: None)
    t0 = time.monotonic()
    ledger = EngineLedger(prefixes * per_prefix, fault_rate)
    with tempfile.TemporaryDirectory(prefix="kvfsm-engine-demo-") as tmp:
        logs = Path(tmp)
        say("making the tiny model")
        model = make_tiny_model(logs / "tiny-llama")
        say("baseline: one engine without a connector")
        baseline = _offline(model, "none", prefixes, per_prefix, logs)["passes"][0]
        say("offload: the CPU-offload connector, a second pass from kvfsm's CPU tier")
        ledger.parts.append(_offload_part(_offline(model, "cpu_offload", prefixes, per_prefix, logs), baseline))
        for connector in connectors:
            # Lost notifications are NIXL's fault injection; the MoRIIO plug injects none of its own.
            lost = fault_rate if connector == "nixl" else 0.0
            options = PDOptions(abort_timeout=6.0, read_timeout=6.0, lost_notif=lost)
            say(f"{connector}: a prefill and a decode engine in two processes (serve, abort, kill)")
            started = time.monotonic()
            (logs / connector).mkdir()
            try:
                result = pd_run(
                    model, connector, prefix_prompts(prefixes=prefixes, per_prefix=per_prefix),
                    phases=("serve", "abort", "kill"), options=options, logs=logs / connector,
                )  # fmt: skip
            except PeerError as exc:  # requests that never ended, or an engine that stopped answering
                failed = PartLedger(connector, f"{connector} P/D", error=str(exc))
                failed.seconds = round(time.monotonic() - started, 1)
                ledger.parts.append(failed)
                continue
            ledger.parts += _pd_parts(connector, result, baseline, options.decode_deadline + 5.0, lost)
    ledger.seconds = round(time.monotonic() - t0, 1)
    return ledger
