"""The KVF3xx codes of a log check: one stable code per way a journal leaves its spec or cannot be read.

A log check reports :class:`~kvfsm.spec.Finding` records, the shape ``kvfsm
check`` reports for specs (KVF0xx–KVF2xx); these codes are theirs. The codes
are listed in the order a line is judged: a line gets the first that applies.
"""

from __future__ import annotations

from collections.abc import Mapping

UNREADABLE = "KVF300"
"""Reading stopped partway: corrupt compressed data, or an I/O error."""
MALFORMED = "KVF301"
"""Not a journal line: not UTF-8, not JSON, nested too deeply, a field missing or of the wrong type."""
TRUNCATED = "KVF302"
"""The last line is cut short, or a compressed stream ends before its end marker."""
WRONG_MACHINE = "KVF303"
"""A session header names another machine than the spec's."""
UNKNOWN_INSTANCE = "KVF304"
"""An event for a key with no ``begin`` before it in this session."""
DUPLICATE_BEGIN = "KVF305"
"""A ``begin`` for a key whose instance is still live."""
GENERATION = "KVF306"
"""A line's generation differs from its instance's, or a ``begin``'s is not above the previous one."""
WRONG_SOURCE = "KVF307"
"""``from`` is not the state the instance was in."""
ILLEGAL = "KVF308"
"""The event is no transition from ``from`` (an ignored event included: the Tracker never logs no-ops)."""
WRONG_TARGET = "KVF309"
"""``to`` is not the target of the spec's transition (or not the initial state, on ``begin``)."""
OVERRUN = "KVF310"
"""A state with a timeout, or a phase (timed from entering it), was held past its deadline plus the tolerance."""
TIME_BACKWARDS = "KVF311"
"""Time decreases, although a tracker's clock is monotonic."""
UNRELEASED = "KVF312"
"""An instance ends the log (or its session) in a state that holds resources."""
OVER_LIMIT = "KVF313"
"""An outcome or anomaly is more frequent than a ``--max`` limit allows (an expiry storm, say)."""

NAMES: Mapping[str, str] = {
    UNREADABLE: "unreadable",
    MALFORMED: "malformed",
    TRUNCATED: "truncated",
    WRONG_MACHINE: "wrong-machine",
    UNKNOWN_INSTANCE: "unknown-instance",
    DUPLICATE_BEGIN: "duplicate-begin",
    GENERATION: "generation",
    WRONG_SOURCE: "wrong-source",
    ILLEGAL: "illegal",
    WRONG_TARGET: "wrong-target",
    OVERRUN: "overrun",
    TIME_BACKWARDS: "time-backwards",
    UNRELEASED: "unreleased",
    OVER_LIMIT: "over-limit",
}
"""Each code's short name, for summaries (``2 KVF310 overrun``)."""
