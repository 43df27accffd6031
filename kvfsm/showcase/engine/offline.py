"""A real vLLM engine (``LLM.generate``) on a prefix-repetition workload, with a connector or without: the tokens
it generated, what the connector did, and whether vLLM's own block pool is whole afterwards.

Pass 1 computes every prompt (the connector stores); the GPU prefix cache is
then reset, so pass 2 can only find the prefixes in the connector's tier
(CPU hits, loads into vLLM's cache). A connector is right when every pass
generates the tokens the same engine generates without it.

Run it as a module, one engine per process (vLLM keeps one connector per
process)::

    python -m kvfsm.showcase.engine.offline MODEL --connector cpu_offload --json out.json

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
connector's counters and vLLM's block pool can be read after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
"""vLLM's CPU attention needs a multiple of 32."""

ENGINE_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""Every engine process here: the CPU platform, 1 GiB of KV cache, no model hub."""


def prefix_prompts(
    *, prefixes: int = 4, per_prefix: int = 6, prefix_len: int = 96, suffix_len: int = 32, seed: int = 0
) -> list[list[int]]:
    """``prefixes × per_prefix`` token-id prompts: each prefix shared by ``per_prefix`` prompts, each suffix new.

    Token ids are drawn from the tiny model's vocabulary, past its two
    special tokens, so no prompt ends early.
    """
    rng = random.Random(seed)
    heads = [[rng.randrange(3, 300) for _ in range(prefix_len)] for _ in range(prefixes)]
    return [head + [rng.randrange(3, 300) for _ in range(suffix_len)] for head in heads for _ in range(per_prefix)]


ENGINE_SETTINGS: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK_SIZE,
    "max_model_len": 1024,
    "enforce_eager": True,
    "seed": 0,
    "disable_hybrid_kv_cache_manager": True,
}
"""``LLM(...)`` settings of every engine here (the server flags of :func:`.serve.engine_args` say the same): engines
whose tokens are compared must differ only in their connector."""


def make_llm(model: str | Path, kv_transfer_config: dict[str, Any] | None) -> Any:
    """A vLLM ``LLM`` on ``model`` with :data:`ENGINE_SETTINGS` and the given connector (None: no connector)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None if kv_transfer_config is None else KVTransferConfig(**kv_transfer_config)
    return LLM(str(model), kv_transfer_config=transfer, **ENGINE_SETTINGS)


