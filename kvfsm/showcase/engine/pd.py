"""A prefill engine and a decode engine in two OS processes, P/D over a KV connector: the decode side's greedy tokens,
what each connector did, and whether each engine's block pool is whole afterwards.

Each engine is a real vLLM ``LLM`` (the tiny model, the engine settings of
:mod:`.offline`) in a process of its own, as a P/D deployment runs them: the
prefill engine with ``kv_role="kv_producer"``, the decode engine with
``kv_consumer``. The runner sends each prompt to the prefill engine with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``
(vLLM reads them from ``SamplingParams.extra_args``), hands the
``kv_transfer_params`` the prefill returns to the decode engine with the
same prompt, and collects the decode engine's tokens. Everything the two
engines say to each other goes through the connector; the runner only
carries the params, as a router does.

Phases, one after the other on the same two engines (vLLM's prefix caches
are reset between them, so every load is a whole prompt's):

- ``serve``: every prompt, P then D.
- ``abort``: the prefill process is stopped (SIGSTOP) so the decode side's
  transfers stay in flight, half the decode requests are aborted mid-transfer,
  the prefill resumes and the others finish. A connector that keeps an
  aborted load's blocks until its transfer has stopped (a NIXL READ cannot be
  cancelled; a MoRIIO WRITE load waits for the prefill's answer to its
  ``release``) ends those after the prefill resumes; otherwise they end while
  it is stopped, and the prefill frees their blocks at its ``abort_timeout``
  (nobody notified it).
- ``kill``: the prefill process is stopped with READs in flight, then
  SIGKILLed, and more decode requests arrive naming it: every decode request
  must end (error, or recomputed under ``failure_policy="recompute"``)
  within the connector's timeout, never hang.

Lost notifications: ``lost_notif=1.0`` injects them on the decode side (its
READs carry no notification), so the prefill frees every hold at its expiry.

The connector is named: :data:`CONNECTORS` maps a name to a
:class:`PDConnector` (how to configure each engine, what params a prefill and
a decode request carry, how to read the connector's counters), and
``MODULE:ATTR`` names one anywhere. A WRITE-mode connector whose decode
request goes out with the prefill's (MoRIIO's) sets ``concurrent``.

Run it::

    python -m kvfsm.showcase.engine.pd MODEL --connector nixl --phases serve,abort,kill --json out.json

Both engine processes are killed at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from ...harness.peer import PeerError, PeerProcess, say, serve
from .offline import ENGINE_ENV as OFFLINE_ENV
from .offline import make_llm, prefix_prompts

ENGINE_ENV = {
    **OFFLINE_ENV,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "UCX_MODULES": "^ib",
    "NIXL_LOG_LEVEL": "WARN",
}
"""Every engine process: the CPU platform, 1 GiB of KV cache, no hub, the engine core in the process (so its block
pool and connectors can be read), UCX without ibverbs."""

PHASES = ("serve", "abort", "kill")
PREFILL, DECODE = "prefill", "decode"
SLACK = 5.0
"""Seconds a request may end after its connector's deadline: deadlines fire at an engine step, on 2 shared cores."""


@dataclass(frozen=True)
class PDOptions:
    """What the runner asks of the connectors: their deadlines, vLLM's failure policy, injected faults."""

    abort_timeout: float = 15.0
    """Prefill: seconds a held request waits for the decode side's notification."""
    read_timeout: float = 10.0
    """Decode: seconds a READ may stay in flight."""
    handshake_timeout: float = 3.0
    failure_policy: str = "fail"
    """vLLM's ``kv_load_failure_policy`` on the decode engine: ``fail`` (finish_reason error) or ``recompute``."""
    lost_notif: float = 0.0
    """Fraction of decode READs whose notification is lost."""

    @property
    def decode_deadline(self) -> float:
        """The longest a decode request may wait on the connector: a handshake, then a READ."""
        return self.handshake_timeout + self.read_timeout


