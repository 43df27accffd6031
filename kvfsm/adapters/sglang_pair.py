"""A decode server and prefill servers of SGLang, each in its own process, driven room by room from this one.

:class:`Pair` starts the servers of :mod:`.sglang_pd` (which import SGLang;
this module does not) and sends each a command at a time over a pipe: the
schedulers' decisions (begin a room, take pages, run the forward pass,
abort), the gates that hold a chunk or an ABORT, and waits on a room's
tracker state. Every wait is on a condition the servers signal; its limit
only stops a hung run.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ..spec import Spec
from ..spec.bundled import SPECS
from ..spec.system import load_system

HANG = 60.0
"""Seconds a wait may last before the run counts as hung (each wait returns as soon as its condition holds)."""



def spec_of(protocol: str, role: str) -> Spec:
    """The role's machine spec in ``specs/pd_abort/<protocol>.yaml``: what its rooms do, and where they end."""
    return load_system(SPECS / "pd_abort" / f"{protocol}.yaml").roles[role].spec


@dataclass(frozen=True)
class Layout:
    """One side's KV buffers: ``layers`` × (K, V) of ``pages`` pages of ``page_tokens`` tokens, float32."""

    pages: int = 8
    page_tokens: int = 16
    heads: int = 2
    head_dim: int = 32
    layers: int = 2


@dataclass(frozen=True)
class RoleConfig:
    """What one SGLang server of the pair is: its role, protocol, ports, pages and where its journal goes."""

    role: str
    protocol: str
    """``merged_fix``: SGLang with ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=0`` (PR #27372 as merged);
    ``sglang``: SGLang 0.5.23 as it ships, the drain ACK on and decode giving up on it after a release timeout;
    ``corrected``: the drain ACK on, and decode keeping the pages until it, resending ABORT (``decode_corrected``)."""
    bootstrap_port: int
    layout: Layout = field(default_factory=Layout)
    pages_per_room: int = 4
    journal: str = ""
    params: dict[str, float] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    """SGLang's environment knobs for this server (its heartbeat interval, say)."""


def pattern(room: int) -> float:
    """The value every element of ``room``'s KV is (distinct per room, exact in float32)."""
    return float(room % 100_000 + 1)


def _serve(conn: Connection, config: RoleConfig) -> None:
    """The server process's entry point (importing SGLang happens there, not here)."""
    from .sglang_pd import serve

    serve(conn, config)


class ServerError(RuntimeError):
    """A server process failed a command (its traceback is the message)."""


class Server:
    """One SGLang server process and its command pipe."""

    def __init__(self, config: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.config = config
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, config), daemon=True)
        self.process.start()
        child.close()

    def ready(self, limit: float = 180.0) -> None:
        if not self.conn.poll(limit):
            raise ServerError(f"{self.config.role} server did not start within {limit} s")
        kind, payload = self.conn.recv()
        if kind != "ready":
            raise ServerError(f"{self.config.role} server failed to start:\n{payload}")

    def call(self, method: str, *args: Any, limit: float = HANG + 30.0) -> Any:
        self.conn.send((method, args))
        if not self.conn.poll(limit):
            raise ServerError(f"{self.config.role}: {method}{args} did not answer within {limit} s")
        kind, payload = self.conn.recv()
        if kind != "ok":
            raise ServerError(f"{self.config.role}: {method}{args} failed:\n{payload}")
        return payload

    def kill(self) -> None:
        if self.process.pid is not None and self.process.is_alive():
            self.process.kill()
        self.process.join()

    def close(self) -> dict[str, Any]:
        summary: dict[str, Any] = self.call("close")
        self.process.join(30)
        return summary


