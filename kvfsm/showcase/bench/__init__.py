"""Reproducible performance comparison of the Tracker against a hand-written tracker and general FSM libraries.

``run()`` measures everything in one process and returns a :class:`BenchReport`
(rows of figures with ratios to their baselines, and the issue's targets judged
on them); ``format_table`` renders it as plain text. ``python -m kvfsm.showcase.bench``
and ``benchmarks/engine.py`` print that table. See benchmarks/README.md.
"""

from .report import BenchReport, Row, Target, format_table
from .suite import Progress, run

__all__ = ["BenchReport", "Progress", "Row", "Target", "format_table", "run"]
