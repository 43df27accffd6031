"""The sizes a composition may have to be explored, checked before anything proportional to them is built.

A global state holds one entry per request and a local state one slot per
role instance; the Promela export writes a queue slot per unit of channel
capacity and enumerates each counted message's sender sets. A size from a
command line or a system file (``requests: 1000000000``, ``ranks:
100000000``) is refused here, with its bound, instead of being allocated.
"""

from __future__ import annotations

from ..errors import KvfsmError
from ..spec.system import System

MAX_REQUESTS = 32
"""Most requests explored at once. A global state holds one entry per request, so the start state alone
grows with N, and far below this the state space is past any bound (six requests of the PD abort system
are 2.8 million symmetric states without merging)."""

MAX_RANKS = 16
"""Most ranks (instances) of one role: the Promela export enumerates each counted message's sender sets."""

MAX_INSTANCES = 64
"""Most role instances in one request, all roles' ranks together: each is a slot of every local state."""

MAX_CAPACITY = 1024
"""Largest channel capacity explored or exported (the export writes a queue slot per unit of capacity)."""


class ExploreError(KvfsmError, ValueError):
    """A composition, or a request count, too big to explore: said before anything is built."""


def check_sizes(system: System, requests: int | None = None) -> int:
    """The number of requests to explore (``requests`` or the system's), once every size is within its bound.

    Raises :class:`ExploreError` naming the size and its bound; nothing
    proportional to a size is built before this passes.
    """
    n = requests if requests is not None else system.requests
    if n < 1:
        raise ExploreError(f"requests must be at least 1, not {n}")
    if n > MAX_REQUESTS:
        where = "" if requests is not None else f" (its 'requests: {n:,}')"
        raise ExploreError(
            f"{system.name}{where} asks for {n:,} requests; at most {MAX_REQUESTS} are explored at once: "
            f"pass -n N with N at most {MAX_REQUESTS}"
        )
    for name, role in system.roles.items():
        if role.ranks > MAX_RANKS:
            raise ExploreError(
                f"{system.name}: role {name!r} has {role.ranks:,} ranks; at most {MAX_RANKS} ranks of a role "
                "are explored"
            )
    instances = sum(role.ranks for role in system.roles.values())
    if instances > MAX_INSTANCES:
        raise ExploreError(
            f"{system.name}: one request has {instances:,} role instances (ranks of every role together); at most "
            f"{MAX_INSTANCES} are explored"
        )
    if system.channel.capacity > MAX_CAPACITY:
        raise ExploreError(
            f"{system.name}: a channel of capacity {system.channel.capacity:,}; at most {MAX_CAPACITY} is explored"
        )
    return n


__all__ = ["MAX_CAPACITY", "MAX_INSTANCES", "MAX_RANKS", "MAX_REQUESTS", "ExploreError", "check_sizes"]
