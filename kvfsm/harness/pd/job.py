"""The coordinator of a P/D job: starts a prefill and a decode process, kills and restarts prefill, keeps the ledger.

Every process it starts it stops by pid, on success and on failure alike,
and every wait it does has a deadline. :func:`run_job` returns a
:class:`Ledger`; ``kvfsm demo`` renders it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ...drivers.pd import Pages
from .config import JobConfig

Progress = Callable[[int, int, Counter[str]], None]
"""Called as requests end: (ended, requested, outcomes so far)."""


@dataclass
class Ledger:
    """What a job did and what it left behind; ``clean`` is what the demo's exit code says."""

    config: JobConfig
    requests: int = 0
    finished: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    leaked_blocks: int = 0
    hung: int = 0
    corrupted: int = 0
    faults_injected: dict[str, int] = field(default_factory=dict)
    listener_drops: dict[str, int] = field(default_factory=dict)
    listener_deaths: int = 0
    latency_ms: dict[str, float] = field(default_factory=dict)
    prefill_incarnations: int = 1
    endpoints: dict[str, str] = field(default_factory=dict)
    """With ``metrics``: each process's kvfsm.observe endpoint (``/state``, ``/metrics``), by role."""
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (
            not self.errors
            and self.finished == self.requests
            and self.leaked_blocks == 0
            and self.hung == 0
            and self.corrupted == 0
            and self.listener_deaths == 0
        )

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["config"] = {
            k: v for k, v in asdict(self.config).items() if k not in ("shared_path", "decode_port", "prefill_port")
        }
        out["driver"] = "pd"
        out["protocol"] = self.config.protocol
        out["backend"] = self.config.backend
        out["clean"] = self.clean
        return out


def free_port() -> int:
    """A port free on 127.0.0.1 now (both processes must know it before either starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 2)

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "max": round(ordered[-1] * 1000, 2)}


class _Processes:
    """The job's processes, each stopped by pid when the job ends however it ends."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.started: list[mp.process.BaseProcess] = []

    def start(self, target: Callable[..., None], *args: Any) -> mp.process.BaseProcess:
        process = self.ctx.Process(target=target, args=args, daemon=True)
        process.start()
        self.started.append(process)
        return process

    def kill(self, process: mp.process.BaseProcess) -> None:
        if process.pid is not None and process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=10)

    def stop_all(self) -> None:
        for process in self.started:
            process.join(timeout=0.1)
            self.kill(process)


def run_job(
    config: JobConfig,
    progress: Progress | None = None,
    *,
    kill_prefill: bool | None = None,
    on_endpoint: Callable[[str, str], None] | None = None,
) -> Ledger:
    """Run ``config.requests`` requests through a prefill and a decode process; the ledger of what happened.

    ``kill_prefill`` (default: whenever faults are injected) kills the prefill
    process with SIGKILL once a third of the requests have ended, and starts
    a new one on the same port. With ``config.metrics``, ``on_endpoint(role,
    url)`` is called as each process starts serving its state and metrics.
    """
    from . import decode, prefill

    if kill_prefill is None:
        kill_prefill = config.fault_rate > 0
    began = time.monotonic()
    ledger = Ledger(config, requests=config.requests)
    procs = _Processes()
    with tempfile.TemporaryDirectory(prefix="kvfsm-pd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        shared = str(Path(tmp) / "decode-pages")
        Pages.create_file(shared, config.decode_pages, config.page_elems)
        config = replace(config, decode_port=free_port(), prefill_port=free_port(), shared_path=shared)
        ledger.config = config
        report: Any = procs.ctx.Queue()
        stop = procs.ctx.RawValue("b", 0)  # lock-free: a SIGKILLed prefill cannot leave it locked (prefill.serve)
        latencies: list[float] = []
        outcomes: Counter[str] = Counter()
        reports: dict[str, dict[str, Any]] = {}
        prefill_reports: list[dict[str, Any]] = []
        try:
            incarnation = 1
            pf = procs.start(prefill.serve, config, incarnation, report, stop)
            procs.start(decode.serve, config, report)
            killed = not kill_prefill
            deadline = time.monotonic() + config.deadline + 30
            while "decode" not in reports and time.monotonic() < deadline:
                try:
                    item = report.get(timeout=0.1)
                except queue.Empty:
                    if not any(p.is_alive() for p in procs.started if p is not pf) and report.empty():
                        ledger.errors.append("decode process exited without a report")
                        break
                    continue
                kind = item[0]
                if kind == "done":
                    deadline = time.monotonic() + config.deadline + 30  # a stall bound, as decode's own
                    _, _room, outcome, latency, _bad = item
                    outcomes[outcome] += 1
                    latencies.append(latency)
                    ledger.finished += 1
                    if progress is not None:
                        progress(ledger.finished, config.requests, outcomes)
                    if not killed and ledger.finished >= config.requests // 3:
                        killed = True
                        procs.kill(pf)
                        incarnation += 1
                        pf = procs.start(prefill.serve, config, incarnation, report, stop)
                elif kind == "error":
                    ledger.errors.append(f"{item[1]}: {item[2]}")
                    if item[1] == "decode":
                        break
                elif kind == "prefill":
                    prefill_reports.append(item[1])
                elif kind == "metrics":
                    ledger.endpoints[item[1]] = item[2]
                    if on_endpoint is not None:
                        on_endpoint(item[1], item[2])
                else:
                    reports[kind] = item[1]
            stop.value = 1
            wait_until = time.monotonic() + config.prefill_bootstrap_timeout + config.transfer_timeout + 15
            while not prefill_reports and time.monotonic() < wait_until:
                try:
                    item = report.get(timeout=0.1)
                except queue.Empty:
                    continue
                if item[0] == "prefill":
                    prefill_reports.append(item[1])
                elif item[0] == "error":
                    ledger.errors.append(f"{item[1]}: {item[2]}")
                    break
        finally:
            stop.value = 1
            procs.stop_all()
        ledger.prefill_incarnations = incarnation
        faults: Counter[str] = Counter()
        drops: Counter[str] = Counter()
        for r in [reports.get("decode", {}), *prefill_reports]:
            faults.update(r.get("faults", {}))
            drops.update(r.get("drops", {}))
            ledger.leaked_blocks += int(r.get("leaked_blocks", 0))
            ledger.hung += int(r.get("hung", 0))
            ledger.listener_deaths += 0 if r.get("listener_alive", True) else 1
        if "decode" not in reports:
            ledger.errors.append("no ledger from the decode process")
        if kill_prefill and incarnation > 1:
            faults["kill"] += incarnation - 1
        ledger.corrupted = int(reports.get("decode", {}).get("corrupted", 0))
        ledger.outcomes = dict(outcomes)
        ledger.faults_injected = dict(faults)
        ledger.listener_drops = dict(drops)
        ledger.latency_ms = percentiles(latencies)
        ledger.seconds = round(time.monotonic() - began, 2)
    return ledger
