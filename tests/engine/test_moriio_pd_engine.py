"""kvfsm's MoRIIOConnector (seed 001's shape, WRITE mode) between two real vLLM engines in two OS processes
(``kvfsm.showcase.engine.pd``): the prefill engine WRITEs its KV from vLLM's own cache into the decode engine's with
the Mooncake TransferEngine, and the decode engine generates the tokens one engine generates alone; an abort
mid-transfer keeps the decode engine's blocks until the prefill has stopped writing into them, and a killed prefill
ends every decode request within its deadline; neither leaves a block held.

One run of the runner serves all three tests (starting the two engines is most of the cost): ``serve`` (each prompt's
prefill and decode requests go out together, as MoRIIO's router sends them), then ``abort``, then ``kill`` (the
prefill dies in it, so it comes last).
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

PLUG = "kvfsm.adapters.vllm_moriio_pd:MORIIO"
ABORT_TIMEOUT, READ_TIMEOUT, HANDSHAKE_TIMEOUT = 15.0, 8.0, 2.0
"""The runner's options: the prefill waits ``ABORT_TIMEOUT`` for ``remote_blocks`` (``defer_timeout``); a decode
request waits at most read + handshake for its write (``recv_timeout``: MoRIIO has no handshake of its own)."""
DEADLINE = READ_TIMEOUT + HANDSHAKE_TIMEOUT
SLACK = 5.0
"""A deadline fires at the next engine step; two engines and the runner share two cores."""
LAYERS = 2
"""The tiny model's layers: one TransferEngine write per (layer, block) of vLLM's CPU cache."""


@pytest.fixture(scope="module")
def pd_run(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Any]:
    """The runner's JSON. It runs in a session of its own, so its engine processes (a stopped one included) die
    with it whatever happens; it picks its own notify port."""
    out = tmp_path_factory.mktemp("moriio-pd") / "run.json"
    cmd = [
        sys.executable, "-m", "kvfsm.showcase.engine.pd", str(tiny_model), "--connector", PLUG,
        "--phases", "serve,abort,kill", "--abort-timeout", str(ABORT_TIMEOUT), "--read-timeout", str(READ_TIMEOUT),
        "--handshake-timeout", str(HANDSHAKE_TIMEOUT), "--json", str(out),
    ]  # fmt: skip
    env = {**os.environ, **ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("KVFSM_MORIIO_NOTIFY_PORT", None)
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=400)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the runner's group: it and its engines, stopped or not
        proc.wait(timeout=10)
    if proc.returncode != 0:
        raise AssertionError(f"the P/D runner failed ({proc.returncode}):\n{err[-6000:]}")
    run: dict[str, Any] = json.loads(out.read_text())
    return run


def phase(run: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [p for p in run["phases"] if p["name"] == name]
    return found


def side(p: dict[str, Any], role: str) -> dict[str, Any]:
    """The worker-side engine of ``role`` (``prefill`` or ``decode``) as the phase left it."""
    found: dict[str, Any] = p["engines"][role]["connector"]["worker"][role]
    return found


def whole(engine: dict[str, Any]) -> bool:
    """vLLM's pool has every block but the null one free, and the connector holds none and tracks nothing."""
    worker = engine["connector"]["worker"]
    held = sum(worker[s]["held_blocks"] for s in ("prefill", "decode") if s in worker)
    return engine["free_blocks"] == engine["gpu_blocks"] - 1 and engine["connector"]["live"] == 0 and held == 0


def grew(before: dict[str, Any], after: dict[str, Any], role: str, what: str) -> dict[str, int]:
    """How much each of ``role``'s ``what`` counters grew during a phase."""
    old, new = side(before, role)[what], side(after, role)[what]
    return {k: v - old.get(k, 0) for k, v in new.items() if v != old.get(k, 0)}