class PDConnector(Protocol):
    """How the runner uses one P/D connector: it configures both engines, and says what each request carries."""

    name: str
    concurrent: bool
    """False: a decode request carries what the prefill returned (NIXL's READ). True: both go out at once, with
    params the connector makes up front (a WRITE-mode connector such as MoRIIO's)."""
    abort_waits_for_transfer: bool
    """True: an aborted load ends only once its transfer has stopped (a NIXL READ cannot be cancelled:
    docs/nixl.md §6; a MoRIIO WRITE load waits for the prefill's answer: docs/moriio.md §5), so the ``abort``
    phase resumes the prefill before it waits for the aborted requests."""

    def kv_transfer_config(self, role: str, options: PDOptions) -> dict[str, Any]:
        """``KVTransferConfig(**...)`` of the ``prefill`` or ``decode`` engine."""
        ...

    def prefill_params(self, key: str) -> dict[str, Any]:
        """The prefill request's ``kv_transfer_params`` (``key`` names the prompt, the same on both sides)."""
        ...

    def decode_params(self, key: str, from_prefill: Mapping[str, Any] | None) -> dict[str, Any]:
        """The decode request's ``kv_transfer_params``: from what the prefill returned, or (``concurrent``) made up."""
        ...

    def stats(self, scheduler_connector: Any, worker_connector: Any) -> dict[str, Any]:
        """Read inside an engine process: the connector's counters, with ``live`` (its instances still live),
        ``reading`` (decode loads in flight) and ``loads`` (decode loads begun so far)."""
        ...


class NixlPD:
    """kvfsm's ``NixlConnector`` on real NIXL agents: the handshake on the prefill's side channel, decode READs."""

    name = "nixl"
    concurrent = False
    abort_waits_for_transfer = True

    def kv_transfer_config(self, role: str, options: PDOptions) -> dict[str, Any]:
        extra: dict[str, Any] = {"fabric": "nixl", "side_channel_host": "127.0.0.1", "side_channel_port": 0}
        if role == PREFILL:
            extra["abort_timeout"] = options.abort_timeout
        else:
            extra |= {"read_timeout": options.read_timeout, "handshake_timeout": options.handshake_timeout}
            if options.lost_notif > 0:
                extra["inject"] = {"rate": options.lost_notif, "faults": ["lost_notif"]}
        return {
            "kv_connector": "NixlConnector",
            "kv_connector_module_path": "kvfsm.adapters.vllm_nixl",
            "kv_role": "kv_producer" if role == PREFILL else "kv_consumer",
            "engine_id": f"{role}-engine",
            "kv_load_failure_policy": options.failure_policy,
            "kv_connector_extra_config": extra,
        }

    def prefill_params(self, key: str) -> dict[str, Any]:
        return {"do_remote_decode": True}

    def decode_params(self, key: str, from_prefill: Mapping[str, Any] | None) -> dict[str, Any]:
        if not from_prefill or not from_prefill.get("do_remote_prefill"):
            raise ValueError(f"prompt {key}: the prefill returned no kv_transfer_params to load from ({from_prefill})")
        return dict(from_prefill)

    def stats(self, scheduler_connector: Any, worker_connector: Any) -> dict[str, Any]:
        decode = worker_connector.decode
        return {
            "scheduler": scheduler_connector.stats(),
            "worker": worker_connector.stats(),
            "live": worker_connector.live(),
            "reading": 0 if decode is None else len(decode.reading()),
            "loads": 0 if decode is None else decode.tracker.live() + sum(decode.outcomes.values()),
        }


CONNECTORS: dict[str, PDConnector] = {"nixl": NixlPD()}
"""The connectors the runner knows by name; ``MODULE:ATTR`` names any other."""

ALIASES = {"moriio": "kvfsm.adapters.vllm_moriio_pd:MORIIO"}
"""Short names of plugs loaded on first use (loading MoRIIO's fixes the run's notify port)."""


def connector_named(name: str) -> PDConnector:
    """The connector ``name`` (a key of :data:`CONNECTORS` or :data:`ALIASES`, or ``MODULE:ATTR``)."""
    if name in CONNECTORS:
        return CONNECTORS[name]
    name = ALIASES.get(name, name)
    module, colon, attr = name.partition(":")
    if not colon:
        raise ValueError(f"unknown P/D connector {name!r}: one of {sorted({*CONNECTORS, *ALIASES})}, or MODULE:ATTR")
    try:
        found: PDConnector = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"P/D connector {name!r}: cannot load it ({exc})") from None
    return found


# -- the engine process ------------------------------------------------------------------------------


