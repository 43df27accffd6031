"""The Tracker's lock: re-entrant, and taking it uncontended costs a deque pop.

``threading.RLock().acquire()`` parses its arguments on every call: an
acquire and release cost 65–75 ns on CPython 3.11, a quarter of what a
hand-written tracker spends on a whole ``fire``, and the Tracker takes its
lock once per call. This lock is a single token in a deque:

- a thread that sees the token takes the lock by popping it (atomic) and
  records itself as ``owner``; it gives the lock back by clearing ``owner``
  and appending the token;
- a thread that finds the token out and itself recorded as ``owner`` holds
  the lock already (a driver action or a collector finalizer calling back):
  it goes on at once, and its inner exit does not give the token back;
- any other thread that finds the token out waits on a ticket of its own,
  queued oldest first, and a release hands the token straight to the oldest
  ticket: as with ``RLock``, the releasing thread cannot take the lock back
  before a waiter runs, so a busy thread cannot starve the others.

Taking and giving back are written as :meth:`Mutex.enter` and
:meth:`Mutex.exit` (which are ``__enter__`` and ``__exit__``). ``Tracker.fire``
and ``Tracker.begin``, the calls made per request, inline the two fast paths
(the pop and the owner; clearing, the append and the look at ``waiters``):
the two method calls cost 3% of ``kvfsm bench``'s locked lifecycle row. The
inlined form pops first and looks at the owner only when the token is out,
which saves a look per call and costs a raised ``IndexError`` on a re-entry:
there a re-entry is an action calling back, which is rare. ``enter`` looks
first, since nested ``with`` blocks re-enter all the time. What follows a
token found out (a re-entry, or the wait) is :meth:`Mutex.take_late`, once.
``tests/test_mutex.py`` holds the two inlined copies to each other and to
the behaviour of ``enter`` and ``exit``; every other method holds the lock
with ``with``.

No wakeup is lost: a waiter queues its ticket under ``_guard`` only after it
found the token out, and a releaser appends the token before it reads
``waiters``; so either the waiter finds the token, or the releaser finds the
waiter and hands the token over under ``_guard``. Each wait is bounded all the
same (``RECHECK``), so that a memory model weaker than the GIL's could delay
a waiter, never strand it.

Like every lock taken by Python code, an asynchronous exception (a
``KeyboardInterrupt``) that lands between taking the token and recording the
owner leaves the lock taken; a signal handler must not call the tracker.
"""

from __future__ import annotations

import threading
from collections import deque
from threading import get_ident
from typing import Any

RECHECK = 0.5
"""Seconds a waiter blocks before it looks at the token again without being handed it."""


class Mutex:
    """A re-entrant lock held with ``with``, or taken with :meth:`enter` and given back with :meth:`exit`."""

    __slots__ = ("tokens", "owner", "waiters", "_depth", "_guard", "_queue")

    def __init__(self) -> None:
        self.tokens: deque[None] = deque((None,))
        """Holds the one token while the lock is free."""
        self.owner = 0
        """``get_ident()`` of the thread holding the lock; 0 while it is free."""
        self.waiters = 0
        """Tickets queued: a release that sees some hands the token over."""
        self._depth = 0
        """Entries (``with``, :meth:`enter`) the owner made while it already held the lock (only it touches this)."""
        self._guard = threading.Lock()
        """Guards the queue of tickets; held for a few steps at a time, never while blocking."""
        self._queue: deque[Any] = deque()
        """A locked ticket per waiting thread, oldest first; a handover unlocks one."""

    def wait(self) -> None:
        """Block until the token is ours: found in the deque, or handed over by a release."""
        ticket = threading.Lock()  # made before _guard is held: allocating may run the collector
        ticket.acquire()
        with self._guard:
            if self._take():
                return
            self._queue.append(ticket)
            self.waiters += 1
        try:
            while not ticket.acquire(timeout=RECHECK):
                with self._guard:
                    if ticket in self._queue and self._take():  # back in the deque, never handed over
                        self._queue.remove(ticket)
                        self.waiters -= 1
                        return
        except BaseException:
            with self._guard:
                if ticket in self._queue:
                    self._queue.remove(ticket)
                    self.waiters -= 1
                    raise
            self.exit()  # handed over meanwhile: the token is ours to pass on
            raise

    def _take(self) -> bool:
        """Pop the token if it is there. Runs under ``_guard``, where nothing may allocate (a collector
        finalizer calling back would wait for ``_guard`` forever): so a look first, not a raised IndexError."""
        if not self.tokens:
            return False
        try:
            self.tokens.pop()
        except IndexError:  # a thread that does not wait won the race for it (possible only without a GIL)
            return False
        return True

    def hand_over(self) -> None:
        """Give the token, just put back, to the oldest waiter: the releasing thread cannot take it again first."""
        with self._guard:
            if self._queue and self._take():
                self.waiters -= 1
                self._queue.popleft().release()

    def locked(self) -> bool:
        """Whether some thread holds the lock (a snapshot, for tests and diagnostics)."""
        return not self.tokens

    def enter(self) -> None:
        """Take the lock, or count one more entry if this thread holds it already (``with`` calls this).

        ``Tracker.fire`` and ``Tracker.begin`` inline this and :meth:`exit` (see the module docstring)."""
        if self.tokens:  # a look first: nested ``with`` blocks re-enter often, and a raised IndexError is dear
            try:
                self.tokens.pop()
                self.owner = get_ident()
                return
            except IndexError:  # taken by another thread since the look
                pass
        if not self.take_late():
            self._depth += 1

    def take_late(self) -> bool:
        """Take the lock after finding the token out: False, at once, if this thread holds it already (a
        re-entry); otherwise wait for it and return True. The slow path of :meth:`enter` and of the copies of its
        fast path that ``Tracker.fire`` and ``Tracker.begin`` inline."""
        me = get_ident()
        if self.owner == me:
            return False
        self.wait()
        self.owner = me
        return True

    def exit(self, *_exception: object) -> None:
        """Undo one :meth:`enter`: the outermost gives the lock back, to the oldest waiter if one is queued."""
        if self._depth:
            self._depth -= 1
            return
        self.owner = 0
        self.tokens.append(None)
        if self.waiters:
            self.hand_over()

    __enter__ = enter
    __exit__ = exit
