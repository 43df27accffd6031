"""kvfsm: the KV-cache lifecycle of every LLM-serving request as a declared, checked state machine.

Write a spec (states, the resources each holds, the transitions); kvfsm proves
properties of it (:func:`check`), runs it (:class:`Tracker`) with releases
derived from the spec, and draws and tests it.
"""

import logging as _logging

from .engine import Tracker, batch
from .errors import (
    ActionError,
    Anomaly,
    BindingError,
    DuplicateKey,
    Failure,
    IllegalTransition,
    KvfsmError,
    PayloadError,
    ReentrantCall,
    TrackerClosed,
    UnknownParent,
)
from .spec import Finding, Spec, SpecError, check, load, parse

__version__ = "0.1.0"

_logging.getLogger("kvfsm").addHandler(_logging.NullHandler())  # a library logs; the application decides where to

__all__ = [
    "ActionError",
    "Anomaly",
    "BindingError",
    "DuplicateKey",
    "Failure",
    "Finding",
    "IllegalTransition",
    "KvfsmError",
    "PayloadError",
    "ReentrantCall",
    "Spec",
    "SpecError",
    "Tracker",
    "TrackerClosed",
    "UnknownParent",
    "batch",
    "check",
    "load",
    "parse",
]
