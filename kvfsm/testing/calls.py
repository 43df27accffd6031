"""How the tests call into a driver: each call timed, each factory call counted, and a failure named as the driver's.

A driver that fails at run time (its factory raises on some call, or a call
never returns) is a finding about the driver: :class:`DriverError` (and,
inside a model-based run, :class:`DriverFault`) name which call of which
object failed. A driver that cannot be used at all (a bad ``MODULE:FACTORY``,
a missing method) is a :class:`FactoryError` or a ``BindingError``.

:class:`CallTimer` guards one call at a time (the factory, ``observe``, a
hook, or a Tracker call that runs the driver's actions). It arms
``SIGALRM``; when the call is still running after ``seconds``, the handler
notes which driver method was running (found on the interrupted stack: the
outermost frame whose ``self`` is the driver) and raises into it, again every
``seconds`` until the call unwinds, and the guard then raises
:class:`CallTimeout` naming that method. The alarm is raised as a
``BaseException``: a driver's ``except Exception`` does not swallow it, and
Hypothesis does not take it for a failing example to shrink and replay
(each replay would hang again).

A driver that swallows even that, or hangs in C code that never returns to
the interpreter, is caught by an optional watchdog thread: ``on_stuck`` is
called with the finding once the call has run for twice its time plus two
seconds. The CLI passes one that prints the finding and exits; a library
caller may pass none.

Signals reach the main thread only: elsewhere (or where ``setitimer`` does
not exist) the guard times nothing. ``kvfsm test`` runs in the main thread.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from types import FrameType
from typing import TYPE_CHECKING, Any

from ..errors import KvfsmError

if TYPE_CHECKING:
    from .oracle import Move

SHOWN = 40
"""Most characters of an argument shown in the name of a hung call."""


class FactoryError(KvfsmError):
    """A ``MODULE:FACTORY`` that does not name a callable, or a factory that fails."""


class DriverError(FactoryError):
    """A driver, or its factory, raised or hung at run time where the test needed it to work.

    The driver's fault, reported as a finding (``kvfsm test`` exits 1), unlike
    a driver that cannot be used at all (exit 2). The message names the call
    and the object: ``driver factory my_drivers:make() raised OSError: ... (its
    call 3, for example 2)``.
    """


class DriverFault(BaseException):
    """Inside a model-based run: the driver failed (its factory raised, a call hung), with the story so far.

    A BaseException so that Hypothesis stops at once instead of shrinking and
    replaying an example whose replay would fail or hang the same way; the
    runner turns it into a failing report.
    """

    def __init__(
        self,
        problem: str,
        story: Sequence[str] = (),
        trace: Sequence[tuple[str, tuple[object, ...]]] = (),
        moved: Sequence[tuple[Move, ...]] = (),
    ):
        super().__init__(problem)
        self.problem, self.story, self.trace, self.moved = problem, tuple(story), tuple(trace), tuple(moved)


def describe(factory: object) -> str:
    """``module:qualname`` of a factory, as ``--driver`` names it; its repr for anything without those."""
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    return f"{module}:{name}" if isinstance(module, str) and isinstance(name, str) else repr(factory)


class Factory:
    """A driver factory as the tests call it: every call counted and timed, a failure a :class:`DriverError`.

    ``role`` names the role the drivers are for (trace replay), in messages.
    """

    def __init__(self, factory: Callable[..., Any], timer: CallTimer | None = None, role: str | None = None) -> None:
        self.factory, self.timer, self.role = factory, timer, role
        self.name = describe(factory)
        self.calls = 0

    def make(self, purpose: str = "", *args: Any) -> Any:
        """One driver; ``purpose`` (``for example 3``) goes into the message if the call fails; ``args`` go to the
        factory (an owned machine's factory gets its parent's driver)."""
        self.calls += 1
        for_role = f" for role {self.role!r}" if self.role else ""
        which = f"its call {self.calls}" + (f", {purpose}" if purpose else "")
        guard = self.timer.call(f"driver factory {self.name}(){for_role} ({which})") if self.timer else nullcontext()
        try:
            with guard:
                return self.factory(*args)
        except CallTimeout as exc:
            raise DriverError(str(exc)) from None
        except Exception as exc:
            raise DriverError(
                f"driver factory {self.name}(){for_role} raised {type(exc).__name__}: {exc} ({which})"
            ) from None


class CallTimeout(BaseException):
    """A driver call that did not return within the call timeout (see the module docstring for why a BaseException)."""

    def __init__(self, call: str, seconds: float) -> None:
        self.call, self.seconds = call, seconds
        super().__init__(f"{call} did not return within {seconds:g} s (--call-timeout)")


class _Alarm(BaseException):
    """Raised into the hung call by the SIGALRM handler; the guard turns it into :class:`CallTimeout`."""


class CallTimer:
    """Guards driver calls with a time limit of ``seconds`` each (``None``: no limit)."""

    def __init__(self, seconds: float | None, *, on_stuck: Callable[[str], None] | None = None) -> None:
        self.seconds = seconds
        self.on_stuck = on_stuck
        self._since: float | None = None
        """When the guarded call now running began (``None``: none is)."""
        self._what = ""
        self._fired: list[str] = []
        self._watchdog: threading.Thread | None = None

    @property
    def active(self) -> bool:
        """Whether calls are timed here: a limit is set, and this is the main thread of a system with SIGALRM."""
        return (
            self.seconds is not None
            and hasattr(signal, "setitimer")
            and threading.current_thread() is threading.main_thread()
        )

    @contextmanager
    def call(self, what: str, owner: object = None) -> Iterator[None]:
        """Time the call made inside the block; raise :class:`CallTimeout` if it ran past the limit.

        ``what`` names the call when no method of ``owner`` (the driver) is on
        the stack when the time runs out. A guard inside a guard times nothing
        more: the outer one covers it.
        """
        if not self.active or self._since is not None:
            yield
            return
        seconds = self.seconds
        assert seconds is not None
        fired: list[str] = []
        done: list[bool] = []

        def on_alarm(_signum: int, frame: FrameType | None) -> None:
            if done:  # a signal pending as the guard disarms: the call is over
                return
            if not fired:
                fired.append(_culprit(frame, owner) or what)
            raise _Alarm

        previous = signal.signal(signal.SIGALRM, on_alarm)
        self._since, self._what, self._fired = time.monotonic(), what, fired
        self._start_watchdog()
        signal.setitimer(signal.ITIMER_REAL, seconds, seconds)  # repeats: a hung cleanup after the first is cut too
        try:
            yield
        except BaseException:
            if fired:
                raise CallTimeout(fired[0], seconds) from None
            raise
        finally:
            done.append(True)
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, previous)
            self._since = None
        if fired:  # the alarm was swallowed on the way (an action's failure the Tracker recorded): still a hang
            raise CallTimeout(fired[0], seconds)

    def _start_watchdog(self) -> None:
        if self.on_stuck is None or self._watchdog is not None:
            return
        self._watchdog = threading.Thread(target=self._watch, name="kvfsm-call-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Call ``on_stuck`` for a call that outlives its interrupts (twice its time plus two seconds)."""
        assert self.on_stuck is not None and self.seconds is not None
        grace = 2 * self.seconds + 2.0
        while True:
            time.sleep(0.2)
            since = self._since
            if since is not None and time.monotonic() - since > grace:
                call = self._fired[0] if self._fired else self._what
                self.on_stuck(
                    f"{call} did not return within {self.seconds:g} s (--call-timeout) and did not stop when "
                    f"interrupted (it swallowed the interrupt, or is stuck outside Python)"
                )
                return


def _culprit(frame: FrameType | None, owner: object) -> str | None:
    """``Class.method(args)`` of the outermost frame on the stack whose ``self`` is ``owner``; ``None`` if none is."""
    if owner is None:
        return None
    found: FrameType | None = None
    while frame is not None:
        if frame.f_locals.get("self") is owner:
            found = frame
        frame = frame.f_back
    if found is None:
        return None
    code, values = found.f_code, found.f_locals
    args = ", ".join(_short(repr(values.get(name))) for name in code.co_varnames[1 : code.co_argcount])
    return f"{type(owner).__name__}.{code.co_name}({args})"


def _short(text: str) -> str:
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}…"


__all__ = ["CallTimeout", "CallTimer", "DriverError", "DriverFault", "Factory", "FactoryError", "describe"]
