"""The compiled runtime: flat tables, instances, deadlines (knows nothing of YAML)."""

from .program import Program, compile_program
from .tracker import Instance, Observer, Tracker

__all__ = ["Instance", "Observer", "Program", "Tracker", "compile_program"]
