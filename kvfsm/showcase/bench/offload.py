"""CPU-offload benchmarks: the driver's block copies against one contiguous copy, and the connector's scheduler-side cost.

Copies: for each block size and number of blocks per transfer, the driver
moves blocks at random (scattered) ids between the GPU-side and the CPU-side
cache — offload is GPU to CPU, load is CPU to GPU — and is compared with one
contiguous ``copy_`` of the same number of bytes between the same two
tensors, in the same run; a gather-then-scatter copy (``index_select`` into a
staging buffer, then ``index_copy_``) is shown for reference. The GPU side is
on CUDA when there is one (the CPU cache pinned), on the CPU otherwise.

Scheduler side: requests with an 8-block CPU hit and an 8-block store go
through every scheduler-side connector call, phase by phase as a scheduler
would drive them; the copies are not run (a copier that reports at once), so
what is measured is the connector, its Trackers and the block pools.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from ...adapters.vllm_api import KVConnectorOutput, RequestStatus
from ...adapters.vllm_cpu_offload import CpuOffloadMetadata, CpuOffloadScheduler, CpuOffloadWorker
from ...drivers.cpu_offload import CpuOffload
from ...drivers.kv_cache import Copy, Done, KVCache, KVLayout, copy_blocks
from ..sim.runner import run_worker
from .harness import interleaved

TARGET = 0.8
"""The driver must reach this fraction of the contiguous copy's throughput for transfers of ``TARGET_BLOCKS`` or more."""
TARGET_BLOCKS = 64


@dataclass(frozen=True)
class CopyRow:
    block_size: int
    blocks: int
    direction: str
    """'offload' (GPU to CPU) or 'load' (CPU to GPU)."""
    threads: int
    """torch intra-op threads during the measurement (all three variants alike)."""
    mib: float
    driver_gbps: float
    contiguous_gbps: float
    two_pass_gbps: float

    @property
    def ratio(self) -> float:
        return self.driver_gbps / self.contiguous_gbps


@dataclass(frozen=True)
class CallRow:
    call: str
    us_per_request: float


@dataclass
class OffloadReport:
    device: str
    layout: str
    primary_threads: int
    """The thread count the target is judged at (see :func:`run`)."""
    copies: list[CopyRow] = field(default_factory=list)
    calls: list[CallRow] = field(default_factory=list)
    requests: int = 0

    @property
    def us_per_request(self) -> float:
        return sum(c.us_per_request for c in self.calls)

    def target_met(self) -> bool:
        judged = [r for r in self.copies if r.blocks >= TARGET_BLOCKS and r.threads == self.primary_threads]
        return bool(judged) and all(r.ratio >= TARGET for r in judged)

    def as_dict(self) -> dict[str, object]:
        return {
            "device": self.device,
            "layout": self.layout,
            "copies": [{**asdict(r), "ratio": r.ratio} for r in self.copies],
            "calls": [asdict(c) for c in self.calls],
            "us_per_request": self.us_per_request,
            "requests": self.requests,
            "target": {
                "ratio": TARGET,
                "blocks_at_least": TARGET_BLOCKS,
                "threads": self.primary_threads,
                "met": self.target_met(),
            },
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _variants(src: KVCache, dst: KVCache, src_ids: list[int], dst_ids: list[int]) -> dict[str, Callable[[], object]]:
    """The three ways to move the same blocks; each returns the bytes it moved, after the device is idle."""
    device = src.device if src.device.type == "cuda" else dst.device
    dma = device.type == "cuda"
    n, size = len(src_ids), len(src_ids) * src.layout.block_bytes
    src_t, dst_t = torch.tensor(src_ids, device=src.device), torch.tensor(dst_ids, device=dst.device)

    def driver() -> object:
        moved = copy_blocks(src, src_ids, dst, dst_ids, non_blocking=dma)
        _sync(device)
        return moved

    def contiguous() -> object:
        dst.storage[:n].copy_(src.storage[:n], non_blocking=dma)
        _sync(device)
        return size

    def two_pass() -> object:
        # Gather into a staging buffer on the source device, then scatter: every byte is touched twice.
        staged = src.storage.index_select(0, src_t).to(dst.device, non_blocking=dma)
        dst.storage.index_copy_(0, dst_t, staged)
        _sync(device)
        return size

    return {"driver": driver, "contiguous": contiguous, "two_pass": two_pass}


def _prepared(workload: Callable[[], object]) -> Callable[[], Callable[[], object]]:
    """A setup for ``interleaved`` whose subject is built once (the caches are too big to rebuild per repeat)."""
    return lambda: workload


def bench_copies(
    layout: KVLayout,
    counts: Sequence[int],
    repeats: int,
    device: torch.device,
    progress: Callable[[str], None] | None = None,
) -> list[CopyRow]:
    """One row per (blocks, direction): driver, contiguous and two-pass throughput in GB/s, at the current threads."""
    threads = torch.get_num_threads()
    num_blocks = max(counts) * 5 // 4
    gpu = KVCache(layout, num_blocks, device)
    cpu = KVCache(layout, num_blocks, "cpu", pin_memory=device.type == "cuda")
    gpu.storage.normal_()
    cpu.storage.normal_()
    rng = random.Random(0)
    rows = []
    for n in counts:
        for direction, src, dst in (("offload", gpu, cpu), ("load", cpu, gpu)):
            if progress:
                progress(f"copy bs={layout.block_size} {direction} {n} blocks, {threads} thread(s)")
            variants = _variants(src, dst, rng.sample(range(num_blocks), n), rng.sample(range(num_blocks), n))
            size = n * layout.block_bytes

            def moved_all(_name: str, result: object, size: int = size) -> None:
                if result != size:
                    raise RuntimeError(f"a copy variant moved {result} bytes, not {size}")

            for warm in variants.values():
                warm()
            secs = interleaved({name: _prepared(f) for name, f in variants.items()}, repeats, moved_all)
            rows.append(
                CopyRow(
                    layout.block_size,
                    n,
                    direction,
                    threads,
                    size / 2**20,
                    size / secs["driver"] / 1e9,
                    size / secs["contiguous"] / 1e9,
                    size / secs["two_pass"] / 1e9,
                )
            )
    return rows


class _ReportAtOnce:
    """A copier that reports every job at once without copying: the scheduler side is what is timed."""

    def __init__(self) -> None:
        self._done: list[Done] = []

    def submit(self, copy: Copy) -> None:
        self._done.append((copy.job, None))

    def poll(self) -> list[Done]:
        out, self._done = self._done, []
        return out


@dataclass
class _Req:
    request_id: str
    block_hashes: list[int]
    num_tokens: int
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.blocks,)


