"""Where the specs kvfsm ships live: ``kvfsm/specs/``, package data of every install.

Drivers, the demo and the benchmarks name their specs from here, so the
folder is found in one place; ``specs/`` at the top of a checkout is a link
to it, so the paths the docs use work from a clone.
"""

from __future__ import annotations

from pathlib import Path

SPECS = Path(__file__).resolve().parents[1] / "specs"
"""The bundled machine specs; ``SPECS / "pd_abort"`` holds seed 002's compositions."""

PD_ABORT = SPECS / "pd_abort"
"""Seed 002's compositions: the fix SGLang merged (``merged_fix.yaml``) and the corrected protocol."""
