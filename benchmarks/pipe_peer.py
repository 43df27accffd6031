"""The prefill process of the release-in-flight measurements (``nixl_release_in_flight.py``,
``moriio_release_in_flight.py``): a script started again with ``--peer SIZE FD``, answering one JSON line per
command on its own pipe, stopped, resumed and killed by pid so a READ from it can be held in flight."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def proc_state(pid: int) -> str:
    """The process's state letter in /proc (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class PipePeer:
    """``script --peer SIZE FD`` in a subprocess; its first answer (``hello``) says where its buffers are."""

    def __init__(self, script: str, size: int) -> None:
        read_fd, write_fd = os.pipe()
        args = [sys.executable, script, "--peer", str(size), str(write_fd)]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, pass_fds=(write_fd,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb")
        try:
            self.hello = self._answer(60.0)
        except BaseException:
            self.close()
            raise

    def _answer(self, timeout: float) -> dict[str, Any]:
        ready, _, _ = select.select([self._replies], [], [], timeout)
        line = self._replies.readline() if ready else b""
        if not line:
            raise RuntimeError(f"the prefill peer (pid {self.proc.pid}) did not answer within {timeout} s")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}).encode() + b"\n")
        self.proc.stdin.flush()
        return self._answer(10.0)

    def stop(self) -> None:
        """SIGSTOP, and wait until the kernel says it is stopped."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while proc_state(self.proc.pid) != "T":
            if time.monotonic() > deadline:
                raise RuntimeError("SIGSTOP was not delivered within 5 s")
            time.sleep(0.002)

    def cont(self) -> None:
        """SIGCONT, and wait (at most 5 s) until it runs."""
        os.kill(self.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5.0
        while proc_state(self.proc.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.002)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Resume it, close its stdin (it exits), wait; killed if it does not."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._replies.close()