@dataclass
class _Out:
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] | None = None


class _SchedulerRound:
    """One round of the scheduler-side benchmark: ``n`` requests, each with a hit to load and blocks to store."""

    def __init__(self, n: int, hit_blocks: int, store_blocks: int, samples: dict[str, list[float]]) -> None:
        layout = KVLayout(1, 16, 1, 8)
        self.n, self.bs, self.hit_blocks, self.samples = n, layout.block_size, hit_blocks, samples
        per_request = hit_blocks + store_blocks + 1
        self.offload = CpuOffload(layout, n * per_request, n * store_blocks + hit_blocks, device="cpu")
        shared = [hash(("prefix", i)) for i in range(hit_blocks)]
        pool = self.offload.cpu_pool
        seeded = pool.allocate("seed", hit_blocks)
        for b, h in zip(seeded, shared, strict=True):
            pool.cache(b, h)
        pool.release("seed")
        self.sched = CpuOffloadScheduler(self.offload)
        self.worker = CpuOffloadWorker(self.offload, _ReportAtOnce())
        tokens = (hit_blocks + store_blocks) * self.bs + 1
        self.reqs = [_Req(f"req-{i}", shared + [hash((i, j)) for j in range(store_blocks)], tokens) for i in range(n)]
        for r in self.reqs:
            r.blocks = self.offload.gpu_pool.allocate(r.request_id, per_request)

    def timed(self, name: str, fn: Callable[[], object]) -> object:
        start = time.perf_counter()
        result = fn()
        self.samples.setdefault(name, []).append((time.perf_counter() - start) / self.n * 1e6)
        return result

    def step(self, label: str, finished: set[str]) -> KVConnectorOutput:
        """build_connector_meta (timed), then the worker (not timed: it is not the scheduler side)."""
        out = _Out(finished)
        meta = self.timed(f"build_connector_meta ({label})", lambda: self.sched.build_connector_meta(out))
        assert isinstance(meta, CpuOffloadMetadata)
        return run_worker(self.worker, meta, finished)

    def run(self) -> None:
        sched, reqs, bs = self.sched, self.reqs, self.bs
        self.timed("get_num_new_matched_tokens (hit)", lambda: [sched.get_num_new_matched_tokens(r, 0) for r in reqs])
        self.timed(
            "update_state_after_alloc",
            lambda: [sched.update_state_after_alloc(r, r, self.hit_blocks * bs) for r in reqs],  # type: ignore[func-returns-value]
        )
        loaded = self.step("loads", set())
        self.timed("update_connector_output (loads)", lambda: sched.update_connector_output(loaded))
        for r in reqs:
            r.num_computed_tokens = r.num_tokens - 1
            r.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.timed("request_finished (store)", lambda: [sched.request_finished(r, r.blocks) for r in reqs])
        for r in reqs:
            self.offload.gpu_pool.release(r.request_id)
        stored = self.step("stores", {r.request_id for r in reqs})
        self.timed("update_connector_output (stores)", lambda: sched.update_connector_output(stored))
        if sched.stats.loads_done != self.n or sched.stats.stores_done != self.n:
            raise RuntimeError(f"the scheduler-side benchmark did not do its work: {sched.stats}")
        sched.shutdown()