def _serve_engine(argv: list[str]) -> int:
    """An engine process: build the ``LLM``, then step it between commands (JSON lines in, answers on a pipe)."""
    ap = argparse.ArgumentParser(prog="python -m kvfsm.showcase.engine.pd --engine")
    ap.add_argument("--engine", choices=(PREFILL, DECODE), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector", required=True)
    ap.add_argument("--options", required=True)
    opts = ap.parse_args(argv)
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        engine = _Engine(
            opts.engine, opts.model, connector_named(opts.connector), PDOptions(**json.loads(opts.options))
        )
    except Exception as exc:
        say({"error": f"the {opts.engine} engine did not start: {type(exc).__name__}: {exc}"})
        return 1
    say({"ready": engine.stats()})

    def tick() -> None:
        if engine.has_work():
            engine.step()
        elif engine.busy():
            time.sleep(0.001)

    serve(engine.handle, tick=tick, every=lambda: 0 if engine.busy() else 0.005)
    engine.close()
    os._exit(0)  # NIXL's UCX teardown at interpreter exit is not needed, and can fault


class _Engine:
    """One ``LLM`` in this process, its requests by the runner's ids, and what finished since the last poll."""

    def __init__(self, role: str, model: str, connector: PDConnector, options: PDOptions) -> None:
        self.role = role
        self.connector = connector
        self.llm = make_llm(model, connector.kv_transfer_config(role, options))
        self.engine = self.llm.llm_engine
        self.scheduler = self.engine.engine_core.engine_core.scheduler
        self.internal: dict[str, str] = {}
        """The runner's id of each request → vLLM's internal one (the scheduler's key)."""
        self.started: dict[str, float] = {}
        self.aborted: dict[str, float] = {}
        self.finished: list[dict[str, Any]] = []

    def busy(self) -> bool:
        """Requests running or waiting: step at once, do not wait for a command."""
        return bool(self.scheduler.get_num_unfinished_requests())

    def has_work(self) -> bool:
        """Anything to step for: requests, or finished ones whose blocks the connector still holds."""
        return bool(self.scheduler.has_requests()) or bool(self.aborted)

    def step(self) -> None:
        for out in self.engine.step():
            if out.finished and out.request_id in self.started:
                self.finished.append({
                    "id": out.request_id,
                    "tokens": list(out.outputs[0].token_ids),
                    "finish_reason": str(out.outputs[0].finish_reason),
                    "kv_transfer_params": out.kv_transfer_params,
                    "seconds": time.monotonic() - self.started.pop(out.request_id),
                })  # fmt: skip
        for rid, since in list(self.aborted.items()):  # an aborted request ends when vLLM has let go of it
            if self.internal[rid] not in self.scheduler.requests:
                del self.aborted[rid]
                self.finished.append({
                    "id": rid, "tokens": [], "finish_reason": "abort", "kv_transfer_params": None,
                    "seconds": time.monotonic() - self.started.pop(rid, since),
                })  # fmt: skip

    def handle(self, cmd: Mapping[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "submit":
            from vllm import SamplingParams

            for r in cmd["requests"]:
                params = r.get("params")
                sampling = SamplingParams(
                    temperature=0, max_tokens=int(r["max_tokens"]), ignore_eos=True,
                    extra_args={"kv_transfer_params": params} if params else None,
                )  # fmt: skip
                self.internal[r["id"]] = self.engine.add_request(r["id"], {"prompt_token_ids": r["prompt"]}, sampling)
                self.started[r["id"]] = time.monotonic()
            return {}
        if op == "poll":
            done, self.finished = self.finished, []
            return {"finished": done}
        if op == "abort":
            ids = [i for i in cmd["ids"] if i in self.started]
            self.engine.abort_request(ids)
            now = time.monotonic()
            self.aborted.update({i: now for i in ids})
            return {"aborted": ids}
        if op == "stats":
            return self.stats()
        if op == "reset":
            return {"reset": bool(self.llm.reset_prefix_cache())}
        raise ValueError(f"unknown command {op!r}")

    def stats(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        pool = self.scheduler.kv_cache_manager.block_pool
        return {
            "pid": os.getpid(),
            "gpu_blocks": int(pool.num_gpu_blocks),
            "free_blocks": int(pool.get_num_free_blocks()),
            "requests": len(self.scheduler.requests),
            "connector": self.connector.stats(self.scheduler.connector, get_kv_transfer_group()),
        }

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.scheduler.connector.shutdown()


# -- the runner's side ----------------------------------------------------------------------------


class EngineError(PeerError):
    """The engines did not do what a phase asks of them: in time, or at all (an engine that is gone: PeerError)."""


class EngineProcess(PeerProcess):
    """One engine process, driven over a pipe with a deadline on every answer; :meth:`wait_ready` waits for it."""

    def __init__(self, role: str, model: str | Path, connector: str, options: PDOptions, log: Path) -> None:
        self.role = role
        args = [
            "--engine", role, "--model", str(model), "--connector", connector, "--options", json.dumps(asdict(options)),
        ]  # fmt: skip
        super().__init__(
            "kvfsm.showcase.engine.pd", args, env=ENGINE_ENV, log=log, start_timeout=None, answer_timeout=60.0
        )
        self.ready: dict[str, Any] = {}

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        self.ready = self.wait_hello(timeout)["ready"]
        return self.ready


@dataclass
class Request:
    """One decode request as the runner saw it end."""

    key: str
    prompt: int
    tokens: list[int]
    finish_reason: str
    seconds: float
    """From the decode submit to its end (for an abort: until vLLM let go of its blocks)."""


@dataclass
class Phase:
    name: str
    requests: list[Request] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    engines: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each engine's stats once the phase settled (a dead engine: absent)."""
    settled: bool = False
    """Every surviving engine let go of every block (no request left; the connector holds nothing)."""
    seconds: float = 0.0
    error: str | None = None
    """Why the phase did not finish (a request that never ended, an engine that died): later phases do not run."""


@dataclass
class PDRun:
    """What the pair did: per phase, each decode request's tokens and end; each engine's pool and connector."""

    connector: str
    options: dict[str, Any]
    phases: list[Phase] = field(default_factory=list)
    start_seconds: float = 0.0
    seconds: float = 0.0
    logs: dict[str, str] = field(default_factory=dict)

    def phase(self, name: str) -> Phase:
        found = [p for p in self.phases if p.name == name]
        if not found:
            raise KeyError(f"no phase {name!r} in this run ({[p.name for p in self.phases]})")
        return found[0]

    @property
    def ok(self) -> bool:
        return all(p.error is None for p in self.phases)


class Pair:
    """The prefill and the decode engine processes; a context manager that always stops both."""

    def __init__(self, model: str | Path, connector: str, options: PDOptions, logs: Path) -> None:
        self.connector = connector_named(connector)
        self.options = options
        self.engines: dict[str, EngineProcess] = {}
        try:
            for role in (PREFILL, DECODE):
                self.engines[role] = EngineProcess(role, model, connector, options, logs / f"{role}.log")
            for engine in self.engines.values():
                engine.wait_ready(timeout=300)
        except BaseException:
            self.close()
            raise
        self.alive = {PREFILL: True, DECODE: True}

    @property
    def prefill(self) -> EngineProcess:
        return self.engines[PREFILL]

    @property
    def decode(self) -> EngineProcess:
        return self.engines[DECODE]

    def close(self) -> None:
        for engine in self.engines.values():
            engine.stop()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------

    def submit_prefill(self, keys: Sequence[str], prompts: Mapping[str, list[int]]) -> None:
        """Send ``keys`` to the prefill engine: ``max_tokens=1``, with the connector's prefill params."""
        self.prefill.call("submit", requests=[
            {"id": f"p-{k}", "prompt": prompts[k], "max_tokens": 1, "params": self.connector.prefill_params(k)}
            for k in keys
        ])  # fmt: skip

    def prefill_all(
        self, keys: Sequence[str], prompts: Mapping[str, list[int]], timeout: float = 120.0
    ) -> dict[str, Any]:
        """Run ``keys`` through the prefill engine; the params each returned, by key."""
        self.submit_prefill(keys, prompts)
        return {d["id"][2:]: d["kv_transfer_params"] for d in self.finished(PREFILL, len(keys), timeout)}

    def submit_decode(self, keys: Sequence[str], prompts: Mapping[str, list[int]], params: Mapping[str, Any],
                      max_tokens: int) -> None:  # fmt: skip
        self.decode.call("submit", requests=[
            {"id": f"d-{k}", "prompt": prompts[k], "max_tokens": max_tokens,
             "params": self.connector.decode_params(k, params.get(k))}
            for k in keys
        ])  # fmt: skip

    def finished(self, role: str, count: int, timeout: float) -> list[dict[str, Any]]:
        """Poll ``role`` until ``count`` more requests finished there; EngineError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        done: list[dict[str, Any]] = []
        while len(done) < count:
            if time.monotonic() > deadline:
                raise EngineError(f"{count - len(done)} of {count} {role} requests did not finish within {timeout} s")
            done += self.engines[role].call("poll")["finished"]
            if len(done) < count:
                time.sleep(0.05)
        return done

    def meet(self, prompt: list[int], max_tokens: int) -> None:
        """One request P then D if the decode side has never loaded: its handshake done, a later READ can be caught
        in flight (a fault phase's point)."""
        if self.decode.call("stats")["connector"].get("loads") == 0:  # a connector that does not count: no warm-up
            table = {"meet": prompt}
            params = self.prefill_all(["meet"], table)
            self.submit_decode(["meet"], table, params, max_tokens)
            self.finished(DECODE, 1, timeout=120)

    def wait_reading(self, count: int, timeout: float = 60.0) -> None:
        """Until the decode connector has ``count`` loads in flight."""
        deadline = time.monotonic() + timeout
        while self._reading() < count:
            if time.monotonic() > deadline:
                raise EngineError(f"the decode side never had {count} READs in flight within {timeout} s")
            time.sleep(0.05)

    def _reading(self) -> int:
        reading = self.decode.call("stats")["connector"].get("reading")
        if reading is None:
            raise EngineError(f"connector {self.connector.name!r} does not report 'reading': a fault phase needs it")
        return int(reading)

    def settle(self, timeout: float) -> tuple[bool, dict[str, dict[str, Any]]]:
        """Wait until every live engine holds nothing (no request, no live connector instance, every block free but
        the null one), then reset its prefix cache; its stats either way."""
        deadline = time.monotonic() + timeout
        stats: dict[str, dict[str, Any]] = {}
        while True:
            stats = {r: e.call("stats") for r, e in self.engines.items() if self.alive[r]}
            idle = all(
                s["requests"] == 0 and s["connector"]["live"] == 0 and s["free_blocks"] == s["gpu_blocks"] - 1
                for s in stats.values()
            )
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if idle:
            for role, engine in self.engines.items():
                if self.alive[role] and not engine.call("reset")["reset"]:
                    idle = False
        return idle, stats


def _requests(done: Sequence[dict[str, Any]], order: Mapping[str, int]) -> list[Request]:
    out = [
        Request(d["id"][2:], order[d["id"][2:]], d["tokens"], d["finish_reason"], round(d["seconds"], 3)) for d in done
    ]
    return sorted(out, key=lambda r: r.prompt)


def run(
    model: str | Path, connector: str = "nixl", prompts: Sequence[list[int]] | None = None, *,
    phases: Sequence[str] = PHASES, options: PDOptions | None = None, max_tokens: int = 8, fault_prompts: int = 6,
    logs: Path | None = None,
) -> PDRun:  # fmt: skip
    """Start the pair, run ``phases`` on it, stop it. ``fault_prompts`` prompts (the first ones) serve each fault
    phase."""
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phases {unknown}; choose from {PHASES}")
    options = options or PDOptions()
    prompts = list(prompts) if prompts is not None else prefix_prompts()
    table = {str(i): p for i, p in enumerate(prompts)}
    order = {str(i): i for i in range(len(prompts))}
    logs = logs or Path(tempfile.mkdtemp(prefix="kvfsm-pd-"))
    result = PDRun(connector, asdict(options), logs={r: str(logs / f"{r}.log") for r in (PREFILL, DECODE)})
    t0 = time.monotonic()
    with Pair(model, connector, options, logs) as pair:
        result.start_seconds = round(time.monotonic() - t0, 2)
        for name in phases:
            start = time.monotonic()
            try:
                phase = {"serve": _serve, "abort": _abort, "kill": _kill}[name](
                    pair, table, order, options, max_tokens, fault_prompts
                )
            except PeerError as exc:  # recorded, so the phases before it still say what they did
                phase = Phase(name, error=str(exc))
            phase.seconds = round(time.monotonic() - start, 2)
            result.phases.append(phase)
            if phase.error is not None:
                break
    result.seconds = round(time.monotonic() - t0, 2)
    return result


def _serve(pair: Pair, table: dict[str, list[int]], order: dict[str, int], options: PDOptions, max_tokens: int,
           fault_prompts: int) -> Phase:  # fmt: skip
    """Every prompt, P then D; a decode request goes out as soon as its prefill has returned."""
    keys = list(table)
    phase = Phase("serve")
    if pair.connector.concurrent:
        pair.submit_decode(keys, table, {}, max_tokens)
        pair.prefill_all(keys, table)
    else:
        pair.submit_prefill(keys, table)
        deadline = time.monotonic() + 120
        sent = 0
        while sent < len(keys):  # pipelined: each decode request as soon as its prefill is back
            if time.monotonic() > deadline:
                raise EngineError(f"{len(keys) - sent} prefill requests did not finish within 120 s")
            done = pair.prefill.call("poll")["finished"]
            if done:
                back = {d["id"][2:]: d["kv_transfer_params"] for d in done}
                pair.submit_decode(list(back), table, back, max_tokens)
                sent += len(back)
            else:
                time.sleep(0.02)
    phase.requests = _requests(pair.finished(DECODE, len(keys), timeout=300), order)
    phase.settled, phase.engines = pair.settle(timeout=options.abort_timeout + options.decode_deadline + 30)
    return phase


def _abort(pair: Pair, table: dict[str, list[int]], order: dict[str, int], options: PDOptions, max_tokens: int,
           fault_prompts: int) -> Phase:  # fmt: skip
    """Half the decode requests aborted while their READs are stuck on a stopped prefill; the rest finish after it
    resumes."""
    keys = list(table)[:fault_prompts]
    phase = Phase("abort")
    pair.meet(table[keys[-1]], max_tokens)
    params = pair.prefill_all(keys, table)
    pair.prefill.signal(signal.SIGSTOP)
    try:
        pair.submit_decode(keys, table, params, max_tokens)
        pair.wait_reading(len(keys))
        phase.aborted = [f"d-{k}" for k in keys[::2]]
        pair.decode.call("abort", ids=phase.aborted)
        gone: list[dict[str, Any]] = []
        if not pair.connector.abort_waits_for_transfer:
            gone = pair.finished(DECODE, len(phase.aborted), timeout=options.decode_deadline + SLACK)
    finally:
        pair.prefill.signal(signal.SIGCONT)
    gone += pair.finished(DECODE, len(keys) - len(gone), timeout=options.decode_deadline + 60)
    phase.requests = _requests(gone, order)
    phase.settled, phase.engines = pair.settle(timeout=options.abort_timeout + options.decode_deadline + 30)
    return phase


def _kill(pair: Pair, table: dict[str, list[int]], order: dict[str, int], options: PDOptions, max_tokens: int,
          fault_prompts: int) -> Phase:  # fmt: skip
    """The prefill process SIGKILLed with READs in flight, and more decode requests naming it after its death."""
    keys = list(table)[fault_prompts : 2 * fault_prompts] or list(table)[:fault_prompts]
    phase = Phase("kill")
    pair.meet(table[keys[-1]], max_tokens)
    params = pair.prefill_all(keys, table)
    before, after = keys[: len(keys) // 2 or 1], keys[len(keys) // 2 or 1 :]
    pair.prefill.signal(signal.SIGSTOP)
    pair.submit_decode(before, table, params, max_tokens)
    pair.wait_reading(len(before))
    pair.prefill.kill()
    pair.alive[PREFILL] = False
    pair.submit_decode(after, table, params, max_tokens)
    phase.requests = _requests(pair.finished(DECODE, len(keys), timeout=2 * options.decode_deadline + 60), order)
    phase.settled, phase.engines = pair.settle(timeout=options.decode_deadline + 30)
    return phase


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--engine"]:
        return _serve_engine(argv)
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("model", help="a model folder (kvfsm.showcase.engine.tiny_model makes one)")
    parser.add_argument("--connector", default="nixl", help=f"one of {sorted(CONNECTORS)}, or MODULE:ATTR")
    parser.add_argument("--phases", default="serve", help=f"comma-separated, from {','.join(PHASES)}")
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--fault-prompts", type=int, default=6)
    parser.add_argument("--abort-timeout", type=float, default=PDOptions.abort_timeout)
    parser.add_argument("--read-timeout", type=float, default=PDOptions.read_timeout)
    parser.add_argument("--handshake-timeout", type=float, default=PDOptions.handshake_timeout)
    parser.add_argument("--failure-policy", choices=("fail", "recompute"), default="fail")
    parser.add_argument(
        "--lost-notif", type=float, default=0.0, help="fraction of decode READs whose notification is lost"
    )
    parser.add_argument("--json", type=Path, help="write the run here")
    args = parser.parse_args(argv)
    options = PDOptions(
        args.abort_timeout, args.read_timeout, args.handshake_timeout, args.failure_policy, args.lost_notif
    )
    result = run(
        args.model, args.connector, prefix_prompts(prefixes=args.prefixes, per_prefix=args.per_prefix),
        phases=[p for p in args.phases.split(",") if p], options=options, max_tokens=args.max_tokens,
        fault_prompts=args.fault_prompts,
    )  # fmt: skip
    text = json.dumps(asdict(result))
    if args.json:
        args.json.write_text(text)
    else:
        print(text)
    for p in result.phases:
        if p.error is not None:
            print(f"phase {p.name} failed: {p.error}", file=sys.stderr)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
