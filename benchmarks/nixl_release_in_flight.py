#!/usr/bin/env python3
"""Can a NIXL READ whose handle was released still write into the initiator's memory?

Measured with real NIXL agents (UCX, DRAM torch tensors) in two processes on
loopback: this process is the decode side (the READ's initiator, with a
destination tensor); a child process started from this same file is the
prefill side (the READ's target, with a source tensor). Each trial:

- the prefill fills its source with a byte of its own (one per trial, so a
  late write names the trial it came from); decode zeroes its destination;
- ``stopped``: the prefill is SIGSTOPped (state ``T`` in ``/proc``), then the
  READ is posted (``initialize_xfer`` + ``transfer``, with a notification);
  ``in_flight``: a large READ is posted, then the prefill is SIGSTOPped;
  ``kept``: as ``stopped``, but the handle is not released (the control:
  it shows what the stopped READ does when nobody gives up on it);
  ``killed``: as ``stopped``, but the prefill is then SIGKILLed instead of
  resumed, and the handle is polled, not released, to see whether a dead
  peer takes the READ out of ``PROC`` (a fresh pair of agents per trial);
  ``removed``: as ``stopped``, but decode calls ``remove_remote_agent`` on
  the stopped prefill (a disconnect, NIXL says) and polls the handle while
  the peer is still stopped, then releases it and goes on as ``stopped``
  (a fresh pair per trial);
- the handle is seen in ``PROC``, then ``release_xfer_handle`` (the
  decode driver's ``release_reads``), and the destination is overwritten with
  a second sentinel (what vLLM does when it gives the unpinned blocks to
  another request);
- the prefill is SIGCONTed; decode keeps its agent busy for ``--settle``
  seconds (a small probe READ on the same connection, over and over, until
  it is DONE and the time is up), then counts the destination's bytes that
  hold the trial's source byte: any such byte was written after the release.
- the prefill reports whether the READ's notification reached it.

Usage: python benchmarks/nixl_release_in_flight.py [--trials 10] [--small-mib 1] [--large-mib 64]
       [--settle 2.0] [--variants stopped,in_flight,kept,killed,removed] [--tls TLS]

``--tls`` sets ``UCX_TLS`` in both processes (default: UCX's own choice). Exit status 1 when any
released READ wrote its destination after the release.
Results and what they mean: docs/nixl.md §6 (Known hazard: a released READ still lands).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvfsm.harness.peer import PeerProcess, say, serve

os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

MIB = 1 << 20
PROBE = 4096
AFTER_RELEASE = 0xEE
"""What decode writes over its destination once the handle is released (a new owner's bytes)."""
VARIANTS = ("stopped", "in_flight", "kept", "killed", "removed")


# ---------------------------------------------------------------- the prefill side (the READ's target)


def _serve_peer(size: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(f"prefill-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    src = torch.zeros(size, dtype=torch.uint8)
    probe = torch.full((PROBE,), 0x77, dtype=torch.uint8)
    keep = [agent.register_memory(src), agent.register_memory(probe)]
    notifs: list[list[Any]] = []

    def collect() -> None:
        for messages in agent.get_new_notifs().values():
            notifs.extend([m.decode(errors="replace"), time.monotonic()] for m in messages)

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "add_peer":
            agent.add_remote_agent(base64.b64decode(cmd["metadata"]))
        elif cmd["op"] == "fill":
            src.fill_(cmd["value"])
        elif cmd["op"] == "notifs":
            collect()
            return {"notifs": notifs}
        return {}

    say({
        "metadata": base64.b64encode(bytes(agent.get_agent_metadata())).decode(),
        "src": src.data_ptr(), "probe": probe.data_ptr(),
    })  # fmt: skip
    serve(handle, tick=collect)
    del keep
    os._exit(0)  # skip UCX's teardown at interpreter exit


class Peer(PeerProcess):
    """The prefill process: this file run with ``--peer``."""

    def __init__(self, size: int) -> None:
        super().__init__(__file__, ["--peer", str(size)])


# ---------------------------------------------------------------- the decode side (the READ's initiator)


@dataclass
class Trial:
    variant: str
    size: int
    state_at_release: str = ""
    """The handle's state just before release (``kept``: at SIGCONT)."""
    released: str = "-"
    """``ok``, the error release_xfer_handle raised, or ``-`` (not released: ``kept``)."""
    before: int = 0
    """Destination bytes holding the source byte at release (written while the handle was live)."""
    after: int = 0
    """Destination bytes holding the source byte after SIGCONT and the settle (``kept``: once DONE)."""
    notif: bool = False
    """The READ's notification reached the prefill."""
    notif_after_cont_ms: float | None = None
    probe_ms: float | None = None
    """From SIGCONT to the first probe READ DONE on the same connection."""
    ended: str = ""
    """``killed``: the handle's state ``--settle`` seconds after the SIGKILL (or once it left ``PROC``)."""
    ended_ms: float | None = None
    """``killed``: from the SIGKILL to the handle leaving ``PROC``."""


@dataclass
class Measurement:
    trials: list[Trial] = field(default_factory=list)
    tls: str = ""


class Decode:
    def __init__(self, peer: Peer, size: int) -> None:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        self.torch = torch
        self.agent = nixl_agent(f"decode-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
        self.dst = torch.zeros(size, dtype=torch.uint8)
        self.probe = torch.zeros(PROBE, dtype=torch.uint8)
        self._keep = [self.agent.register_memory(self.dst), self.agent.register_memory(self.probe)]
        self.peer = peer
        self.raised = ""
        """What the last ``check_xfer_state`` that raised, raised."""
        self.name = self.agent.add_remote_agent(base64.b64decode(peer.hello["metadata"]))
        peer.call("add_peer", metadata=base64.b64encode(bytes(self.agent.get_agent_metadata())).decode())

    def post(self, size: int, notif: bytes, *, probe: bool = False) -> Any:
        local, remote = (self.probe.data_ptr(), self.peer.hello["probe"]) if probe else (
            self.dst.data_ptr(), self.peer.hello["src"])  # fmt: skip
        handle = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs([(local, size, 0)], "DRAM"),
            self.agent.get_xfer_descs([(remote, size, 0)], "DRAM"),
            self.name,
            notif,
        )
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError("transfer answered ERR")
        return handle

    def state(self, handle: Any) -> str:
        """``check_xfer_state``; ``ERR`` also when it raises (it raises nixlRemoteDisconnectError for a dead peer)."""
        try:
            state: str = self.agent.check_xfer_state(handle)
        except Exception as exc:  # the measured answer
            self.raised = type(exc).__name__
            return "ERR"
        return state

    def wait(self, handle: Any, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        state = self.state(handle)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            state = self.state(handle)
        return state

    def count(self, value: int, size: int) -> int:
        return int((self.dst[:size] == value).sum().item())

    def probe_until(self, settle: float) -> float | None:
        """Probe READs on the same connection until ``settle`` seconds passed; ms to the first DONE."""
        start = time.monotonic()
        first: float | None = None
        while True:
            h = self.post(PROBE, b"probe", probe=True)
            state = self.wait(h, max(0.05, settle - (time.monotonic() - start)))
            self.agent.release_xfer_handle(h)
            if state == "DONE" and first is None:
                first = (time.monotonic() - start) * 1e3
            if time.monotonic() - start >= settle:
                return first
            self.agent.get_new_notifs()
            time.sleep(0.01)

    def killed(self, value: int, size: int, settle: float) -> Trial:
        """Stop the prefill, post the READ, see it PROC, SIGKILL the prefill; poll the handle, never release it early."""
        t = Trial("killed", size)
        self.peer.call("fill", value=value)
        self.dst.zero_()
        self.peer.signal(signal.SIGSTOP)
        handle = self.post(size, b"killed")
        time.sleep(0.2)
        t.state_at_release = self.agent.check_xfer_state(handle)
        t.before = self.count(value, size)
        self.peer.kill()
        self.watch_end(t, handle, settle)
        t.after = self.count(value, size) - t.before
        try:
            self.agent.release_xfer_handle(handle)
            t.released = "ok"
        except Exception as exc:  # the measured answer
            t.released = f"{type(exc).__name__}: {exc}"[:60]
        return t

    def watch_end(self, t: Trial, handle: Any, settle: float) -> None:
        """Record how ``handle`` ended within ``settle`` seconds of now (an ERR with what raised), and how fast."""
        since = time.monotonic()
        self.raised = ""
        t.ended = self.wait(handle, settle)
        if self.raised:
            t.ended = f"ERR ({self.raised})"
        if t.ended != "PROC":
            t.ended_ms = (time.monotonic() - since) * 1e3

    def trial(self, variant: str, i: int, value: int, size: int, settle: float, notif_wait: float = 1.0) -> Trial:
        t = Trial(variant, size)
        self.peer.call("fill", value=value)
        self.dst.zero_()
        tag = f"{variant}-{i}"
        if variant == "in_flight":
            handle = self.post(size, tag.encode())
            self.peer.signal(signal.SIGSTOP)
        else:
            self.peer.signal(signal.SIGSTOP)
            handle = self.post(size, tag.encode())
            time.sleep(0.2)
        t.state_at_release = self.agent.check_xfer_state(handle)
        t.before = self.count(value, size)
        if variant == "removed":
            self.agent.remove_remote_agent(self.name)
            self.watch_end(t, handle, settle)
        if variant == "kept":
            self.peer.signal(signal.SIGCONT)
            cont = time.monotonic()
            state = self.wait(handle, settle)
            self.agent.release_xfer_handle(handle)
            t.after = self.count(value, size) if state == "DONE" else -1
        else:
            try:
                self.agent.release_xfer_handle(handle)
                t.released = "ok"
            except Exception as exc:  # the measured answer
                t.released = f"{type(exc).__name__}: {exc}"[:60]
            self.dst.fill_(AFTER_RELEASE)
            self.peer.signal(signal.SIGCONT)
            cont = time.monotonic()
            if variant == "removed":  # no connection left to probe on: just wait
                time.sleep(settle)
            else:
                t.probe_ms = self.probe_until(settle)
            t.after = self.count(value, size)
        deadline = time.monotonic() + notif_wait
        while True:
            seen = {m: at for m, at in self.peer.call("notifs")["notifs"]}
            if tag in seen or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if tag in seen:
            t.notif = True
            t.notif_after_cont_ms = (seen[tag] - cont) * 1e3
        return t


def measure(
    trials: int, small: int, large: int, settle: float, variants: list[str], tls: str, notif_wait: float = 1.0
) -> Measurement:
    """``tls`` only labels the result: set ``UCX_TLS`` in the environment before calling (the peer inherits it)."""
    out = Measurement(tls=tls or "(UCX default)")
    size = max(small, large) if "in_flight" in variants else small
    n = 0
    for variant in variants:
        for i in range(trials):
            fresh = variant in ("killed", "removed")
            if fresh or i == 0:  # one pair for the other variants; a fresh one per kill or removal
                pair = _pair(size)
            peer, decode = pair
            n += 1
            value = 0x10 + n % 0xD0  # never 0 and never AFTER_RELEASE
            try:
                if variant == "killed":
                    t = decode.killed(value, small, settle)
                else:
                    t = decode.trial(variant, i, value, large if variant == "in_flight" else small, settle, notif_wait)
            except BaseException:
                peer.stop()
                raise
            out.trials.append(t)
            print(f"  {variant:9} #{i}: {t}", file=sys.stderr, flush=True)
            if fresh or i == trials - 1:
                peer.stop()
    return out


def _pair(size: int) -> tuple[Peer, Decode]:
    """A prefill process and a decode agent that has READ from it once (the connection is up)."""
    peer = Peer(size)
    try:
        decode = Decode(peer, size)
        warm = decode.post(PROBE, b"warm", probe=True)
        if decode.wait(warm, 10.0) != "DONE":
            raise RuntimeError("the warm-up READ did not complete")
        decode.agent.release_xfer_handle(warm)
    except BaseException:
        peer.stop()
        raise
    return peer, decode


def table(m: Measurement) -> str:
    """One row per variant; for ``kept`` the "after" columns count the bytes once the READ was DONE."""
    rows = [
        f"UCX_TLS={m.tls}",
        "| variant | READ | trials | PROC at release | released ok | trials with bytes landed before release "
        "| trials with bytes landed after release | bytes landed after release (min–max) "
        "| notification reached prefill | probe READ DONE after SIGCONT (median ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        ts = [t for t in m.trials if t.variant == variant]
        if not ts:
            continue
        kept = variant == "kept"
        probes = sorted(t.probe_ms for t in ts if t.probe_ms is not None)
        cells = [
            variant, f"{ts[0].size / MIB:g} MiB", str(len(ts)), str(sum(t.state_at_release == "PROC" for t in ts)),
            "-" if kept else str(sum(t.released == "ok" for t in ts)), str(sum(t.before > 0 for t in ts)),
            f"{sum(t.after > 0 for t in ts)} (not released: once DONE)" if kept else str(sum(t.after > 0 for t in ts)),
            f"{min(t.after for t in ts)}–{max(t.after for t in ts)}", str(sum(t.notif for t in ts)),
            f"{probes[len(probes) // 2]:.0f}" if probes else "-",
        ]  # fmt: skip
        if variant == "removed":
            counts = Counter(t.ended for t in ts)
            cells[-1] = "while stopped, after remove_remote_agent: " + ", ".join(
                f"{n} {s}" for s, n in sorted(counts.items())
            )
        if variant == "killed":
            ended = sorted(t.ended_ms for t in ts if t.ended_ms is not None)
            counts = Counter(t.ended for t in ts)
            states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            cells[4:] = [
                "-", str(sum(t.before > 0 for t in ts)), f"{sum(t.after > 0 for t in ts)} (after the SIGKILL)",
                f"{min(t.after for t in ts)}–{max(t.after for t in ts)}", "-",
                f"after SIGKILL: {states}" + (f"; left PROC in {ended[0]:.1f}–{ended[-1]:.1f} ms" if ended else ""),
            ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--small-mib", type=float, default=1.0)
    ap.add_argument("--large-mib", type=float, default=64.0)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds to keep decode's agent busy after SIGCONT")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--tls", default="", help="UCX_TLS for both processes")
    ap.add_argument("--json", action="store_true")
    opts = ap.parse_args(argv)
    if opts.tls:
        os.environ["UCX_TLS"] = opts.tls
    variants = [v for v in opts.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}")
    m = measure(opts.trials, int(opts.small_mib * MIB), int(opts.large_mib * MIB), opts.settle, variants, opts.tls)
    if opts.json:
        print(json.dumps({"tls": m.tls, "trials": [t.__dict__ for t in m.trials]}))
    else:
        print(table(m))
    released = [t for t in m.trials if t.variant != "kept"]
    return 1 if any(t.after > 0 for t in released) else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peer":
        _serve_peer(int(sys.argv[2]))
    sys.exit(main())
