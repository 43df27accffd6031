"""The oracle's former module name, kept only while :mod:`kvfsm.testing.trace_replay` imports it from here.

Import :class:`~kvfsm.testing.oracle.SpecModel` from :mod:`kvfsm.testing.oracle`.
"""

from __future__ import annotations

from .oracle import SpecModel

__all__ = ["SpecModel"]
