"""`kvfsm test` reports what a driver does wrong at run time as a finding about the driver, never an internal error.

A factory that raises (on its first call or a later one), or any driver call
that does not return within ``--call-timeout`` (the factory, ``observe``, an
action, a release), is a driver error: the run ends with exit 1 and a message
naming the call and the object, instead of an internal error or a hang. Each
case runs the real command in a child, from a folder holding its drivers, with
a wall-clock timeout far above ``--call-timeout`` so a regression fails
instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
SPEC = ROOT / "specs" / "kv_request.yaml"
SYSTEM = ROOT / "specs" / "pd_abort" / "corrected.yaml"

DRIVERS = '''
"""Drivers that fail the ways real ones do: a factory that runs out of something, calls that never return."""
import time
from buggy_drivers import StoreSender
from kvfsm.drivers.pd_loopback import DecodeDriver, PDLoopback

calls = 0


def third_raises():
    global calls
    calls += 1
    if calls == 3:
        raise RuntimeError("no GPU left")
    return StoreSender()


def always_raises():
    raise RuntimeError("cannot reach the block pool")


def third_hangs():
    global calls
    calls += 1
    if calls == 3:
        time.sleep(3600)
    return StoreSender()


class HangingObserve(StoreSender):
    def observe(self, key):
        if self.stores_in_flight or self.store:
            time.sleep(3600)  # once a transfer stored something
        return super().observe(key)


class HangingRelease(StoreSender):
    def task_done(self, key):
        time.sleep(3600)


class SwallowingRelease(StoreSender):
    """Catches everything, KeyboardInterrupt and alarms included, and sleeps again: only a hard stop ends it."""

    def task_done(self, key):
        while True:
            try:
                time.sleep(3600)
            except BaseException:
                pass


class HangingDecode(DecodeDriver):
    def release_kv_cache(self, room):
        time.sleep(3600)


def hanging_decode():
    return HangingDecode(PDLoopback())


def decode_second_raises():
    global calls
    calls += 1
    if calls == 2:
        raise RuntimeError("decode pool gone")
    return DecodeDriver(PDLoopback())
'''


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "drivers.py").write_text(DRIVERS)
    return tmp_path


def run(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvfsm test ARGS`` in a child, from ``folder`` (buggy_drivers importable too)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(TESTS)])}  # this checkout's kvfsm
    return subprocess.run(
        [sys.executable, "-m", "kvfsm.cli", "test", *args],
        capture_output=True,
        text=True,
        cwd=folder,
        env=env,
        timeout=180,
    )


def kvfsm_test(folder: Path, *args: str) -> tuple[int, str, float]:
    """``kvfsm test ARGS`` from ``folder``: (exit status, stdout and stderr with whitespace folded, seconds)."""
    started = time.monotonic()
    result = run(folder, *args)
    text = " ".join((result.stdout + result.stderr).split())
    return result.returncode, text, time.monotonic() - started


def _clean(text: str) -> None:
    assert "internal error" not in text and "Traceback" not in text, text


def test_a_factory_that_raises_on_a_later_call_is_a_driver_error(folder: Path) -> None:
    code, text, _s = kvfsm_test(folder, str(SPEC), "--driver", "drivers:third_raises", "--seed", "0")
    assert code == 1, text
    assert "the driver failed: driver factory drivers:third_raises() raised RuntimeError: no GPU left" in text
    assert "(its call 3" in text and "repeat with: kvfsm test" in text
    _clean(text)


def test_a_factory_that_raises_at_once_is_a_driver_error_too(folder: Path) -> None:
    code, text, _s = kvfsm_test(folder, str(SPEC), "--driver", "drivers:always_raises")
    assert code == 1, text
    assert "driver factory drivers:always_raises() raised RuntimeError: cannot reach the block pool" in text
    assert "(its call 1" in text
    _clean(text)


def test_json_carries_the_driver_error(folder: Path) -> None:
    result = run(folder, str(SPEC), "--driver", "drivers:third_raises", "--seed", "0", "--format", "json")
    assert result.returncode == 1, result.stdout + result.stderr
    doc = json.loads(result.stdout)
    assert doc["passed"] is False
    assert doc["failure"]["driver_error"].startswith("driver factory drivers:third_raises() raised RuntimeError")


@pytest.mark.parametrize(
    ("driver", "says"),
    [
        ("drivers:third_hangs", "driver factory drivers:third_hangs() (its call 3, for example "),
        ("drivers:HangingObserve", "HangingObserve.observe('req-"),
        ("drivers:HangingRelease", "HangingRelease.task_done('req-"),
    ],
)
def test_a_call_that_hangs_is_a_driver_error_after_the_call_timeout(folder: Path, driver: str, says: str) -> None:
    code, text, seconds = kvfsm_test(folder, str(SPEC), "--driver", driver, "--seed", "0", "--call-timeout", "2")
    assert code == 1, text
    assert says in text and "did not return within 2 s (--call-timeout)" in text
    assert seconds < 120
    _clean(text)


def test_a_driver_that_swallows_the_timeout_is_stopped_hard(folder: Path) -> None:
    code, text, seconds = kvfsm_test(
        folder, str(SPEC), "--driver", "drivers:SwallowingRelease", "--seed", "0", "--call-timeout", "2"
    )
    assert code == 1, text
    assert "SwallowingRelease.task_done('req-" in text and "did not return" in text and "stopped" in text
    assert seconds < 120


def test_the_call_timeout_must_be_a_positive_number_or_none(folder: Path) -> None:
    code, text, _s = kvfsm_test(folder, str(SPEC), "--driver", "drivers:third_raises", "--call-timeout", "-1")
    assert code == 2 and "--call-timeout: '-1' is not a number of seconds above 0, nor 'none'" in text


def test_a_hanging_release_in_a_trace_set_is_a_driver_error_and_the_set_stops(folder: Path) -> None:
    code, text, seconds = kvfsm_test(
        folder, str(SYSTEM), "--driver", "decode=drivers:hanging_decode", "--call-timeout", "2"
    )
    assert code == 1, text
    assert "HangingDecode.release_kv_cache('r0') did not return within 2 s (--call-timeout)" in text
    assert "not replayed" in text
    assert seconds < 120
    _clean(text)


def test_a_role_factory_that_raises_on_a_later_trace_is_a_driver_error(folder: Path) -> None:
    code, text, _s = kvfsm_test(folder, str(SYSTEM), "--driver", "decode=drivers:decode_second_raises")
    assert code == 1, text
    assert (
        "driver factory drivers:decode_second_raises() for role 'decode' raised RuntimeError: decode pool gone" in text
    )
    assert "(its call 2" in text
    _clean(text)
