"""``kvfsm inspect``: a spec, a system, a counterexample, a trace set, a test story, a journal or a live process,
seen in a browser.

One page, self-contained (its script, stylesheet and diagrams inlined), built
from what kvfsm already computes: the Graphviz diagram of :mod:`kvfsm.gen`,
the findings of ``kvfsm check`` pinned to the states and edges they name, an
explorer trace (or each trace of a system's trace set) replayed into per-step
snapshots (:mod:`.steps`), what ``kvfsm test`` and ``kvfsm replay`` found
read back onto it (:mod:`.runs`: a story or a journal as one machine's
timeline, a trace's replay on drivers), and a tracker debug
endpoint's ``/state`` read for the live view (:mod:`.live`).
:mod:`.page` builds it, :mod:`.serve` serves it on loopback.
"""

from __future__ import annotations

from .findings import Pinned, pin
from .page import InspectError, Page, TraceView, build, build_trace_set, html, live_page
from .runs import build_journal, build_replayed, build_story
from .serve import InspectServer
from .steps import Snapshot, snapshots, timeline

__all__ = [
    "InspectError",
    "InspectServer",
    "Page",
    "Pinned",
    "Snapshot",
    "TraceView",
    "build",
    "build_journal",
    "build_replayed",
    "build_story",
    "build_trace_set",
    "html",
    "live_page",
    "pin",
    "snapshots",
    "timeline",
]
