#!/usr/bin/env python3
"""Can a Mooncake TransferEngine READ that its initiator gave up on still write into the initiator's memory?

Measured with real TransferEngines (tcp, P2PHANDSHAKE on loopback, as
:func:`kvfsm.drivers.mooncake.agent.mooncake_engine` sets them up for the MoRIIO
drivers) in two processes: this process is the decode side (the READ's
initiator, with a destination buffer); a child process started from this
same file is the prefill side (the READ's target, with a source buffer).

The READ is what a MoRIIO READ-mode consumer on the TransferEngine would post:
one ``batch_transfer_async_read`` per block (the wheel's only asynchronous
read; ``MooncakeAgent.post`` posts one ``transfer_submit_write`` per block
the same way), each polled with ``transfer_check_status`` (0 pending, 1 done,
-1 failed, -2 timeout; a final answer frees the batch, so it is never polled
again). Giving up is what ``BlockReader.release_reads`` does through
``MooncakeAgent.release``: the batch ids are forgotten, nothing is called
on the engine (it has no cancel). Each trial:

- the prefill fills its source with a byte of its own (one per trial, so a
  late write names the trial it came from); decode zeroes its destination;
- ``stopped``: the prefill is SIGSTOPped (state ``T`` in ``/proc``), the READ
  posted and polled for 0.2 s, then given up on; ``in_flight``: a large READ
  is posted, then the prefill SIGSTOPped and the READ given up on;
- the destination is overwritten with ``0xEE`` (what vLLM does when it gives
  the unpinned blocks to another request), the prefill is SIGCONTed, and decode
  waits ``--settle`` seconds (a small probe READ on the same connection, over
  and over, shows when it carries bytes again); then it counts the
  destination's bytes that hold the trial's source byte: each was written
  after the give-up;
- ``kept`` (the control): as ``stopped``, not given up, polled after SIGCONT
  until every block answered;
- ``killed``: as ``stopped``, then the prefill is SIGKILLed instead of resumed
  and the READ polled, to see whether a dead peer ends it (a fresh prefill per
  trial);
- ``timeout``: as ``stopped``, but the prefill stays stopped while the READ
  is polled until the engine's own timeout ends it (``MC_TCP_PROGRESS_TIMEOUT_SEC``,
  30 s by default, set to ``--engine-timeout`` for these trials only), then
  the destination is overwritten, the prefill SIGCONTed and the bytes counted
  as for ``stopped`` (a fresh prefill per trial).

Usage: python benchmarks/moriio_release_in_flight.py [--trials 10] [--quick] [--variants ...]
       [--small-mib 1] [--large-mib 64] [--blocks 4] [--settle 2.0] [--engine-timeout 2]

``--quick``: 3 trials, ``--settle 1``. Exit status 1 when any given-up READ wrote its destination
after the give-up. Results and what they mean: docs/moriio.md, "Giving up on a READ in flight".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvfsm.harness.peer import PeerProcess, say, serve

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

MIB = 1 << 20
PROBE = 4096
AFTER_GIVE_UP = 0xEE
"""What decode writes over its destination once it gave up on the READ (a new owner's bytes)."""
VARIANTS = ("stopped", "in_flight", "kept", "killed", "timeout")
PENDING, DONE = 0, 1
TIMEOUT_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
"""The TransferEngine's tcp deadlines (30 s each by default), read from the environment per transfer."""


def _engine() -> Any:
    from kvfsm.drivers.mooncake.agent import mooncake_engine

    return mooncake_engine()  # 127.0.0.1, P2PHANDSHAKE, tcp: the MoRIIO drivers' MooncakeAgent


# ---------------------------------------------------------------- the prefill side (the READ's target)


def _serve_peer(size: int) -> None:
    import torch

    engine = _engine()
    src = torch.zeros(size, dtype=torch.uint8)
    probe = torch.full((PROBE,), 0x77, dtype=torch.uint8)
    for buf in (src, probe):
        if engine.register_memory(buf.data_ptr(), buf.numel()) != 0:
            raise RuntimeError("register_memory failed")

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "fill":
            src.fill_(cmd["value"])
        return {}

    say({"session": f"127.0.0.1:{engine.get_rpc_port()}", "src": src.data_ptr(), "probe": probe.data_ptr()})
    serve(handle)
    os._exit(0)  # skip the engine's teardown at interpreter exit


class Peer(PeerProcess):
    """The prefill process: this file run with ``--peer``."""

    def __init__(self, size: int) -> None:
        super().__init__(__file__, ["--peer", str(size)])
        self.session: str = self.hello["session"]


# ---------------------------------------------------------------- the decode side (the READ's initiator)


@dataclass
class Trial:
    variant: str
    size: int
    at_give_up: str = ""
    """The blocks' answers when decode gave up (``kept``: at SIGCONT, ``killed``: at the SIGKILL), e.g. ``4×0``."""
    pending: int = 0
    """Blocks still pending (answer 0) then."""
    before: int = 0
    """Destination bytes holding the source byte at the give-up (written while decode still waited)."""
    after: int = 0
    """Destination bytes holding the source byte after SIGCONT and the settle (``kept``: once every block answered)."""
    ended: str = ""
    """``kept``, ``killed``, ``timeout``: the blocks' final answers (``-`` none within the wait)."""
    ended_ms: float | None = None
    """``killed``: from the SIGKILL, ``timeout``: from the post, to the last block's final answer."""
    probe_ms: float | None = None
    """From SIGCONT to the first probe READ done on the same connection."""


@dataclass
class Read:
    """One READ of a request's blocks: a batch id per block, and each block's final answer once it came."""

    ids: list[int]
    final: dict[int, int] = field(default_factory=dict)


def _answers(answers: list[int]) -> str:
    return ", ".join(f"{n}×{rc}" for rc, n in sorted(Counter(answers).items()))


class Decode:
    def __init__(self, size: int) -> None:
        import torch

        self.engine = _engine()
        self.dst = torch.zeros(size, dtype=torch.uint8)
        self.probe = torch.zeros(PROBE, dtype=torch.uint8)
        for buf in (self.dst, self.probe):
            if self.engine.register_memory(buf.data_ptr(), buf.numel()) != 0:
                raise RuntimeError("register_memory failed")

    def post(self, peer: Peer, size: int, blocks: int) -> Read:
        """One ``batch_transfer_async_read`` per block, as the consumer posts its reads (one per block)."""
        n = size // blocks
        ids = []
        for b in range(blocks):
            ids.append(
                self.engine.batch_transfer_async_read(
                    peer.session, [self.dst.data_ptr() + b * n], [peer.hello["src"] + b * n], [n]
                )
            )
        if 0 in ids or -1 in ids:  # the submit itself failed: the measurement is void
            raise RuntimeError(f"batch_transfer_async_read answered {ids}")
        return Read(ids)

    def poll(self, read: Read) -> list[int]:
        """Each block's answer; a final one is kept and never asked again (asking frees nothing twice)."""
        for i, tid in enumerate(read.ids):
            if i not in read.final:
                rc = self.engine.transfer_check_status(tid)
                if rc not in (PENDING, -2):
                    read.final[i] = rc
        return [read.final.get(i, PENDING) for i in range(len(read.ids))]

    def wait(self, read: Read, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        answers = self.poll(read)
        while len(read.final) < len(read.ids) and time.monotonic() < deadline:
            time.sleep(0.002)
            answers = self.poll(read)
        return answers

    def count(self, value: int, size: int) -> int:
        return int((self.dst[:size] == value).sum().item())

    def probe_until(self, peer: Peer, settle: float) -> float | None:
        """Probe READs of 4 KiB until ``settle`` seconds passed; ms to the first done."""
        start = time.monotonic()
        first: float | None = None
        while time.monotonic() - start < settle:
            tid = self.engine.batch_transfer_async_read(
                peer.session, [self.probe.data_ptr()], [peer.hello["probe"]], [PROBE]
            )
            if tid in (0, -1):
                time.sleep(0.05)
                continue
            rc = PENDING
            while rc in (PENDING, -2) and time.monotonic() - start < settle:
                time.sleep(0.002)
                rc = self.engine.transfer_check_status(tid)
            if rc == DONE and first is None:
                first = (time.monotonic() - start) * 1e3
            time.sleep(0.01)
        return first

    def trial(self, peer: Peer, variant: str, value: int, size: int, blocks: int, opts: argparse.Namespace) -> Trial:
        t = Trial(variant, size)
        peer.call("fill", value=value)
        self.dst.zero_()
        if variant == "in_flight":
            read = self.post(peer, size, blocks)
            peer.signal(signal.SIGSTOP)
            posted = time.monotonic()
        else:
            peer.signal(signal.SIGSTOP)
            read = self.post(peer, size, blocks)
            posted = time.monotonic()
            time.sleep(0.2)
        if variant == "killed":
            answers = self.poll(read)
            t.at_give_up, t.pending = _answers(answers), answers.count(PENDING)
            t.before = self.count(value, size)
            peer.kill()
            killed = time.monotonic()
            answers = self.wait(read, opts.settle)
            t.ended = _answers(answers) if len(read.final) == len(read.ids) else f"- ({_answers(answers)})"
            if len(read.final) == len(read.ids):
                t.ended_ms = (time.monotonic() - killed) * 1e3
            t.after = self.count(value, size) - t.before
            return t
        if variant == "timeout":
            answers = self.wait(read, (opts.engine_timeout or 30.0) + 10.0)
            t.ended = _answers(answers) if len(read.final) == len(read.ids) else f"- ({_answers(answers)})"
            if len(read.final) == len(read.ids):
                t.ended_ms = (time.monotonic() - posted) * 1e3
        answers = self.poll(read)
        t.at_give_up, t.pending = _answers(answers), answers.count(PENDING)
        t.before = self.count(value, size)
        if variant == "kept":
            peer.signal(signal.SIGCONT)
            answers = self.wait(read, opts.settle + 5.0)
            t.ended = _answers(answers) if len(read.final) == len(read.ids) else f"- ({_answers(answers)})"
            t.after = self.count(value, size)
            return t
        # give up as release_reads does: forget the batch ids (no engine call), the blocks go to a new owner
        del read
        self.dst.fill_(AFTER_GIVE_UP)
        peer.signal(signal.SIGCONT)
        t.probe_ms = self.probe_until(peer, opts.settle)
        t.after = self.count(value, size)
        return t


@contextlib.contextmanager
def _engine_timeout(seconds: float) -> Any:
    """The engine's tcp deadlines set to ``seconds`` (0: its defaults) while the block runs; then as before."""
    saved = {k: os.environ.get(k) for k in TIMEOUT_ENV}
    if seconds > 0:
        os.environ.update({k: str(int(seconds)) for k in TIMEOUT_ENV})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _warm(decode: Decode, peer: Peer) -> None:
    """One probe READ, so the connection is up before the trial stops the peer."""
    tid = decode.engine.batch_transfer_async_read(
        peer.session, [decode.probe.data_ptr()], [peer.hello["probe"]], [PROBE]
    )
    deadline = time.monotonic() + 10.0
    rc = PENDING
    while rc in (PENDING, -2) and time.monotonic() < deadline:
        time.sleep(0.002)
        rc = decode.engine.transfer_check_status(tid)
    if rc != DONE:
        raise RuntimeError(f"the warm-up READ answered {rc}")


def measure(opts: argparse.Namespace, variants: list[str]) -> list[Trial]:
    small, large = int(opts.small_mib * MIB), int(opts.large_mib * MIB)
    size = max(small, large) if "in_flight" in variants else small
    decode = Decode(size)
    trials: list[Trial] = []
    n = 0
    peer: Peer | None = None
    try:
        for variant in variants:
            for i in range(opts.trials):
                fresh = variant in ("killed", "timeout")
                if peer is None or fresh:
                    if peer is not None:
                        peer.stop()
                    peer = Peer(size)
                    _warm(decode, peer)
                n += 1
                value = 0x10 + n % 0xD0  # never 0 and never AFTER_GIVE_UP
                with _engine_timeout(opts.engine_timeout if variant == "timeout" else 0):
                    t = decode.trial(
                        peer, variant, value, large if variant == "in_flight" else small, opts.blocks, opts
                    )
                trials.append(t)
                print(f"  {variant:9} #{i}: {t}", file=sys.stderr, flush=True)
                if fresh:
                    peer.stop()
                    peer = None
    finally:
        if peer is not None:
            peer.stop()
    return trials


def table(trials: list[Trial], opts: argparse.Namespace) -> str:
    rows = [
        f"TransferEngine tcp on loopback, {opts.blocks} blocks per READ, settle {opts.settle:g} s"
        + (f", engine timeout {opts.engine_timeout:g} s (timeout rows)" if opts.engine_timeout else ""),
        "| variant | READ | trials | every block pending when given up | trials with bytes landed before the give-up "
        "| trials with bytes landed after the give-up | bytes landed after (min–max) | how the READ ended "
        "| probe READ done after SIGCONT (median ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        ts = [t for t in trials if t.variant == variant]
        if not ts:
            continue
        probes = sorted(t.probe_ms for t in ts if t.probe_ms is not None)
        ended = Counter(t.ended for t in ts if t.ended)
        ms = sorted(t.ended_ms for t in ts if t.ended_ms is not None)
        how = {
            "stopped": "never asked again (given up)",
            "in_flight": "never asked again (given up)",
            "kept": "after SIGCONT: ",
            "killed": "after SIGKILL: ",
            "timeout": "while stopped: ",
        }[variant]
        if ended:
            how += "; ".join(f"{k} ({v}/{len(ts)})" for k, v in sorted(ended.items()))
        if ms:
            how += f", {ms[0]:.1f}–{ms[-1]:.1f} ms" + (
                " after the SIGKILL" if variant == "killed" else " after the post"
            )
        landed_after = sum(t.after > 0 for t in ts)
        cells = [
            variant, f"{ts[0].size / MIB:g} MiB", str(len(ts)),
            f"{sum(t.pending == opts.blocks for t in ts)} (some: {sum(t.pending > 0 for t in ts)})",
            str(sum(t.before > 0 for t in ts)),
            f"{landed_after} (not given up: once answered)" if variant == "kept" else str(landed_after),
            f"{min(t.after for t in ts)}–{max(t.after for t in ts)}", how,
            f"{probes[len(probes) // 2]:.0f}" if probes else "-",
        ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="3 trials, --settle 1")
    ap.add_argument("--small-mib", type=float, default=1.0)
    ap.add_argument("--large-mib", type=float, default=64.0)
    ap.add_argument("--blocks", type=int, default=4, help="READs (one batch each) per request")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to wait after SIGCONT (or SIGKILL)")
    ap.add_argument(
        "--engine-timeout", type=float, default=2.0, help="MC_TCP_*_TIMEOUT_SEC for the timeout trials (0: 30 s)"
    )
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.trials, opts.settle = 3, 1.0
    variants = [v for v in opts.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    trials = measure(opts, variants)
    if opts.json:
        print(json.dumps([t.__dict__ for t in trials]))
    else:
        print(table(trials, opts))
    given_up = [t for t in trials if t.variant in ("stopped", "in_flight", "timeout")]
    return 1 if any(t.after > 0 for t in given_up) else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peer":
        _serve_peer(int(sys.argv[2]))
    sys.exit(main())
