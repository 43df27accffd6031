"""The compiled runtime: flat tables, instances, deadlines (knows nothing of YAML)."""

from .program import BatchResultError, Program, batch, compile_program
from .tracker import Observer, Tracker

__all__ = ["BatchResultError", "Observer", "Program", "Tracker", "batch", "compile_program"]