def connector_config(name: str, **extra: Any) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` of connector ``name``: ``none``, kvfsm's ``cpu_offload`` or ``mooncake_store``,
    vLLM's ``example`` (``ExampleConnector``, on disk), or ``watch_<one of these>`` (kvfsm watch around it)."""
    if name == "none":
        return None
    if name.startswith("watch_"):  # kvfsm watch around another connector of this list (docs/watch.md)
        watch = extra.pop("watch", {})
        inner = connector_config(name.removeprefix("watch_"), **extra)
        if inner is None:
            raise ValueError("watch_none: the watch needs a connector to wrap")
        return {
            **inner,
            "kv_connector": "WatchConnector",
            "kv_connector_module_path": "kvfsm.adapters.vllm",
            "kv_connector_extra_config": {
                **inner["kv_connector_extra_config"],
                "inner": inner["kv_connector"],
                "inner_module_path": inner["kv_connector_module_path"],
                "watch": watch,
            },
        }
    if name == "example":  # vLLM's own disk-backed ExampleConnector
        path = extra.get("shared_storage_path") or tempfile.mkdtemp(prefix="kvfsm-example-")
        return {
            "kv_connector": "ExampleConnector",
            "kv_connector_module_path": None,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {**extra, "shared_storage_path": path},
        }
    classes = {"cpu_offload": "CpuOffloadConnector", "mooncake_store": "MooncakeStoreConnector"}
    if name not in classes:
        raise ValueError(f"unknown connector {name!r}; one of none, example, {', '.join(classes)} (watch_ before one)")
    defaults: dict[str, Any] = {"cpu_offload": {"num_cpu_blocks": 256}, "mooncake_store": {}}[name]
    return {
        "kv_connector": classes[name],
        "kv_connector_module_path": "kvfsm.adapters.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {**defaults, **extra},
    }


@dataclass
class EngineRun:
    """What one engine did: the greedy tokens of every pass, the connector's counters, vLLM's pool afterwards."""

    connector: str
    passes: list[list[list[int]]] = field(default_factory=list)
    """``passes[p][i]``: the tokens pass ``p`` generated for prompt ``i``."""
    stats: dict[str, Any] = field(default_factory=dict)
    gpu_blocks: int = 0
    gpu_blocks_free_after: int = 0
    """vLLM's ``BlockPool.get_num_free_blocks()`` once every request and transfer is over (the null block is never free)."""
    settle_steps: int = 0
    """Engine steps it took, after a pass, until the connector had let go of every vLLM block."""
    seconds: float = 0.0


def settle(llm: Any, *, timeout: float = 30.0) -> int:
    """Step the engine until the prefix cache can be reset (no block referenced); returns the steps it took.

    A connector that still holds vLLM's blocks (a store in flight) keeps the
    engine stepping (``has_pending_push_work``); in this in-process engine
    the steps are this loop's.
    """
    deadline = time.monotonic() + timeout
    steps = 0
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM's blocks still referenced {timeout} s after the pass: the connector holds them")
        llm.llm_engine.step()
        steps += 1
    return steps


def run(
    model: str,
    connector: str,
    prompts: list[list[int]],
    *,
    passes: int = 2,
    max_tokens: int = 8,
    extra: dict[str, Any] | None = None,
) -> EngineRun:
    """Generate ``prompts`` ``passes`` times on one engine, resetting vLLM's prefix cache between passes."""
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    t0 = time.monotonic()
    llm = make_llm(model, connector_config(connector, **(extra or {})))
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    result = EngineRun(connector)
    for _ in range(passes):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False)
        result.passes.append([list(o.outputs[0].token_ids) for o in outs])
        result.settle_steps = max(result.settle_steps, settle(llm))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    result.gpu_blocks = pool.num_gpu_blocks
    result.gpu_blocks_free_after = pool.get_num_free_blocks()
    if scheduler.connector is not None:
        result.stats = connector_stats(scheduler.connector)
        watch = getattr(scheduler.connector, "watch", None)
        if watch is not None:  # kvfsm watch: outcomes, what is still held, stuck findings
            result.stats["watch"] = watch.summary()
    result.seconds = time.monotonic() - t0
    return result


def connector_stats(connector: Any) -> dict[str, Any]:
    """The scheduler-side counters of a kvfsm connector, and how many of its instances are still live.

    A connector whose worker keeps its own counters (MooncakeStoreConnector:
    loads and stores by outcome, blocks moved, ``live``) has them merged in,
    read from vLLM's worker-role connector, which runs in this process.
    """
    half = getattr(connector, "scheduler_half", None)
    if half is not None:  # CpuOffloadConnector
        return {**asdict(half.stats), "live": half.live()}
    stats = getattr(connector, "stats", None)
    out = dict(stats() if callable(stats) else stats or {})
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    worker_stats = getattr(worker, "stats", None)
    if worker is not None and worker is not connector and callable(worker_stats):
        out.update(worker_stats())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder (kvfsm.showcase.engine.tiny_model makes one)")
    parser.add_argument(
        "--connector", default="none", help="none, cpu_offload, mooncake_store or example; watch_ before one wraps it"
    )
    parser.add_argument("--extra", default="{}", help="kv_connector_extra_config entries, as JSON")
    parser.add_argument("--prefixes", type=int, default=4)
    parser.add_argument("--per-prefix", type=int, default=6)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the run here")
    args = parser.parse_args(argv)
    prompts = prefix_prompts(prefixes=args.prefixes, per_prefix=args.per_prefix)
    result = run(args.model, args.connector, prompts, passes=args.passes, extra=json.loads(args.extra))
    text = json.dumps(asdict(result))
    if args.json:
        args.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
