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

HANG = 60.0
"""Seconds a wait may last before the run counts as hung (each wait returns as soon as its condition holds)."""

DECODE_FINAL = ("received", "failed", "aborted", "expired")
PREFILL_FINAL = ("done", "failed", "aborted", "expired")


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
    ``corrected``: SGLang's deferred drain ACK on, and decode keeping the pages until it (``decode_corrected``)."""
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
    """One decode server and ``prefills`` prefill servers of one protocol (``merged_fix`` or ``corrected``).

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
        return self.wait(self.decode, room, states or DECODE_FINAL)

    def wait_prefill(self, room: int, *states: str, prefill: int = 0) -> str | None:
        return self.wait(self.prefills[prefill], room, states or PREFILL_FINAL)

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
