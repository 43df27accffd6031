"""The Tracker's lock: re-entrant, and taking it uncontended costs a deque pop.

``threading.RLock().acquire()`` parses its arguments on every call: an
acquire and release cost 65–75 ns on CPython 3.11, a quarter of what a
hand-written tracker spends on a whole ``fire``, and the Tracker takes its
lock once per call. This lock is a single token in a deque:

- a thread takes the lock by popping the token (atomic) and gives it back by
  appending it; while the token is out, others wait on a condition;
- the holder records itself as ``owner`` (:meth:`claim`) before it runs
  anything that could call back into the tracker (a driver action, the
  observer, ``on_anomaly``, a log handler);
  taking the token alone does not, which keeps ``begin``'s plain path free of
  a ``get_ident()`` call;
- a thread that finds the token out and itself recorded as ``owner`` holds
  the lock already (an action calling back): it goes on at once, and its
  inner exit does not give the token back.

``Tracker.begin`` and ``Tracker.fire`` inline taking and giving back (a
method call costs what the lock saves); every other method holds the lock
with ``with``, which records the owner at once.

No wakeup is lost: a waiter counts itself in ``waiters``, under the
condition's lock, before it tries for the token, and a releaser puts the
token back before it reads ``waiters``; so either the waiter finds the token
or the releaser finds the waiter and notifies it under that same lock. Each
wait is bounded all the same (``RECHECK``), so that a memory model weaker than
the GIL's could delay a waiter but never strand it.
"""

from __future__ import annotations

import threading
from collections import deque
from threading import get_ident

RECHECK = 0.05
"""Seconds a contended waiter sleeps before it looks at the token again without being woken."""


class Mutex:
    """A re-entrant lock held with ``with`` (``Tracker.begin`` and ``fire`` inline the same steps)."""

    __slots__ = ("tokens", "owner", "waiters", "_depth", "_cond")

    def __init__(self) -> None:
        self.tokens: deque[None] = deque((None,))
        """Holds the one token while the lock is free."""
        self.owner = 0
        """``get_ident()`` of the holder once it has recorded itself; 0 before that and while the lock is free."""
        self.waiters = 0
        """Threads blocked in :meth:`wait`: a release that sees some wakes one."""
        self._depth = 0
        """``with`` blocks the owner opened while it already held the lock (only the owner touches it)."""
        self._cond = threading.Condition(threading.Lock())

    def claim(self) -> None:
        """Record the calling thread, which holds the token, as owner: before it runs code that may call back."""
        self.owner = get_ident()

    def wait(self) -> None:
        """Block until the token is back, and take it."""
        with self._cond:
            self.waiters += 1
            try:
                while True:
                    try:
                        self.tokens.pop()
                    except IndexError:
                        self._cond.wait(RECHECK)
                    else:
                        return
            finally:
                self.waiters -= 1

    def wake(self) -> None:
        """Wake one waiter (the token is back)."""
        with self._cond:
            self._cond.notify()

    def locked(self) -> bool:
        """Whether some thread holds the lock (a snapshot, for tests and diagnostics)."""
        return not self.tokens

    def __enter__(self) -> None:
        me = get_ident()
        if self.owner == me:
            self._depth += 1
            return
        try:
            self.tokens.pop()
        except IndexError:
            self.wait()
        self.owner = me

    def __exit__(self, kind: object, value: object, traceback: object) -> None:
        if self._depth:
            self._depth -= 1
            return
        self.owner = 0
        self.tokens.append(None)
        if self.waiters:
            self.wake()
