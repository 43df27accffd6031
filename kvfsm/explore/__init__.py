"""Exhaustive exploration of compositions: every interleaving of N requests over a lossy channel.

``explore(path)`` checks a system file's properties (deadlock, leak at
quiescence, late and unexpected messages, overflow, and every ``never``) and
returns an :class:`ExploreResult` with the shortest counterexample of each
violated property as a :class:`Trace`; :func:`check_trace` tells whether a
trace can happen in a system; :func:`shortest_runs` gives every move one
request can make with a shortest run to it (what a trace set is chosen from).
"""

from __future__ import annotations

from .limits import MAX_REQUESTS, ExploreError, check_sizes
from .local import LocalLimit
from .run import ExploreResult, PropertyResult, explore, shortest_runs
from .search import Progress, ProgressFn
from .trace import (
    Sent,
    Step,
    Trace,
    TraceError,
    TraceRole,
    TraceSource,
    as_trace,
    check_trace,
    describe_step,
    format_trace,
    read_trace,
)

__all__ = [
    "MAX_REQUESTS",
    "ExploreError",
    "ExploreResult",
    "LocalLimit",
    "Progress",
    "ProgressFn",
    "PropertyResult",
    "Sent",
    "Step",
    "Trace",
    "TraceError",
    "TraceRole",
    "TraceSource",
    "as_trace",
    "check_sizes",
    "check_trace",
    "describe_step",
    "explore",
    "format_trace",
    "read_trace",
    "shortest_runs",
]
