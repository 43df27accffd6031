#!/usr/bin/env python3
"""Soak of the MoRIIO drivers (seed 001): 1P1D at high concurrency with injected faults; leaks, hangs, latency.

Usage: python benchmarks/moriio_soak.py [--requests N] [--concurrency C] [--fault-rate F] [--backend real|embedded]
                                        [--mode write|read] [--pre-fix] [--kill-after N] [--json]
       python benchmarks/moriio_soak.py --overhead

The real backend runs the prefill engine in a process of its own on Mooncake's
TransferEngine (tcp, P2PHANDSHAKE) and the decode engine here on another;
faults: failed and raising writes, lost and duplicated write_done and
remote_blocks (a remote that never sends its blocks); ``--kill-after`` SIGKILLs the
prefill once that many requests have ended. ``--pre-fix`` runs seed 001's prefill instead.
Exit 0 only when nothing leaked or hung and every request finished within its
deadline. docs/moriio.md explains the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Hashable, Sequence

from kvfsm.drivers.moriio import moriio_spec
from kvfsm.engine import Tracker
from kvfsm.harness.moriio.cluster import FAST, MOONCAKE, embedded_run, mooncake_run
from kvfsm.showcase.moriio_seed import PRE_FIX_PREFILL


class Bare:
    """Both WRITE-mode drivers with actions that do nothing: what is left is kvfsm's own bookkeeping."""

    def owe_send_report(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None: ...
    def report_sent(self, key: Hashable, /) -> None: ...
    def hold_blocks(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None: ...
    def free_blocks(self, key: Hashable, /) -> None: ...
    def post_writes(self, key: Hashable, /, remote_blocks: object) -> None: ...
    def release_writes(self, key: Hashable, /) -> None: ...
    def notify_write_done(self, key: Hashable, /) -> None: ...
    def withdraw_writes(self, key: Hashable, /, reply_to: str) -> None: ...
    def notify_released(self, key: Hashable, /, reply_to: str | None = None) -> None: ...
    def owe_recv_report(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None: ...
    def report_recv(self, key: Hashable, /) -> None: ...
    def report_loaded(self, key: Hashable, /) -> None: ...
    def pin_dst(self, key: Hashable, /, transfer_id: str, block_ids: Sequence[int]) -> None: ...
    def unpin_dst(self, key: Hashable, /) -> None: ...
    def send_remote_blocks(self, key: Hashable, /) -> None: ...
    def send_release(self, key: Hashable, /) -> None: ...
    def forget_grant(self, key: Hashable, /) -> None: ...
    def verify_blocks(self, key: Hashable, /) -> None: ...


def overhead(requests: int = 20_000, batch: int = 64) -> float:
    """Microseconds per request for the tracker calls of one WRITE-mode request on both sides, actions empty.

    Per request: producer begin, remote_blocks delivered by transfer_id, complete (fire_many over a
    step's batch); consumer begin, announce, write_done delivered; both trackers polled and drained.
    """
    producer = Tracker(moriio_spec("write_producer"), Bare())
    consumer = Tracker(moriio_spec("write_consumer"), Bare())
    start = time.perf_counter()
    for first in range(0, requests, batch):
        keys = [f"r{i}" for i in range(first, min(first + batch, requests))]
        for k in keys:
            producer.begin(k, transfer_id=f"t-{k}", block_ids=[0, 1])
            consumer.begin(k, transfer_id=f"t-{k}", block_ids=[0, 1])
            consumer.fire(k, "announce")
            producer.deliver("remote_blocks", f"t-{k}", remote_blocks=None)
        producer.fire_many("complete", keys)
        for k in keys:
            consumer.deliver("write_done", f"t-{k}", sender=0)
        for t in (producer, consumer):
            t.poll()
            t.finished()
    return 1e6 * (time.perf_counter() - start) / requests


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--fault-rate", type=float, default=0.1)
    ap.add_argument("--backend", choices=("real", "embedded"), default="real")
    ap.add_argument("--mode", choices=("write", "read"), default="write")
    ap.add_argument("--pre-fix", action="store_true")
    ap.add_argument("--kill-after", type=int, default=None, metavar="N")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--overhead", action="store_true", help="only the tracker cost per request, actions empty")
    opts = ap.parse_args(argv)
    if opts.overhead:
        print(json.dumps({"kvfsm_us_per_request_bare": round(overhead(), 1)}))
        return 0
    sizes = {"requests": opts.requests, "concurrency": opts.concurrency, "fault_rate": opts.fault_rate,
             "seed": opts.seed, "prefill": PRE_FIX_PREFILL if opts.pre_fix else None,
             "kill_after": opts.kill_after}  # fmt: skip
    if opts.backend == "real":
        if opts.mode != "write":
            ap.error("the real backend (Mooncake TransferEngine) runs WRITE mode")
        result = mooncake_run(**sizes, timeouts=MOONCAKE)
    else:
        result = embedded_run(opts.mode, **sizes, timeouts=FAST)
    summary = {"backend": opts.backend, "mode": opts.mode, "pre_fix": opts.pre_fix, **result.summary()}
    if opts.json:
        print(json.dumps(summary))
    else:
        for key, value in summary.items():
            print(f"{key:>22}  {value}")
    clean = result.leaked_blocks == 0 and result.hung == 0 and result.late == 0 and result.finished == opts.requests
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