class Pair:
    """One decode server and ``prefills`` prefill servers of one protocol (``merged_fix``, ``sglang`` or ``corrected``).

    Journals go to ``journal_dir`` as ``<name>-decode.jsonl`` and
    ``<name>-prefill<i>.jsonl``.
    """

    def __init__(
        self,
        protocol: str,
        journal_dir: str | Path,
        *,
        name: str = "pair",
        prefills: int = 1,
        base_port: int = 18998,
        pages: int = 8,
        pages_per_room: int = 4,
        env: dict[str, str] | None = None,
        decode_params: dict[str, float] | None = None,
    ) -> None:
        layout = Layout(pages=pages)
        self.journals: dict[str, Path] = {}
        configs: list[Any] = []
        for i in range(prefills):
            path = Path(journal_dir) / f"{name}-prefill{i}.jsonl"
            self.journals[f"prefill{i}"] = path
            configs.append(
                RoleConfig("prefill", protocol, base_port + i, layout, pages_per_room, str(path), env=dict(env or {}))
            )
        path = Path(journal_dir) / f"{name}-decode.jsonl"
        self.journals["decode"] = path
        decode = RoleConfig(
            "decode", protocol, base_port, layout, pages_per_room, str(path), dict(decode_params or {}), dict(env or {})
        )
        self.protocol = protocol
        self.decode_spec, self.prefill_spec = spec_of(protocol, "decode"), spec_of(protocol, "prefill")
        self.addrs = [f"127.0.0.1:{c.bootstrap_port}" for c in configs]
        self.prefills = [Server(c) for c in configs]
        self.decode = Server(decode)
        for server in (*self.prefills, self.decode):
            server.ready()
        for addr in self.addrs:
            if not self.decode.call("connect", addr, HANG):
                raise ServerError(f"decode could not reach the prefill bootstrap server at {addr}")
        self.closed: dict[str, dict[str, Any]] = {}

    # -- one room, step by step ------------------------------------------------

    def begin(self, room: int, prefill: int = 0) -> None:
        """Both sides create the room (SGLang's sender and receiver); both trackers begin it."""
        self.prefills[prefill].call("begin", room)
        self.decode.call("begin", room, self.addrs[prefill])

    def bootstrapped(self, room: int) -> str | None:
        """Decode's prealloc queue takes the room's pages and sends their indices; None while no pages are free."""
        state: str | None = self.decode.call("bootstrapped", room)
        return state

    def wait(self, server: Server, room: int, states: Sequence[str]) -> str | None:
        state: str | None = server.call("wait", room, list(states), HANG)
        return state

    def wait_decode(self, room: int, *states: str) -> str | None:
        """Until the decode room is in one of ``states`` (default: any final state of its spec)."""
        return self.wait(self.decode, room, states or self.decode_spec.finals)

    def wait_prefill(self, room: int, *states: str, prefill: int = 0) -> str | None:
        """Until the prefill room is in one of ``states`` (default: any final state of its spec)."""
        return self.wait(self.prefills[prefill], room, states or self.prefill_spec.finals)

    def received(self, state: str | None) -> bool:
        """Whether a decode room in ``state`` got its pages: a ``final: success`` state of the decode spec."""
        return state is not None and self.decode_spec.states[state].final == "success"

    def transfer(self, room: int, prefill: int = 0) -> tuple[str | None, str | None]:
        """A room from begin to both final states, nothing injected; returns (prefill's, decode's)."""
        self.begin(room, prefill)
        self.bootstrapped(room)
        self.wait_prefill(room, "waiting_input", prefill=prefill)
        self.prefills[prefill].call("forward", room)
        return self.wait_prefill(room, prefill=prefill), self.wait_decode(room)

    def close(self) -> dict[str, dict[str, Any]]:
        """Close every server (their trackers abort what is live, their journals are flushed); their summaries."""
        for i, server in enumerate(self.prefills):
            if server.process.is_alive():
                self.closed[f"prefill{i}"] = server.close()
        if self.decode.process.is_alive():
            self.closed["decode"] = self.decode.close()
        return self.closed

    def kill_prefill(self, i: int) -> None:
        self.prefills[i].kill()


# -- scenarios ------------------------------------------------------------------------


