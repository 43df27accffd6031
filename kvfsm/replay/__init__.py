"""Runtime conformance: a Tracker's transitions as a JSON-lines journal, checked offline against the spec.

:class:`JsonlJournal` is a Tracker observer that writes the journal;
:func:`check_log` (``kvfsm replay``) checks it on the spec model and reports
where the deployment left the declared lifecycle, as KVF3xx findings
(:mod:`kvfsm.replay.codes`).
"""

from . import codes
from .check import DEFAULT_TOLERANCE, Limit, LogChecker, LogReport, check_log
from .journal import JsonlJournal
from .record import AnomalyLine, Header, Record

__all__ = [
    "DEFAULT_TOLERANCE",
    "AnomalyLine",
    "Header",
    "JsonlJournal",
    "Limit",
    "LogChecker",
    "LogReport",
    "Record",
    "check_log",
    "codes",
]
