"""Where the specs kvfsm ships live: ``specs/`` of the source tree, beside the package.

Drivers, the demo and the benchmarks name their specs from here, so the
folder is found in one place. It is not package data: a wheel built from the
tree carries none of it, and ``kvfsm.load`` then says which file is missing.
"""

from __future__ import annotations

from pathlib import Path

SPECS = Path(__file__).resolve().parents[2] / "specs"
"""The bundled machine specs; ``SPECS / "pd_abort"`` holds seed 002's compositions."""

PD_ABORT = SPECS / "pd_abort"
"""Seed 002's compositions: the fix SGLang merged (``merged_fix.yaml``) and the corrected protocol."""
