"""Artifacts generated from the spec model: diagrams (and, later, tests and Promela)."""
