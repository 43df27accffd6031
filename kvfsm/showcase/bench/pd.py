"""The PD control plane under abuse: a fuzz of malformed messages against a live listener, and P/D soaks.

``fuzz(n)`` sends ``n`` malformed control messages (random bytes, wrong
frame counts, truncated, oversized, wrong versions, wrong types, valid-looking
with ids outside the receiver's id space) at a live :class:`~kvfsm.wire.Listener`
and reports what it dropped by reason, whether its thread survived, and the
process's peak RSS. ``main()`` adds P/D jobs at high concurrency and prints
the figures (``benchmarks/pd_soak.py``).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

import msgspec

from ...wire import HEADER, MAX_BODY, Metadata, encode


def _malformed(rng: random.Random) -> list[bytes]:
    """One malformed message, of a kind chosen at random."""
    good = encode(Metadata(peer="decode", room=rng.randrange(1 << 40), pages=[1, 2, 3, 4]))
    kind = rng.randrange(9)
    if kind == 0:
        return [rng.randbytes(rng.randrange(1, 64))]
    if kind == 1:
        return [HEADER] * rng.choice((1, 3, 5)) if rng.random() < 0.5 else [*good, rng.randbytes(8)]
    if kind == 2:
        return [HEADER, good[1][: rng.randrange(len(good[1]))]]
    if kind == 3:
        return [HEADER, rng.randbytes(MAX_BODY + 1 + rng.randrange(4096))]
    if kind == 4:
        return [b"kvfsm/%d" % rng.randrange(2, 99), good[1]]
    if kind == 5:
        return [HEADER, msgspec.msgpack.encode({"type": "metadata", "peer": "decode", "room": "seven", "pages": [1]})]
    if kind == 6:
        return [HEADER, msgspec.msgpack.encode({"type": rng.choice(("ABORT", "abort", "shutdown")), "room": 1})]
    if kind == 7:  # valid, but names pages far outside the receiver's pool: the receiver's id-space check drops it
        return encode(Metadata(peer="decode", room=rng.randrange(1 << 62), pages=[1 << 30] * 4))
    body = bytearray(good[1])
    body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
    return [HEADER, bytes(body)]


@dataclass
class FuzzResult:
    """What the listener did with the fuzz."""

    messages: int
    received: int
    accepted: int
    """Messages that decoded although mangled (a flipped bit can leave a valid message); the receiver's spec judges them."""
    accepted_valid: int
    drops: dict[str, int]
    listener_deaths: int
    peak_rss_mib: float
    rss_growth_mib: float
    seconds: float


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def fuzz(n: int, seed: int = 0, max_pages: int = 1024) -> FuzzResult:
    """Send ``n`` malformed messages and then one valid one; the listener must drop the first and take the last."""
    from ...wire import Listener, Sender

    rng = random.Random(seed)

    def check(message: Any) -> str | None:
        if isinstance(message, Metadata) and max(message.pages) >= max_pages:
            return "unknown_id"
        return None

    before = peak_rss_mib()
    start = time.perf_counter()
    with Listener(check=check) as listener:
        sender = Sender(listener.endpoint, hwm=0, timeout_ms=5000)
        try:
            for _ in range(n):
                sender.send_frames(_malformed(rng))
            sender.send(Metadata(peer="decode", room=1, pages=[0, 1, 2, 3]))
            deadline = time.monotonic() + 60
            taken: list[Any] = []
            while listener.stats().received < n + 1 and time.monotonic() < deadline:
                taken += listener.take(timeout=0.05)
            taken += listener.take()
        finally:
            sender.close()
        stats = listener.stats()
    valid = sum(1 for m in taken if isinstance(m, Metadata) and m.room == 1 and m.pages == [0, 1, 2, 3])
    after = peak_rss_mib()
    return FuzzResult(
        n, stats.received, stats.accepted, valid, stats.drops, 0 if stats.alive else 1, round(after, 1), round(after - before, 1),
        round(time.perf_counter() - start, 2),
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Print the fuzz and soak figures (``--json`` for one object)."""
    from ...harness.pd import JobConfig, run_job

    p = argparse.ArgumentParser(description="PD control-plane fuzz and P/D soaks (see docs/wire.md, docs/demo.md)")
    p.add_argument("--messages", type=int, default=100_000, help="malformed messages to fuzz (100,000)")
    p.add_argument("--requests", type=int, default=10_000, help="requests per soak (10,000)")
    p.add_argument("--concurrency", type=int, default=512)
    p.add_argument("--fault-rate", type=float, default=0.1)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"fuzz": asdict(fuzz(args.messages))}
    for protocol in ("corrected", "merged_fix"):
        config = JobConfig(
            requests=args.requests, concurrency=args.concurrency, fault_rate=args.fault_rate, protocol=protocol,
            deadline=300.0,
        )  # fmt: skip
        ledger = run_job(config).as_dict()
        ledger.pop("config")
        result[protocol] = ledger
    if args.json:
        print(json.dumps(result))
    else:
        for name, figures in result.items():
            print(f"{name}: {json.dumps(figures)}")
    return 0