def race(pair: Pair, a: int, b: int, *, hold: str, give_up: bool = False) -> list[int]:
    """Seed 002's race on SGLang's classes; returns room ``b``'s pages that held another room's bytes.

    Room ``a`` (prefill 0) is aborted by decode while a write of it cannot be
    stopped, and room ``b`` (prefill 1) wants pages from a pool that has one
    room's worth:

    - ``hold="abort"``, the explorer's shortest trace: decode sends the
      indices, aborts, and prefill's forward pass ends while the ABORT is
      still in flight (held before the bootstrap thread handles it), so the
      chunk passes SGLang's Failed check and writes;
    - ``hold="chunk"``, the hole the report names: the ABORT arrives while a
      chunk is inside ``batch_transfer_sync`` (held after the Failed check).

    Where decode frees ``a``'s pages at the abort (``merged_fix``), ``b``
    takes them and gets its KV before ``a``'s write lands; where decode keeps
    them until prefill says the room is drained (``corrected``), ``b`` takes
    them only after. ``give_up``: decode stops waiting for the drain ACK first
    (``sglang``: its release timeout passes while the write is held).
    """
    if hold not in ("abort", "chunk"):
        raise ValueError(f"hold is 'abort' or 'chunk', not {hold!r}")
    p0 = pair.prefills[0]
    p0.call("gate", hold, True)
    pair.begin(a, 0)
    pair.bootstrapped(a)
    pair.wait_prefill(a, "waiting_input")
    if hold == "chunk":
        p0.call("forward", a)
        p0.call("reached", "chunk", a, HANG)
    pair.decode.call("abort", a)
    if hold == "chunk":
        pair.wait_prefill(a, "draining")
    else:
        p0.call("reached", "abort", a, HANG)
    if give_up:
        pair.wait_decode(a, "released")
    pair.begin(b, 1)
    took = pair.bootstrapped(b) is not None
    if took:
        _finish_transfer(pair, b, 1)
    if hold == "chunk":
        p0.call("gate", "chunk", False)
    else:
        p0.call("forward", a)
    pair.wait_prefill(a)
    p0.call("gate", hold, False)
    pair.wait_decode(a)
    if not took:
        pair.bootstrapped(b)
        _finish_transfer(pair, b, 1)
    corrupted: list[int] = pair.decode.call("finish", b)
    return corrupted


def _finish_transfer(pair: Pair, room: int, prefill: int) -> None:
    pair.wait_prefill(room, "waiting_input", prefill=prefill)
    pair.prefills[prefill].call("forward", room)
    pair.wait_prefill(room, prefill=prefill)
    pair.wait_decode(room)


FAULTS = ("none", "abort_bootstrapping", "abort_waiting", "race_abort", "race_chunk")


def soak(pair: Pair, rooms: int, *, seed: int = 0, first_room: int = 1000) -> dict[str, Any]:
    """``rooms`` rooms, each with a fault drawn at random from :data:`FAULTS`; corrupted pages by bytes, per fault.

    A race takes two rooms (the aborted one and the one that wants its pages).
    """
    import random

    rng = random.Random(seed)
    corrupted: dict[str, int] = dict.fromkeys(FAULTS, 0)
    drawn: dict[str, int] = dict.fromkeys(FAULTS, 0)
    room = first_room
    end = first_room + rooms
    while room < end:
        fault = rng.choice(FAULTS)
        if fault.startswith("race") and room + 1 >= end:
            fault = "none"
        drawn[fault] += 1
        if fault.startswith("race"):
            corrupted[fault] += len(race(pair, room, room + 1, hold=fault.removeprefix("race_")))
            room += 2
            continue
        prefill = rng.randrange(len(pair.prefills))
        pair.begin(room, prefill)
        if fault == "abort_bootstrapping":
            pair.decode.call("abort", room)
        else:
            pair.bootstrapped(room)
            pair.wait_prefill(room, "waiting_input", prefill=prefill)
            if fault == "abort_waiting":
                pair.decode.call("abort", room)
            else:
                pair.prefills[prefill].call("forward", room)
        pair.wait_prefill(room, prefill=prefill)
        if pair.received(pair.wait_decode(room)):
            corrupted[fault] += len(pair.decode.call("finish", room))
        room += 1
    return {"rooms": rooms, "drawn": drawn, "corrupted": corrupted}
