"""The compiled runtime: flat tables, instances, deadlines (knows nothing of YAML)."""

from .program import Program, compile_program
from .tracker import Observer, Tracker

__all__ = ["Observer", "Program", "Tracker", "compile_program"]
