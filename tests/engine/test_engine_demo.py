"""``kvfsm demo --engine vllm``: the main job on real engines ends with a clean ledger, as a user runs it.

About 75 s on 2 cores, so it is ``slow`` as well as a real-engine test: ``./dev.sh test`` runs it in its real-engine
step (``--run-engines --run-slow``), with each connector's own engine test in this folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_engine_demo_ends_clean_with_every_token_as_without_a_connector(
    tmp_path: Path, engine_env: dict[str, str]
) -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kvfsm"), "demo", "--engine", "vllm", "--format", "json"],
        env=engine_env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ledger = json.loads(proc.stdout)
    assert ledger["clean"] is True
    parts = {p["name"]: p for p in ledger["parts"]}
    assert parts["offload"]["identical"] == parts["offload"]["compared"] == 48
    assert parts["offload"]["counters"]["hits"] >= 24
    for pair in ("nixl", "moriio"):
        serve = parts[f"{pair}.serve"]
        assert serve["identical"] == serve["compared"] == 24, serve
        assert parts[f"{pair}.abort"]["ended_otherwise"].get("abort", 0) >= 1
        kill = parts[f"{pair}.kill"]
        assert sum(kill["ended_otherwise"].values()) + kill["compared"] >= 1
    for part in ledger["parts"]:
        assert not any(part["blocks_held"].values()) and part["hung"] == 0, part
