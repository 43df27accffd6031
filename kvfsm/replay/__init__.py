"""Runtime conformance: a Tracker's transitions as a JSON-lines journal, checked offline against the spec.

:class:`JsonlJournal` is a Tracker observer that writes the journal;
:func:`check_log` (``kvfsm replay``) replays it on the spec model and reports
where the deployment left the declared lifecycle.
"""

from .check import DEFAULT_TOLERANCE, Divergence, DivergenceKind, LogChecker, Replay, check_log
from .journal import JsonlJournal
from .record import Header, Record

__all__ = [
    "DEFAULT_TOLERANCE",
    "Divergence",
    "DivergenceKind",
    "Header",
    "JsonlJournal",
    "LogChecker",
    "Record",
    "Replay",
    "check_log",
]
