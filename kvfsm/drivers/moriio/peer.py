"""A MoRIIO prefill engine on the real Mooncake TransferEngine, in a process of its own.

``python -m kvfsm.drivers.moriio.peer`` builds a :class:`~.producer.PrefillEngine`
over a :class:`~.mooncake.MooncakeTransport` (behind a
:class:`~.faults.FaultyTransport` when a fault rate is given), prints its
transport name as one JSON line, and steps it until stdin closes. Requests
(``prefill``), ``remote_blocks``, ``release`` and ``stats_query`` reach it
over its ZMQ socket, like any other message. ``--prefill module:function``
runs another prefill the caller names (seed 001's shape:
``kvfsm.showcase.moriio_seed:pre_fix_prefill``). :class:`PeerProcess`
starts it, waits for its name with a deadline, and stops or kills it by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time


class PeerError(RuntimeError):
    """The peer process did not start in time or died."""


class PeerProcess:
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
            sys.executable, "-m", "kvfsm.drivers.moriio.peer", "--mode", mode, "--blocks", str(blocks),
            "--block-bytes", str(block_bytes), "--params", json.dumps(params or {}),
            "--fault-rate", str(fault_rate), "--faults", ",".join(faults), "--fault-seed", str(fault_seed),
        ]  # fmt: skip
        if prefill is not None:
            args += ["--prefill", prefill]
        env = {**os.environ, "MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
        try:
            self.name = self._hello(start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _hello(self, timeout: float) -> str:
        out = self.proc.stdout
        if out is None:
            raise PeerError("the prefill peer has no stdout")
        ready, _, _ = select.select([out], [], [], timeout)
        line = out.readline() if ready else b""
        if not line:
            raise PeerError(f"the prefill peer (pid {self.pid}) did not start within {timeout} s")
        name: str = json.loads(line)["name"]
        return name

    def kill(self) -> None:
        """SIGKILL the peer (a dead prefill, mid-run) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        """Close stdin, so the peer exits; kill it by pid if it has not within 10 s."""
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvfsm.drivers.moriio.peer")
    ap.add_argument("--mode", choices=["write", "read"], default="write")
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--block-bytes", type=int, required=True)
    ap.add_argument("--params", default="{}")
    ap.add_argument("--fault-rate", type=float, default=0.0)
    ap.add_argument("--faults", default="")
    ap.add_argument("--fault-seed", type=int, default=0)
    ap.add_argument("--prefill", default=None, help="another prefill, as 'module:function' (cluster.prefill_variant)")
    opts = ap.parse_args(argv)
    from .faults import FaultPlan, FaultyTransport
    from .mooncake import UNREACHABLE, MooncakeTransport
    from .producer import PrefillEngine
    from .transport import Transport

    base = MooncakeTransport()
    transport: Transport = base
    kinds = tuple(k for k in opts.faults.split(",") if k)
    if kinds:
        transport = FaultyTransport(base, FaultPlan(opts.fault_rate, kinds, opts.fault_seed), UNREACHABLE)
    from .cluster import prefill_variant

    extra = prefill_variant(opts.prefill, opts.mode)
    params = None if extra else json.loads(opts.params)
    engine = PrefillEngine(transport, opts.blocks, opts.block_bytes, mode=opts.mode, params=params, **extra)
    sys.stdout.write(json.dumps({"name": base.name, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    stdin = sys.stdin.buffer
    while True:
        ready, _, _ = select.select([stdin], [], [], 0)
        if ready and not os.read(stdin.fileno(), 4096):
            break
        engine.step()
        if engine.tracker.live() == 0 and not engine.queued:
            base.mailbox.wait(0.005)
        else:
            time.sleep(0.001)
    engine.tracker.close()
    base.close()
    os._exit(0)  # the TransferEngine's teardown at interpreter exit is not needed


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1:]))
