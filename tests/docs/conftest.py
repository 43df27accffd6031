"""The docs test's report: which blocks took the time (it must stay a few minutes on two cores)."""

from __future__ import annotations

import sys

import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    times: dict[str, float] = getattr(sys.modules.get("test_docs"), "TIMES", {})  # pytest imports it by its basename
    if times:
        slowest = sorted(times.items(), key=lambda item: -item[1])[:8]
        terminalreporter.write_line("slowest doc blocks: " + ", ".join(f"{name} {s:.0f} s" for name, s in slowest))