def test_the_decode_engine_generates_a_single_engines_tokens_from_kv_the_prefill_wrote_with_the_transfer_engine(
    pd_run: dict[str, Any], run_offline: Callable[..., dict[str, Any]]
) -> None:
    want = run_offline("none")["passes"][0]
    serve = phase(pd_run, "serve")
    got = {r["prompt"]: r["tokens"] for r in serve["requests"]}
    assert len(want) >= 24 and sorted(got) == list(range(len(want)))
    diff = [i for i, tokens in enumerate(want) if got[i] != tokens]
    assert not diff, f"prompts {diff} generated other tokens than one engine without a connector"
    assert {r["finish_reason"] for r in serve["requests"]} == {"length"}
    prefill, decode = side(serve, "prefill"), side(serve, "decode")
    # Every load was the prefill's WRITE into the decode engine's blocks, every write a TransferEngine write.
    assert decode["outcomes"] == {"loaded": len(want)} and decode["counts"]["write_done"] == len(want)
    assert prefill["outcomes"] == {"written": len(want)} and prefill["counts"]["remote_blocks"] == len(want)
    writes = prefill["transfers"]
    assert writes["batches_written"] == len(want) and writes["blocks_written"] >= len(want)
    assert writes["blocks_written"] == decode["transfers"]["blocks_announced"]
    engine = serve["engines"]["prefill"]["connector"]["worker"]["transfer_engine"]
    assert engine["transfers"] == LAYERS * writes["blocks_written"] and engine["refused"] == 0
    assert engine["bytes"] == writes["bytes_written"] > 0
    assert prefill["anomalies"] == {} and decode["anomalies"] == {} and prefill["errors"] == decode["errors"] == 0
    assert serve["settled"] and all(whole(e) for e in serve["engines"].values())


def test_an_abort_mid_transfer_ends_in_time_and_keeps_the_blocks_until_the_prefill_has_stopped_writing(
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
        else:  # written once the prefill resumed
            assert r["finish_reason"] == "length" and r["tokens"] == want[r["prompt"]]
    assert grew(before, abort, "decode", "outcomes") == {"aborted": len(aborted), "loaded": len(ended) - len(aborted)}
    # Every decode load ended on its prefill's answer, never on its deadline: write_done (written, before or after
    # the release reached the prefill: the decode engine held the blocks either way) or released (the prefill heard
    # the release first and wrote nothing, or drained what it had started). Which one depends on the steps' timing.
    answers = grew(before, abort, "decode", "counts")
    assert answers.get("write_done", 0) + answers.get("released", 0) == len(ended), answers
    assert answers.get("released", 0) <= len(aborted)
    prefill = grew(before, abort, "prefill", "outcomes")
    assert sum(prefill.values()) == len(ended) and set(prefill) <= {"written", "aborted"}, prefill
    assert prefill.get("aborted", 0) == answers.get("released", 0) <= len(aborted)
    assert set(side(abort, "prefill")["anomalies"]) <= {"late:transfer_id"}  # a release that came after write_done
    assert side(abort, "decode")["anomalies"] == {}, "an answer came for a load that had ended"
    assert abort["settled"] and set(abort["engines"]) == {"prefill", "decode"}
    assert all(whole(e) for e in abort["engines"].values())


def test_a_killed_prefill_ends_every_decode_request_at_its_deadline_and_the_decode_pool_is_whole(
    pd_run: dict[str, Any],
) -> None:
    kill = phase(pd_run, "kill")
    assert len(kill["requests"]) >= 2
    for r in kill["requests"]:  # loads waiting at the kill, and requests that arrived after it
        assert r["finish_reason"] == "error" and r["seconds"] <= DEADLINE + SLACK, r
    assert kill["settled"] and set(kill["engines"]) == {"decode"}  # the prefill is dead
    decode = kill["engines"]["decode"]
    assert whole(decode) and decode["requests"] == 0
    assert grew(phase(pd_run, "abort"), kill, "decode", "outcomes") == {"expired": len(kill["requests"])}
