"""Prefill ranks with real NIXL agents in a subprocess, driven over a pipe: the far side of the real-agent tests.

``python -m kvfsm.drivers.nixl.peer`` hosts one :class:`~.prefill.PrefillRank`
per prefill TP rank, each with its own :class:`~.agent.NixlAgent`, and steps
them every couple of milliseconds (notifications in, expiries, finished
requests). Commands arrive as JSON lines on stdin; answers go back as JSON
lines on a separate pipe, so nothing NIXL or UCX prints can corrupt them. The
process exits when stdin closes. :class:`PeerProcess` starts it, talks to it
with a deadline on every answer, and stops it by pid.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from .decode import PeerInfo
from .topology import Topology

ENV = {"UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
"""Set in the peer's environment before it imports ``nixl`` (see :mod:`.agent`)."""


class PeerError(RuntimeError):
    """The peer process did not answer in time, died, or refused a command."""


class PeerProcess:
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
            sys.executable, "-m", "kvfsm.drivers.nixl.peer", "--engine", engine_id,
            "--prefill-tp", str(topology.prefill_tp), "--decode-tp", str(topology.decode_tp),
            "--kv-bytes", str(topology.kv_bytes), "--blocks", str(num_blocks),
            "--abort-timeout", str(abort_timeout),
        ]  # fmt: skip
        if early_within is not None:
            args += ["--early-within", str(early_within)]
        if topology.mla:
            args.append("--mla")
        read_fd, write_fd = os.pipe()
        args += ["--reply-fd", str(write_fd)]
        self._log: IO[bytes] | int = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=self._log, stderr=self._log, pass_fds=(write_fd,),
                env={**os.environ, **ENV},
            )  # fmt: skip
        finally:
            os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb")
        self._buffer = b""
        try:
            self.peers = [PeerInfo.from_json(p) for p in self.call("hello", timeout=start_timeout)["peers"]]
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, timeout: float = 30.0, **args: Any) -> dict[str, Any]:
        """Send one command and wait at most ``timeout`` seconds for its answer."""
        stdin = self.proc.stdin
        if stdin is None or self.proc.poll() is not None:
            raise PeerError(f"the prefill peer (pid {self.pid}) has exited with {self.proc.returncode}")
        try:
            stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
            stdin.flush()
        except BrokenPipeError as exc:
            raise PeerError(f"the prefill peer (pid {self.pid}) is gone") from exc
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"the prefill peer (pid {self.pid}) did not answer {op!r} within {timeout} s")
            ready, _, _ = select.select([self._replies], [], [], left)
            if ready:
                chunk = os.read(self._replies.fileno(), 1 << 20)
                if not chunk:
                    raise PeerError(f"the prefill peer (pid {self.pid}) closed its reply pipe during {op!r}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        if "error" in answer:
            raise PeerError(f"the prefill peer refused {op!r}: {answer['error']}")
        return answer

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

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the peer; for SIGSTOP, return once the kernel shows it stopped."""
        os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:
            stat = Path(f"/proc/{self.pid}/stat")
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
                time.sleep(0.005)

    def stop(self) -> None:
        """Close stdin (the peer exits), wait, and kill it by pid if it does not."""
        proc = self.proc
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        self._replies.close()
        if not isinstance(self._log, int):
            self._log.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfsm.drivers.nixl.peer")
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prefill-tp", type=int, required=True)
    ap.add_argument("--decode-tp", type=int, required=True)
    ap.add_argument("--kv-bytes", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--abort-timeout", type=float, required=True)
    ap.add_argument("--early-within", type=float)
    ap.add_argument("--mla", action="store_true")
    ap.add_argument("--reply-fd", type=int, required=True)
    opts = ap.parse_args(argv)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    from .agent import NixlAgent
    from .prefill import PrefillRank, engine_stats

    topology = Topology(opts.prefill_tp, opts.decode_tp, opts.mla, opts.kv_bytes)
    params = {"abort_timeout": opts.abort_timeout}
    if opts.early_within is not None:
        params["early_within"] = opts.early_within
    ranks = [
        PrefillRank(r, topology, NixlAgent(f"{opts.engine}-{r}-{os.getpid()}"), opts.blocks, params=params)
        for r in range(opts.prefill_tp)
    ]
    reply = os.fdopen(opts.reply_fd, "wb")
    computed: dict[str, list[list[int]]] = {}
    """Requests ``compute`` computed and ``hold`` has not held yet: their blocks per rank."""

    def answer(msg: dict[str, Any]) -> None:
        reply.write(json.dumps(msg).encode() + b"\n")
        reply.flush()

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "hello":
            return {"peers": [
                PeerInfo(opts.engine, r.rank, r.agent.name, r.agent.metadata(), r.blocks.base, r.blocks.block_bytes)
                .to_json() for r in ranks
            ]}  # fmt: skip
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

    stdin = sys.stdin.buffer
    pending = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.002)
        if ready:
            chunk = os.read(stdin.fileno(), 1 << 20)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                try:
                    answer(handle(json.loads(line)))
                except Exception as exc:  # the client turns it into PeerError
                    answer({"error": f"{type(exc).__name__}: {exc}"})
        for r in ranks:
            r.step()
    for r in ranks:
        r.tracker.close()
    os._exit(0)  # NIXL's UCX teardown at interpreter exit is not needed, and can fault


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
