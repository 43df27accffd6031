"""Headless Chromium for the inspect page: Debian's ``chromium`` driven by Playwright (never its own browsers); and
a real Tracker's journal whose poll loop stalled, which the journal view is tested on.

Tests marked ``browser`` run with ``--run-browser`` (``./dev.sh test`` runs
them as a step of their own). Without Chromium or Playwright they skip,
except under ``./dev.sh test`` (``KVFSM_REQUIRE_BROWSER=1``), where a
missing browser is an error: CI must run them.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvfsm
from kvfsm.replay import JsonlJournal

KV_REQUEST = Path(__file__).resolve().parents[2] / "specs/kv_request.yaml"
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def require_browser() -> None:
    missing = []
    if not (os.access(CHROMIUM, os.X_OK) or shutil.which("chromium")):
        missing.append("chromium (apt-get install --no-install-recommends chromium; ./dev.sh does)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("playwright (pip install 'kvfsm[dev]')")
    if missing:
        why = "the inspect browser tests need " + " and ".join(missing)
        if os.environ.get("KVFSM_REQUIRE_BROWSER"):
            pytest.fail(f"{why}, and KVFSM_REQUIRE_BROWSER is set: ./dev.sh setup installs both")
        pytest.skip(why)


@pytest.fixture(scope="session")
def browser_context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Chromium for the session, with a fresh profile; each test opens its own page."""
    require_browser()
    from playwright.sync_api import sync_playwright

    profile = tmp_path_factory.mktemp("chromium-profile")
    executable = CHROMIUM if os.access(CHROMIUM, os.X_OK) else str(shutil.which("chromium"))
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile), executable_path=executable, args=ARGS, headless=True, viewport={"width": 1200, "height": 760}
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture
def page(browser_context: Any) -> Iterator[Any]:
    """A new tab; a script error on the page fails the test."""
    tab = browser_context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        yield tab
    finally:
        tab.close()
    assert not errors, f"the page's script failed: {errors}"


DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.fixture
def screenshot(tmp_path: Path) -> Callable[[Any, str], Path]:
    """Keep a view as the test saw it: into docs/ (``docs/inspect_<name>.png``, what docs/inspect.md shows) when
    ``KVFSM_INSPECT_SCREENSHOTS=1``, else into the test's scratch folder, so a test run leaves docs/ as it was."""
    folder = DOCS if os.environ.get("KVFSM_INSPECT_SCREENSHOTS") else tmp_path

    def take(tab: Any, name: str) -> Path:
        path = folder / f"inspect_{name}.png"
        tab.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": 1200, "height": 540})  # docs/: < 150 KB each
        return path

    return take


class Quiet:
    """kv_request's actions, doing nothing: the journal records what the Tracker did."""

    def __getattr__(self, action: str) -> object:
        return lambda key: None


@pytest.fixture
def quiet() -> Quiet:
    return Quiet()


@pytest.fixture
def stalled(tmp_path: Path) -> Path:
    """A real Tracker's journal: req-2's transfer completes 45 s after it started, with a 30 s deadline, because
    nothing polled; req-3 is still queued when the log ends."""
    now = [100.0]
    log = tmp_path / "kv.jsonl"
    journal = JsonlJournal(log, append=False)
    spec = kvfsm.load(KV_REQUEST)
    tracker = kvfsm.Tracker(spec, Quiet(), params={"transfer_timeout": 30.0}, observer=journal, clock=lambda: now[0])
    journal.attach(tracker)
    for key in ("req-1", "req-2"):
        tracker.begin(key)
        tracker.fire(key, "enqueue")
        tracker.fire(key, "start")
    now[0] = 100.4
    tracker.fire("req-1", "complete")
    now[0] = 145.0
    tracker.fire("req-2", "complete")
    tracker.begin("req-3")
    tracker.fire("req-3", "enqueue")
    journal.close()
    return log
