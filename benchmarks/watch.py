#!/usr/bin/env python3
"""kvfsm watch's cost on vLLM's scheduler step: the WatchConnector around vLLM's NixlConnector against the bare one.

Usage: python benchmarks/watch.py [--live 256] [--steps 300] [--repeats 7] [--json]

Both run vLLM's real ``Scheduler`` (CPU, kv_both) with ``--live`` requests
always live: each one loads its prompt asynchronously (``do_remote_prefill``:
``get_num_new_matched_tokens`` answers (k, True), ``update_state_after_alloc``,
``finished_recving`` a step later), decodes 16 tokens, and is held after it
finishes (``do_remote_decode``: ``delay_free=True`` until ``finished_sending``
two steps later); a finished request is replaced at once. So every step of the
wrapped scheduler feeds the watch loads, holds, reports and its deadline poll.
A step is ``schedule()``, the fake worker's report and ``update_from_output``,
timed as a whole. Bare and wrapped live side by side in one process and run
interleaved, ten steps of one then ten of the other, so load from other
processes falls on both alike; the figures are the ratio of their median step
times and the median ratio of paired chunks (target < 1.05). On a shared
machine those move by a few percent either way, so the wrapped run also times
what it spends inside the watch's calls (all but the wrapper's own guards
around them): its share of the wrapped step is the steadier figure.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

BLOCK = 16
PROMPT = 3 * BLOCK + 4
DECODE = 16


def scheduler(wrapped: bool, live: int) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    from kvfsm.showcase.sim.opt125m import model_dir
    from kvfsm.showcase.sim.real import EngineConfig, kv_cache_config

    if wrapped:
        transfer = KVTransferConfig(
            kv_connector="WatchConnector",
            kv_connector_module_path="kvfsm.adapters.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"inner": "NixlConnector"},
        )
    else:
        transfer = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
    blocks = live * 6 + 64
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir()), skip_tokenizer_init=True, dtype="float16", seed=42),
        scheduler_config=SchedulerConfig(
            max_num_seqs=live,
            max_num_batched_tokens=live * PROMPT,
            max_model_len=2048,
            is_encoder_decoder=False,
            disable_hybrid_kv_cache_manager=True,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(EngineConfig(num_gpu_blocks=blocks, block_size=BLOCK)),
        log_stats=False,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
    )


class Run:
    """One scheduler kept at ``live`` requests, and its fake worker: recv a step after the load is sent, send two."""

    def __init__(self, wrapped: bool, live: int) -> None:
        self.s = scheduler(wrapped, live)
        self.live = live
        self.next_id = 0
        self.step_no = 0
        self.recv_due: dict[int, set[str]] = {}
        self.send_due: dict[int, set[str]] = {}
        for _ in range(live):
            self.add()
        self.watch_seconds = 0.0
        """Time spent inside the watch's calls, measured on the wrapped run."""
        if wrapped:  # every call into the watch, timed (the inline guards and delegation frames are not)
            watch = self.s.connector.watch
            for name in ("matched", "allocated", "finished", "output", "step"):
                setattr(watch, name, self._timed(getattr(watch, name)))

    def _timed(self, call: Any) -> Any:
        def timed(*args: Any) -> None:
            t0 = time.perf_counter()
            try:
                call(*args)
            finally:
                self.watch_seconds += time.perf_counter() - t0

        return timed

    def add(self) -> None:
        from kvfsm.showcase.sim.real import make_request

        i = self.next_id
        self.next_id += 1
        request = make_request(
            f"req-{i}", [3 + i % 97] + [5 + (i * 7 + k) % 300 for k in range(PROMPT - 1)], DECODE, BLOCK
        )
        request.kv_transfer_params = {
            "do_remote_prefill": True,
            "do_remote_decode": True,
            "remote_engine_id": "prefill-0",
            "remote_request_id": f"p-{i}",
            "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }
        self.s.add_request(request)

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        from kvfsm.showcase.sim.real import model_output

        s = self.s
        self.step_no += 1
        n = self.step_no
        out = s.schedule()
        meta = out.kv_connector_metadata
        loads = set(getattr(meta, "reqs_to_recv", {}) or {})
        self.recv_due.setdefault(n + 1, set()).update(loads)
        self.send_due.setdefault(n + 2, set()).update(out.finished_req_ids)
        recv = self.recv_due.pop(n, set()) & set(s.requests)
        send = self.send_due.pop(n, set()) & set(s.requests)
        ids = list(out.num_scheduled_tokens)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in ids]
        kv = KVConnectorOutput(finished_sending=send or None, finished_recving=recv or None)
        before = len(s.requests)
        s.update_from_output(out, model_output(ids, sampled, kv))
        for _ in range(max(0, self.live - (before - len(send)) + 0)):
            if s.get_num_unfinished_requests() >= self.live:
                break
            self.add()


def measure(live: int, steps: int, repeats: int, chunk: int = 10) -> dict[str, Any]:
    """Both schedulers live side by side; ``chunk`` steps of one, then of the other (order rotating), ``steps``
    steps each per repeat, so load from other processes falls on both alike. Paired chunk ratios, and medians."""
    times: dict[str, list[float]] = {"bare": [], "wrapped": []}
    pairs: list[float] = []
    shares: list[float] = []
    summary: dict[str, Any] = {}
    for _ in range(repeats):
        runs = {"bare": Run(False, live), "wrapped": Run(True, live)}
        for run in runs.values():
            for _ in range(20):  # warm up: every request under way, the first holds and loads done
                run.step()
        gc.collect()
        gc.disable()
        try:
            for c in range(steps // chunk):
                took = {}
                for name in ("bare", "wrapped") if c % 2 == 0 else ("wrapped", "bare"):
                    run = runs[name]
                    inside = run.watch_seconds
                    t0 = time.perf_counter()
                    for _ in range(chunk):
                        run.step()
                    took[name] = (time.perf_counter() - t0) / chunk
                    times[name].append(took[name])
                    if name == "wrapped":
                        shares.append((run.watch_seconds - inside) / (took[name] * chunk))
                pairs.append(took["wrapped"] / took["bare"])
        finally:
            gc.enable()
        summary = runs["wrapped"].s.connector.watch.summary()
        for run in runs.values():
            assert run.s.get_num_unfinished_requests() >= live * 0.9
    bare, wrapped = statistics.median(times["bare"]), statistics.median(times["wrapped"])
    return {
        "live": live,
        "steps": steps,
        "repeats": repeats,
        "bare_step_ms": round(bare * 1e3, 3),
        "wrapped_step_ms": round(wrapped * 1e3, 3),
        "ratio": round(wrapped / bare, 4),
        "paired_ratio_median": round(statistics.median(pairs), 4),
        "watch_share_median": round(statistics.median(shares), 4),
        "target": 1.05,
        "watch_outcomes": summary.get("outcomes", {}),
        "watch_live": summary.get("live", {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = measure(args.live, args.steps, args.repeats)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['live']} live requests, {result['steps']} steps x {result['repeats']} repeats: "
            f"bare {result['bare_step_ms']} ms/step, wrapped {result['wrapped_step_ms']} ms/step, "
            f"ratio {result['ratio']}, median of paired chunks {result['paired_ratio_median']} "
            f"(target < {result['target']}); time inside the watch's calls: "
            f"{result['watch_share_median']:.1%} of the wrapped step"
        )
        print(f"watch outcomes: {result['watch_outcomes']}")
    return 0 if result["paired_ratio_median"] < result["target"] else 1


if __name__ == "__main__":
    sys.exit(main())
