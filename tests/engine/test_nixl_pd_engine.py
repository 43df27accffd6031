"""kvfsm's NixlConnector between two real vLLM engines in two OS processes (``kvfsm.showcase.engine.pd``): the decode
engine generates the tokens one engine generates alone, every load a NIXL READ into vLLM's own cache; an abort
mid-READ (which keeps its blocks until the READ lands) and a killed prefill end every decode request in time and
leave no block held.

One run of the runner serves all three tests (starting the two engines is most of the cost): the ``serve`` phase,
then ``abort``, then ``kill`` (the prefill dies in it, so it comes last).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfsm.showcase.engine.pd import ENGINE_ENV

ABORT_TIMEOUT, READ_TIMEOUT, HANDSHAKE_TIMEOUT = 15.0, 10.0, 5.0
DEADLINE = HANDSHAKE_TIMEOUT + READ_TIMEOUT
"""The longest a decode request may wait on the connector."""
SLACK = 5.0
"""A deadline fires at the next engine step; two engines and the runner share two cores."""


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    """The runner's JSON. It runs in a session of its own, so its engine processes (a stopped one included) die
    with it whatever happens."""
    out = tmp_path_factory.mktemp("pd") / "run.json"
    cmd = [
        sys.executable, "-m", "kvfsm.showcase.engine.pd", str(tiny_model), "--connector", "nixl",
        "--phases", "serve,abort,kill", "--abort-timeout", str(ABORT_TIMEOUT), "--read-timeout", str(READ_TIMEOUT),
        "--handshake-timeout", str(HANDSHAKE_TIMEOUT), "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        env={**os.environ, **ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the runner's group: it and its engines, stopped or not
        proc.wait(timeout=10)
    if not out.exists():  # a failed phase still writes the run; no run at all is the runner's own failure
        raise AssertionError(f"the P/D runner failed ({proc.returncode}) before writing its run:\n{err[-6000:]}")
    run: dict[str, Any] = json.loads(out.read_text())
    return run


def phase(run: dict[str, Any], name: str) -> dict[str, Any]:
    """The phase ``name`` of the run; one that did not finish fails the test with the runner's reason."""
    found = [p for p in run["phases"] if p["name"] == name]
    assert found, (
        f"phase {name} did not run: an earlier one failed ({[(p['name'], p['error']) for p in run['phases']]})"
    )
    assert found[0]["error"] is None, f"phase {name} did not finish: {found[0]['error']}"
    return found[0]


def whole(engine: dict[str, Any]) -> bool:
    """vLLM's pool has every block but the null one free, and the connector holds none and tracks nothing."""
    worker = engine["connector"]["worker"]
    held = sum(worker[side]["held_blocks"] for side in ("prefill", "decode") if side in worker)
    return engine["free_blocks"] == engine["gpu_blocks"] - 1 and engine["connector"]["live"] == 0 and held == 0


def test_the_decode_engine_generates_a_single_engines_tokens_from_kv_it_read_with_nixl(
    pd_run: dict[str, Any], run_offline: Callable[..., dict[str, Any]]
) -> None:
    want = run_offline("none")["passes"][0]
    serve = phase(pd_run, "serve")
    got = {r["prompt"]: r["tokens"] for r in serve["requests"]}
    assert len(want) >= 24 and sorted(got) == list(range(len(want)))
    diff = [i for i, tokens in enumerate(want) if got[i] != tokens]
    assert not diff, f"prompts {diff} generated other tokens than one engine without a connector"
    assert {r["finish_reason"] for r in serve["requests"]} == {"length"}
    decode = serve["engines"]["decode"]["connector"]["worker"]["decode"]
    prefill = serve["engines"]["prefill"]["connector"]
    # Every load was a NIXL READ into vLLM's blocks, one descriptor per (layer, block) of the 2-layer model.
    assert decode["outcomes"] == {"loaded": len(want)} and decode["transfers"]["reads"] == len(want)
    assert (
        decode["transfers"]["blocks_read"] >= len(want)
        and decode["transfers"]["descriptors"] == 2 * decode["transfers"]["blocks_read"]
    )
    assert decode["handshakes"] == {"done": 1} and prefill["scheduler"]["side_channel"]["served"] == 1
    assert prefill["worker"]["prefill"]["outcomes"] == {"read": len(want)}  # every hold freed by its notification
    assert serve["settled"] and all(whole(e) for e in serve["engines"].values())


def test_an_abort_mid_read_ends_in_time_and_leaves_no_block_held_in_either_engine(
    pd_run: dict[str, Any], run_offline: Callable[..., dict[str, Any]]
) -> None:
    want = run_offline("none")["passes"][0]
    before, abort = phase(pd_run, "serve"), phase(pd_run, "abort")
    ended = {r["key"]: r for r in abort["requests"]}
    aborted = {a.removeprefix("d-") for a in abort["aborted"]}
    assert aborted and set(ended) > aborted
    for key, r in ended.items():
        assert r["seconds"] <= DEADLINE + SLACK, f"decode request {key} took {r['seconds']} s"
        if key in aborted:
            assert r["finish_reason"] == "abort"
        else:  # read once the prefill resumed
            assert r["finish_reason"] == "length" and r["tokens"] == want[r["prompt"]]

    def outcomes(p: dict[str, Any], side: str) -> dict[str, int]:
        return dict(p["engines"][side]["connector"]["worker"][side]["outcomes"])

    d0, d1 = outcomes(before, "decode"), outcomes(abort, "decode")
    assert d1["aborted"] - d0.get("aborted", 0) == len(aborted), "the READs were in flight when vLLM aborted them"
    # A NIXL READ cannot be cancelled: an aborted load kept its blocks until its READ landed once the prefill
    # resumed (docs/nixl.md §6), and that READ's notification freed the prefill's copy.
    p0, p1 = outcomes(before, "prefill"), outcomes(abort, "prefill")
    assert p1.get("expired", 0) == p0.get("expired", 0) and p1["read"] - p0["read"] == len(ended)
    assert abort["settled"] and set(abort["engines"]) == {"prefill", "decode"}
    assert all(whole(e) for e in abort["engines"].values())


def test_a_killed_prefill_ends_every_decode_request_in_time_and_the_decode_pool_is_whole(
    pd_run: dict[str, Any],
) -> None:
    kill = phase(pd_run, "kill")
    assert len(kill["requests"]) >= 2
    for r in kill["requests"]:  # READs in flight at the kill, and requests that arrived after it
        assert r["finish_reason"] == "error" and r["seconds"] <= DEADLINE + SLACK, r
    assert kill["settled"] and set(kill["engines"]) == {"decode"}  # the prefill is dead
    decode = kill["engines"]["decode"]
    assert whole(decode) and decode["requests"] == 0
    assert decode["connector"]["worker"]["decode"]["outcomes"].get("failed", 0) >= len(kill["requests"])