def bench_scheduler(n: int, repeats: int, hit_blocks: int = 8, store_blocks: int = 8) -> list[CallRow]:
    """µs per request for each scheduler-side call, ``n`` requests at a time, phase by phase; medians of ``repeats``."""
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        _SchedulerRound(n, hit_blocks, store_blocks, samples).run()
    return [CallRow(name, statistics.median(values)) for name, values in samples.items()]


def run(quick: bool = False, progress: Callable[[str], None] | None = None) -> OffloadReport:
    """Both benchmarks. ``quick``: tiny sizes for a smoke test; the figures mean nothing.

    With CUDA the copies are DMA and are measured once, at torch's thread
    count. Without it both caches are host memory and the copies are memcpys
    on CPU threads; they are measured with one thread (where the target is
    judged: both variants get the same single core) and with torch's default
    count, where a copy of ``n`` blocks opens ``n`` parallel regions against
    the contiguous copy's one, which a busy machine makes visible.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, head_size, layers = (2, 16, 4) if quick else (8, 128, 16)
    counts = (1, 64) if quick else (1, 4, 16, 64, 256)
    repeats = 2 if quick else 11
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU only (both caches in host memory)"
    default = torch.get_num_threads()
    thread_counts = [default] if device.type == "cuda" else sorted({1, default})
    report = OffloadReport(
        name, f"{layers} layers × block_size × {heads} heads × {head_size}, float16", thread_counts[0]
    )
    gc.freeze()  # what exists now is never garbage: the collection before each timed call stays cheap
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for bs in (16, 64):
                layout = KVLayout(layers, bs, heads, head_size, torch.float16)
                report.copies += bench_copies(layout, counts, repeats, device, progress)
    finally:
        torch.set_num_threads(default)
        gc.unfreeze()
    if progress:
        progress("scheduler side")
    report.requests = 100 if quick else 2000
    report.calls = bench_scheduler(report.requests, 2 if quick else 7)
    return report


def format_table(report: OffloadReport) -> str:
    lines = [
        f"device: {report.device}; layout: {report.layout}",
        "",
        "block copies: driver (one batched _foreach_copy_ of per-block views) vs one contiguous copy_ of the same bytes",
        f"{'threads':>7} {'bs':>3} {'blocks':>6} {'direction':<9} {'MiB':>7} {'driver GB/s':>11} "
        f"{'contig GB/s':>11} {'ratio':>6} {'2-pass GB/s':>11}",
    ]
    for r in report.copies:
        judged = r.blocks >= TARGET_BLOCKS and r.threads == report.primary_threads
        mark = "" if not judged else (" ok" if r.ratio >= TARGET else " MISSED")
        lines.append(
            f"{r.threads:>7} {r.block_size:>3} {r.blocks:>6} {r.direction:<9} {r.mib:>7.1f} {r.driver_gbps:>11.2f} "
            f"{r.contiguous_gbps:>11.2f} {r.ratio:>6.0%} {r.two_pass_gbps:>11.2f}{mark}"
        )
    lines += [
        f"target: driver >= {TARGET:.0%} of contiguous for >= {TARGET_BLOCKS} blocks at {report.primary_threads} "
        f"thread(s): {'met' if report.target_met() else 'MISSED'}",
        "",
        f"scheduler side, {report.requests} requests (8-block hit loaded, 8 blocks stored), µs per request:",
    ]
    lines += [f"  {c.call:<36} {c.us_per_request:>8.1f}" for c in report.calls]
    lines.append(f"  {'total':<36} {report.us_per_request:>8.1f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfsm.showcase.bench.offload", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, figures mean nothing")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = run(quick=args.quick, progress=None if args.json else lambda s: print(f"... {s}", file=sys.stderr))
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_table(report))
    return 0 if report.target_met() or args.quick else 1


if __name__ == "__main__":
    sys.exit(main())
