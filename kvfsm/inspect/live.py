"""Reading a tracker debug endpoint for the live view: ``/state``, and anomalies by kind from ``/metrics``.

The page cannot read the endpoint itself (another origin, and the page is
served on loopback with nothing else allowed), so its server reads it, with
the same bounds ``kvfsm top`` reads it with, and hands the page one JSON
document per poll. Only the URLs given on the command line are ever read.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from typing import Any

from ..observe.client import EndpointError, read

LIMIT = 5
"""Oldest instances asked for per state."""

ANOMALY = re.compile(r"^kvfsm_anomalies_total\{([^}]*)\}\s+([0-9.eE+]+)\s*$", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def anomalies(metrics: str) -> dict[str, dict[str, float]]:
    """``kvfsm_anomalies_total`` by machine and kind, summed over the other labels (Prometheus text format)."""
    out: dict[str, dict[str, float]] = {}
    for labels, value in ANOMALY.findall(metrics):
        named = dict(LABEL.findall(labels))
        machine, kind = named.get("machine", "?"), named.get("kind", "?")
        by_kind = out.setdefault(machine, {})
        by_kind[kind] = by_kind.get(kind, 0.0) + float(value)
    return out


class Watch:
    """The endpoints at ``urls``, read on demand and in order: what the page's next poll gets.

    One page can watch a deployment's processes together (a P/D pair's
    prefill and decode endpoints); an endpoint that cannot be read is shown
    as such, and the others still are.
    """

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        self.reads = 0
        self._lock = threading.Lock()

    def read(self) -> dict[str, Any]:
        """``{"endpoints": [one per URL], "reads": n}``; each is ``{"url", "state": /state, "anomalies": {machine:
        {kind: n}}, "metrics": bool}``, or ``{"url", "error"}``."""
        with self._lock:  # one read at a time, however many pages poll
            endpoints = [_endpoint(url) for url in self.urls]
            self.reads += 1
            return {"endpoints": endpoints, "reads": self.reads}


def _endpoint(url: str) -> dict[str, Any]:
    try:
        state = json.loads(read(f"{url}/state?limit={LIMIT}"))
        if not isinstance(state, dict) or not isinstance(state.get("trackers"), dict):
            raise EndpointError(f"{url}/state is not a kvfsm tracker dump")
    except (EndpointError, ValueError, RecursionError) as exc:
        return {"url": url, "error": str(exc)}
    try:
        found: dict[str, dict[str, float]] | None = anomalies(read(f"{url}/metrics").decode("utf-8", "replace"))
    except EndpointError:
        found = None  # an endpoint without a registry has no /metrics (404)
    return {"url": url, "state": state, "anomalies": found or {}, "metrics": found is not None}
