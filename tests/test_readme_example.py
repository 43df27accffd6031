"""The README's first Python example runs as written, with a driver that records every call it names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """A driver with every method a spec may name: each call is recorded, none raises."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **_kw: self.calls.append((name, args))


def test_the_first_python_example_runs_and_does_what_its_comments_say(monkeypatch: pytest.MonkeyPatch) -> None:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it\n\n```python\n(.*?)```", text, re.S)
    assert block is not None, "README.md lost its 'Using it' example"
    driver = Recorder()
    scope: dict[str, Any] = {"driver": driver}
    monkeypatch.chdir(ROOT)  # the example names specs/ relative to the clone
    exec(compile(block.group(1), "README.md", "exec"), scope)
    tracker = scope["tracker"]
    assert [name for name, _ in driver.calls] == ["enqueue_job", "start_transfer", "free_gpu_blocks", "task_done"]
    assert tracker.state("req-1") is None and tracker.live() == 0  # done, and drained by finished()
