"""Start, kill and restart a real ``mooncake_master`` on loopback, by pid.

Used by the test fixture, the soak benchmark and anyone trying the driver on
one machine. The master binds ``127.0.0.1`` only (RPC and metrics; the HTTP
metadata server stays off: clients use ``P2PHANDSHAKE``), on free ports, and
is ready when its RPC port accepts a connection (well under a second here).
Its log goes to a file, never to a pipe nobody reads (a full pipe would stall
it), and on Linux it is killed when the process that started it dies, so a
crashed test run leaves no master behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from ...drivers.mooncake.codes import StoreUnavailable


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL the master when the process that started it dies, even by a crash."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def master_binary() -> str | None:
    """``mooncake_master`` next to this interpreter (the venv's bin/), else on PATH, else None."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


class MasterProcess:
    """One ``mooncake_master`` child process; :attr:`address` is what clients pass as ``master_server_addr``.

    ``lease_ttl_ms`` sets ``--default_kv_lease_ttl`` (the master's default is
    10 s; tests shorten it). Use as a context manager, or call :meth:`start`
    and :meth:`stop`; :meth:`stop` kills by pid even if the master hangs.
    """

    def __init__(self, *, binary: str | None = None, lease_ttl_ms: int | None = None, port: int | None = None) -> None:
        found = binary or master_binary()
        if found is None:
            raise StoreUnavailable(
                "mooncake_master not found next to the interpreter or on PATH; pip install 'kvfsm[mooncake]'"
            )
        self.binary = found
        self.lease_ttl_ms = lease_ttl_ms
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self._logdir = tempfile.TemporaryDirectory(prefix="kvfsm-mooncake-master-")
        self.log_path = Path(self._logdir.name) / "master.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 10.0) -> MasterProcess:
        """Spawn the master and wait until its RPC port accepts connections; raises with its log tail if not."""
        if self.running():
            return self
        args = [
            self.binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--enable_http_metadata_server=false",
        ]
        if self.lease_ttl_ms is not None:
            args.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise StoreUnavailable(f"mooncake_master exited with {self.process.returncode}: {self.log_tail()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        self.kill()
        raise StoreUnavailable(
            f"mooncake_master did not listen on {self.address} within {timeout:g}s: {self.log_tail()}"
        )

    def kill(self) -> None:
        """SIGKILL by pid and reap: the crash case. A no-op when not running."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM by pid, SIGKILL after ``grace`` seconds; then remove the log directory."""
        proc = self.process
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self._logdir.cleanup()

    def restart(self, timeout: float = 10.0) -> MasterProcess:
        """Kill and start again on the same ports: a fresh, empty master at the same address."""
        self.kill()
        return self.start(timeout)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def __enter__(self) -> MasterProcess:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
