"""A peer process: a Python module in a subprocess of its own, talked to in JSON lines with a deadline on every answer.

Both halves of one small protocol live here. The parent (:class:`PeerProcess`)
starts ``python -m MODULE ARGS`` (or ``python SCRIPT.py ARGS``) with stdout and
stderr going to a log, writes commands as JSON lines to its stdin, and reads
answers as JSON lines from a pipe of their own, so nothing a native library
prints can corrupt them. The peer (:func:`say`, :func:`serve`) says hello once,
then answers one line per command until its stdin closes.

Every wait has a deadline, and a peer that does not answer is told apart from
one that is gone: :class:`PeerError` names the module, the pid, the exit code
or signal (or that it is still running, or stopped) and the end of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

REPLY_FD = "KVFSM_PEER_REPLY_FD"
"""The environment variable that tells a peer which file descriptor its answers go to."""
LOG_TAIL = 2000
"""How many bytes of a peer's log a :class:`PeerError` quotes."""


class PeerError(RuntimeError):
    """A peer process did not answer in time, died, or refused a command."""


class PeerProcess:
    """``python -m module args`` in a subprocess; :attr:`hello` is the first line it said.

    ``module`` is a module name, or the path of a script (ending in ``.py``).
    ``env`` is added to this process's environment. ``log`` keeps the peer's
    stdout and stderr in a file; without it they go to a temporary file that
    only a :class:`PeerError` quotes. The constructor waits ``start_timeout``
    seconds for the hello; with ``None`` it returns at once, and
    :meth:`wait_hello` waits (so that several peers start side by side).
    ``answer_timeout`` is how long :meth:`call` waits unless told. Use it as a
    context manager, or call :meth:`stop`.
    """

    def __init__(
        self,
        module: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        start_timeout: float | None = 60.0,
        answer_timeout: float = 30.0,
    ) -> None:
        self.module = module
        self.answer_timeout = answer_timeout
        self.hello: dict[str, Any] = {}
        command = [sys.executable, module] if module.endswith(".py") else [sys.executable, "-m", module]
        read_fd, write_fd = os.pipe()
        self._log: IO[bytes] = open(log, "w+b") if log is not None else tempfile.TemporaryFile()  # noqa: SIM115
        self._buffer = b""
        self._sent = 0
        """Commands sent so far; each carries its number (``seq``), and so does its answer."""
        self._stopped = False
        try:
            self.proc = subprocess.Popen(
                [*command, *args], stdin=subprocess.PIPE, stdout=self._log, stderr=self._log, pass_fds=(write_fd,),
                env={**os.environ, **(env or {}), REPLY_FD: str(write_fd)},
            )  # fmt: skip
        except BaseException:
            os.close(read_fd)
            self._log.close()
            raise
        finally:
            os.close(write_fd)
        self._replies = os.fdopen(read_fd, "rb")
        if start_timeout is not None:
            self.wait_hello(start_timeout)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __repr__(self) -> str:
        return f"the peer process `{self.module}` (pid {self.pid})"

    def wait_hello(self, timeout: float) -> dict[str, Any]:
        """Wait at most ``timeout`` seconds for the peer's first line (:attr:`hello`); stop it if that fails.

        A hello ``{"error": ...}`` is a peer that could not start.
        """
        try:
            self.hello = self._answer(time.monotonic() + timeout, "its hello", timeout)
            if "error" in self.hello:
                raise PeerError(f"{self!r} did not start: {self.hello['error']}; {self._tail()}")
        except BaseException:
            self.stop(wait=1.0)
            raise
        return self.hello

    def call(self, op: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send ``{"op": op, **args}`` and wait at most ``timeout`` seconds (:attr:`answer_timeout` unless given)
        for its answer."""
        timeout = self.answer_timeout if timeout is None else timeout
        stdin = self.proc.stdin
        if stdin is None or self.proc.poll() is not None:
            raise self._error(repr(op))
        self._sent += 1
        try:
            stdin.write(json.dumps({"op": op, **args, "seq": self._sent}).encode() + b"\n")
            stdin.flush()
        except BrokenPipeError:
            raise self._error(repr(op)) from None
        deadline = time.monotonic() + timeout
        answer = self._answer(deadline, repr(op), timeout)
        while answer.get("seq") != self._sent:  # the late answer to a command that timed out: not this one's
            answer = self._answer(deadline, repr(op), timeout)
        if "error" in answer:
            raise PeerError(f"{self!r} refused {op!r}: {answer['error']}")
        return answer

    def _answer(self, deadline: float, what: str, timeout: float) -> dict[str, Any]:
        """The next line from the answer pipe, read by ``deadline`` (``time.monotonic()``), ``timeout`` after asking."""
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._error(what, silent_for=timeout)
            ready, _, _ = select.select([self._replies], [], [], min(left, 1.0))
            if not ready and self.proc.poll() is not None:  # gone, though a child of its may hold the pipe open
                raise self._error(what)
            if ready:
                chunk = os.read(self._replies.fileno(), 1 << 20)
                if not chunk:  # the pipe closed: it exited, or is exiting
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=2.0)
                    raise self._error(what)
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _error(self, what: str, silent_for: float | None = None) -> PeerError:
        """Why the peer did not answer ``what``: it exited (with its code or signal), or it is stopped or silent."""
        code = self.proc.poll()
        if code is not None:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            said = f"{self!r} {how} before answering {what}"
        else:
            stopped = _state(self.pid) == "T"
            said = f"{self!r} is {'stopped (SIGSTOP)' if stopped else 'running'} but did not answer {what}"
            said += f" within {silent_for:g} s" if silent_for is not None else " (it closed its answer pipe)"
        return PeerError(f"{said}; {self._tail()}")

    def _tail(self) -> str:
        try:
            self._log.flush()
            size = self._log.seek(0, os.SEEK_END)
            self._log.seek(max(0, size - LOG_TAIL))
            tail = self._log.read().decode(errors="replace").strip()
        except (OSError, ValueError):
            return "its log could not be read"
        return f"its log ends:\n{tail}" if tail else "it wrote nothing to stdout or stderr"

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig``; for SIGSTOP and SIGCONT, return once the kernel shows it stopped or running (at most 5 s)."""
        os.kill(self.pid, sig)
        if sig in (signal.SIGSTOP, signal.SIGCONT):
            deadline = time.monotonic() + 5.0
            while (_state(self.pid) == "T") != (sig == signal.SIGSTOP):
                if time.monotonic() > deadline:
                    raise PeerError(f"{self!r} did not take {sig.name} within 5 s")
                time.sleep(0.002)

    def kill(self) -> None:
        """SIGKILL the peer (a peer dead mid-run) and reap it."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, wait: float = 10.0) -> None:
        """Resume it if stopped, close its stdin (it exits), wait ``wait`` seconds, then SIGKILL it; close the
        pipes and the log."""
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.kill()
        self._replies.close()
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _state(pid: int) -> str:
    """The process's state letter in /proc (``T``: stopped; ``?`` once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


# ---------------------------------------------------------------- the peer's side

_reply: IO[bytes] | None = None


def say(msg: dict[str, Any]) -> None:
    """Write one JSON line to the parent's answer pipe (the hello first, then one answer per command)."""
    global _reply
    if _reply is None:
        _reply = os.fdopen(int(os.environ[REPLY_FD]), "wb")
    _reply.write(json.dumps(msg).encode() + b"\n")
    _reply.flush()


def serve(
    handle: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    *,
    tick: Callable[[], None] | None = None,
    every: float | Callable[[], float] = 0.002,
) -> None:
    """Answer each command on stdin with ``handle(command)`` until stdin closes; call ``tick`` in between.

    Without ``tick`` it sleeps until a command comes; with one, it waits at
    most ``every`` seconds for a command between two ticks (``every()`` when it
    is a function, asked before each wait). An exception from
    ``handle`` is answered as ``{"error": ...}``, which the parent raises as a
    :class:`PeerError`; one from ``tick`` ends the peer.
    """
    stdin = sys.stdin.buffer
    pending = b""
    while True:
        wait = None if tick is None else every() if callable(every) else every
        ready, _, _ = select.select([stdin], [], [], wait)
        if ready:
            chunk = os.read(stdin.fileno(), 1 << 20)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, _, pending = pending.partition(b"\n")
                cmd = json.loads(line)
                try:
                    if handle is None:
                        raise ValueError("this peer takes no commands")
                    answer = handle(cmd)
                except Exception as exc:  # the parent raises it as PeerError
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                say({**answer, "seq": cmd.get("seq")})
        if tick is not None:
            tick()
