"""The MoRIIO drivers on real transfer engines: Mooncake's TransferEngine across two processes, and NIXL agents.

The prefill engine runs in its own process (:mod:`kvfsm.harness.moriio.peer`)
with its own TransferEngine (tcp, P2PHANDSHAKE); the decode engine runs here
with another. Writes are ``transfer_submit_write`` polled with
``transfer_check_status``; ``remote_blocks`` / ``write_done`` go over ZMQ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

from kvfsm.harness.moriio.cluster import Timeouts, mooncake_run
from kvfsm.showcase.moriio_seed import PRE_FIX_PREFILL

QUICK = Timeouts(defer=0.5, transfer=1.0, recv=2.0)


@pytest.mark.mooncake_te
def test_600_requests_at_concurrency_128_with_10_percent_faults_across_processes() -> None:
    result = mooncake_run(requests=600, concurrency=128, fault_rate=0.1, timeouts=QUICK)
    assert result.finished == 600
    assert result.leaked_blocks == 0 and result.hung == 0 and result.late == 0, result.summary()
    assert set(result.faults) >= {"failed_write", "raising_write", "lost_write_done", "lost_remote_blocks"}
    assert result.prefill["outcomes"]["expired"] >= result.faults["lost_remote_blocks"]
    loaded = result.decode["outcomes"]["loaded"]
    assert result.decode["verified_blocks"] == 2 * loaded and loaded >= 480


KILLED_MID_RUN = """
import json
from kvfsm.harness.moriio.cluster import Timeouts, mooncake_run
quick = Timeouts(defer=0.5, transfer=1.0, recv=2.0)
result = mooncake_run(requests=1024, concurrency=512, fault_rate=0.1, timeouts=quick, kill_after=300)
print(json.dumps({**result.summary(), "decode": result.decode}, default=str))
"""


@pytest.mark.mooncake_te
def test_concurrency_512_with_faults_and_the_prefill_process_killed_mid_run() -> None:
    """Every decode request ends within its deadline, nothing stays held on this side, loaded blocks are checked.

    The decode side runs in a fresh process, as it does in production: in the test process, threads earlier
    tests left behind slowed the step that expires the dead peer's loads enough to make some late.
    """
    child = subprocess.run([sys.executable, "-c", KILLED_MID_RUN], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result["finished"] == 1024 and result["late"] == 0, result
    decode = result["decode"]
    assert decode["held_blocks"] == 0 and decode["live"] == 0
    outcomes = decode["outcomes"]
    assert outcomes["expired"] > 200 and outcomes["loaded"] > 0  # faults alone expire about 65
    assert decode["verified_blocks"] == 2 * outcomes["loaded"] and decode["blocks_wrong"] == 0


@pytest.mark.mooncake_te
def test_the_pre_fix_prefill_process_holds_the_blocks_of_lost_remote_blocks_for_good() -> None:
    result = mooncake_run(
        requests=400, concurrency=128, fault_rate=0.1, faults=("lost_remote_blocks",), timeouts=QUICK,
        prefill=PRE_FIX_PREFILL,
    )  # fmt: skip
    lost = result.faults["lost_remote_blocks"]
    assert lost > 0 and result.prefill["live"] == lost and result.prefill["held_blocks"] == 2 * lost
    assert result.hung == lost


@pytest.mark.slow
def test_soak_concurrency_512_with_10_percent_faults_across_processes() -> None:
    result = mooncake_run(requests=4096, concurrency=512, fault_rate=0.1)
    assert result.finished == 4096
    assert result.leaked_blocks == 0 and result.hung == 0 and result.late == 0, result.summary()


@pytest.mark.nixl
@pytest.mark.parametrize("mode", ["read", "write"])
def test_both_modes_on_real_nixl_agents_with_faults(mode: str) -> None:
    """Two NIXL agents in a child process (NIXL's teardown stays out of pytest); the run's summary comes back as JSON.
    WRITE mode posts NIXL WRITEs into the decode side's registered blocks; every loaded block is byte-checked."""
    pytest.importorskip("nixl")
    code = (
        "import json, os; from kvfsm.harness.moriio.cluster import nixl_run; "
        f"print(json.dumps(nixl_run({mode!r}).summary()), flush=True); os._exit(0)"
    )
    env = {**os.environ, "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=env, check=True)
    summary = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert summary["finished"] == 300 and summary["leaked_blocks"] == 0 and summary["hung"] == 0
    assert summary["late"] == 0 and sum(summary["faults"].values()) >= 15
    assert summary["verified_blocks"] == 2 * summary["decode_outcomes"]["loaded"]


DUPLICATED_RELEASE = """
import json, os, time
from kvfsm.drivers.moriio import DecodeEngine, PlaneTransport, PrefillEngine, Source, expected_acks
from kvfsm.drivers.nixl.agent import NixlAgent
from kvfsm.harness.faults import FaultPlan
from kvfsm.harness.moriio.cluster import faulty

def until(what, step, limit=10.0):
    end = time.monotonic() + limit
    while not what():
        if time.monotonic() > end:
            raise TimeoutError(what.__doc__)
        step()
        time.sleep(0.002)

p, d0, d1 = (PlaneTransport(NixlAgent(f"moriio-{name}")) for name in ("prefill", "decode-0", "decode-1"))
prefill = PrefillEngine(p, 8, 1024, mode="read", acks=expected_acks(2, 1), params={"defer_timeout": 30.0})
twice = PlaneTransport(faulty(d0.agent, FaultPlan(1.0, ["duplicate_release"])))  # rank 0 sends each release twice
decode = [
    DecodeEngine(t, 8, 1024, p.name, mode="read", rank=rank, params={"transfer_timeout": 10.0})
    for rank, t in enumerate([twice, d1])
]
for d in (d0, d1):
    p.add_peer(d.metadata())
    d.add_peer(p.metadata())
source = Source(p.name, prefill.blocks.base, 1024, tuple(prefill.compute("p-1", "t-1", 2)))
out = {}
heard = (2, 3)  # releases at the prefill once rank 0's (twice), then rank 1's, arrived
for rank, engine in enumerate(decode):
    engine.start(f"d-{rank}", "t-1", 2, source)
    until(lambda: engine.outcomes, engine.step)
    until(lambda: prefill.counts["release"] >= heard[rank], prefill.step)
    out[rank] = {
        "decode": dict(engine.outcomes), "state": prefill.tracker.state("p-1"),
        "held_blocks": prefill.stats()["held_blocks"], "anomalies": dict(prefill.anomalies),
    }
out["prefill"] = dict(prefill.outcomes)
out["verified_blocks"] = sum(e.driver.stats["blocks_verified"] for e in decode)
print(json.dumps(out), flush=True)
os._exit(0)
"""


@pytest.mark.nixl
def test_read_mode_on_real_nixl_agents_a_release_repeated_by_one_decode_rank_never_frees_the_blocks() -> None:
    """Decode TP = 2 × prefill TP over three NIXL agents: decode rank 0's release reaches the prefill twice, and the
    blocks stay held (the repeat is a ``duplicate``) until rank 1 has read them and said so."""
    pytest.importorskip("nixl")
    env = {**os.environ, "UCX_MODULES": "^ib", "NIXL_LOG_LEVEL": "WARN"}
    done = subprocess.run(
        [sys.executable, "-c", DUPLICATED_RELEASE], capture_output=True, timeout=60, env=env, check=True
    )
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    first, second = out["0"], out["1"]
    assert first == {
        "decode": {"loaded": 1}, "state": "held", "held_blocks": 2, "anomalies": {"duplicate:request_id": 1}
    }  # fmt: skip
    assert second["decode"] == {"loaded": 1} and second["state"] is None and second["held_blocks"] == 0
    assert out["prefill"] == {"released": 1} and out["verified_blocks"] == 4
