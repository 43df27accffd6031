"""The inspect page's model, without a browser (fast: part of the default run).

The merged fix's counterexample (seed 002) replayed into snapshots: at the
write_after_free move prefill writes (transferring, holding src_pages) while
decode has freed kv_pages and ABORT is still in flight. Findings land on the
states they name; the HTML holds everything it needs.
"""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest

import kvfsm
from kvfsm.explore import explore
from kvfsm.explore.trace import Trace
from kvfsm.inspect import InspectError, build, build_trace_set, html, pin, snapshots
from kvfsm.inspect.live import anomalies
from kvfsm.spec import check, read
from kvfsm.spec.system import read_system
from kvfsm.testing.trace_set import trace_set

ROOT = Path(__file__).resolve().parents[2]
MERGED_FIX = ROOT / "kvfsm/specs/pd_abort/merged_fix.yaml"
CORRECTED = ROOT / "kvfsm/specs/pd_abort/corrected.yaml"
PRE_FIX = ROOT / "kvfsm/specs/moriio/write_pre_fix.yaml"
needs_dot = pytest.mark.skipif(
    shutil.which("dot") is None, reason="Graphviz dot is not installed (./dev.sh installs it)"
)


@pytest.fixture(scope="module")
def merged_fix_trace() -> Trace:
    result = explore(MERGED_FIX, requests=1)
    (violated,) = [p for p in result.properties if p.trace is not None]
    assert violated.trace is not None
    return violated.trace


def test_the_write_after_free_move_shows_both_roles_and_what_is_in_flight(merged_fix_trace: Trace) -> None:
    snaps = snapshots(merged_fix_trace)
    last = snaps[-1]
    assert last.violation and not any(s.violation for s in snaps[:-1])
    where = {i.role: (i.state, i.holds, i.freed) for i in last.instances}
    assert where["prefill"] == ("transferring", ("src_pages",), ())
    assert where["decode"] == ("aborted", (), (("kv_pages", 2),))
    assert last.in_flight == {"r0": ("abort_req",)}
    assert snaps[0].text == "the instances begin" and snaps[0].in_flight == {"r0": ()}
    assert [s.delivered for s in snaps] == [None, None, None, "metadata", None]
    assert snaps[1].sent == (("metadata", "prefill", False),)


def test_findings_are_pinned_to_the_states_they_name() -> None:
    system, _errors = read_system(PRE_FIX)
    pinned = pin(check(PRE_FIX), system)
    assert [(p.finding.code, p.nodes) for p in pinned] == [
        ("KVF107", ("producer/deferred",)),
        ("KVF107", ("producer/writing",)),
    ]


def test_a_finding_on_a_transition_line_is_pinned_to_its_edges() -> None:
    spec = read(ROOT / "specs/kv_request.yaml")
    start = next(t for t in spec.transitions if t.event == "start")
    from kvfsm.spec import Finding

    f = Finding("KVF999", "warning", spec.path, start.loc.line, "made up")
    (p,) = pin([f], spec)
    assert p.edges == (("queued", "transferring"),) and p.nodes == ()


@needs_dot
def test_the_page_is_one_file_that_names_nothing_outside_it(merged_fix_trace: Trace) -> None:
    page = build(MERGED_FIX, merged_fix_trace)
    text = html(page)
    assert "{{" not in text.replace("{{name}}", "")
    for attr in re.findall(r'(?:src|href)\s*=\s*"([^"]*)"', text):
        assert not attr.startswith(("http:", "https:", "//")), attr
    assert "@import" not in text and "url(http" not in text
    assert 'id="kvfsm-data"' in text and "write_after_free" in text
    rows = [r.node for r in page.states]
    assert "prefill/transferring" in rows and "decode/aborted" in rows


@needs_dot
def test_a_trace_of_another_system_or_on_a_machine_spec_is_refused(merged_fix_trace: Trace) -> None:
    with pytest.raises(InspectError, match="not 'pd_abort_corrected'"):
        build(ROOT / "kvfsm/specs/pd_abort/corrected.yaml", merged_fix_trace)
    with pytest.raises(InspectError, match="machine spec"):
        build(ROOT / "specs/kv_request.yaml", merged_fix_trace)


@needs_dot
def test_the_corrected_systems_page_holds_every_trace_of_its_trace_set() -> None:
    chosen = trace_set(CORRECTED)
    page = build_trace_set(CORRECTED)
    assert len(page.traces) == len(chosen.traces) > 1
    assert [v.purpose for v in page.traces] == [g.name for g in chosen.goals]
    for view, trace in zip(page.traces, chosen.traces, strict=True):
        assert len(view.snaps) == len(trace.moves) + 1 and view.request == trace.request and view.channel
        assert view.purpose in view.covers  # each is the shortest trace for its goal, which it covers
        assert not any(s.violation for s in view.snaps)  # a trace set breaks nothing
    data = page.data()["traces"]
    assert [t["label"].split(" · ")[0] for t in data] == [str(n) for n in range(1, len(chosen.traces) + 1)]
    text = html(page)
    assert all(f'data-trace="{n}"' in text for n in range(len(chosen.traces)))
    assert "as kvfsm explore prints it" not in text  # no chart: explore prints counterexamples, not these


@needs_dot
def test_one_counterexample_is_the_one_trace_case(merged_fix_trace: Trace) -> None:
    (view,) = build(MERGED_FIX, merged_fix_trace).traces
    assert view.purpose == "" and view.snaps[-1].violation
    assert view.label(1) == "1 · 4 moves · write_after_free: " + merged_fix_trace.violation


def test_anomalies_are_read_by_machine_and_kind_from_metrics_text() -> None:
    text = (
        "# TYPE kvfsm_anomalies_total counter\n"
        'kvfsm_anomalies_total{machine="pd_prefill",kind="late"} 3.0\n'
        'kvfsm_anomalies_total{kind="late",machine="pd_prefill",tracker="b"} 2.0\n'
        'kvfsm_anomalies_total{machine="pd_decode",kind="unknown"} 1.0\n'
        'kvfsm_instances{machine="pd_decode",state="waiting"} 4.0\n'
    )
    assert anomalies(text) == {"pd_prefill": {"late": 5.0}, "pd_decode": {"unknown": 1.0}}


def test_one_live_page_reads_every_endpoint_and_says_which_is_down() -> None:
    from kvfsm.inspect.live import Watch
    from kvfsm.observe import serve

    class Quiet:
        def __getattr__(self, action: str) -> object:
            return lambda key: None

    tracker = kvfsm.Tracker(kvfsm.load(ROOT / "specs/kv_request.yaml"), Quiet())
    tracker.begin("req-1")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    with serve([tracker]) as endpoint:
        doc = Watch([endpoint.url, gone]).read()
    up, down = doc["endpoints"]
    assert (
        up["url"] == endpoint.url.rstrip("/")
        and up["state"]["trackers"]["kv_request"]["states"]["pinned"]["count"] == 1
    )
    assert down["url"] == gone and "error" in down and "state" not in down
    assert doc["reads"] == 1
