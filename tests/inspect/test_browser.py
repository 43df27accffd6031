"""kvfsm inspect's page in a real headless Chromium (``--run-browser``; ``./dev.sh test`` runs it as its own step).

The seed-002 merged-fix counterexample, written by ``kvfsm explore --trace``
and drawn by ``kvfsm inspect --html``, is stepped with the keys and buttons
to the write_after_free move, where both roles' states, what each holds and
has freed, and the message in flight are on the page; the same file opens
with every network request refused and asks for none. The corrected
system's trace set is stepped trace by trace, each to its last move. A failing
``kvfsm test`` story steps to its divergence, a stalled Tracker's journal to
each ``kvfsm replay`` finding. The spec view pins
findings on the diagram; the served page and the live view of a running
``kvfsm demo --metrics`` are read the same way.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
KVFSM = [sys.executable, "-m", "kvfsm.cli"]


def kvfsm(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFSM, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def trace_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kvfsm explore specs/pd_abort/merged_fix.yaml --trace`` then ``kvfsm inspect ... --html``, as docs/inspect.md."""
    folder = tmp_path_factory.mktemp("inspect")
    trace, out = folder / "t.json", folder / "merged_fix.html"
    explored = kvfsm("explore", "specs/pd_abort/merged_fix.yaml", "--trace", str(trace))
    assert explored.returncode == 1, explored.stdout + explored.stderr
    drawn = kvfsm("inspect", "specs/pd_abort/merged_fix.yaml", "--trace", str(trace), "--html", str(out))
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    return out


def instances(tab: Any) -> dict[str, list[str]]:
    rows = tab.locator("#instances tbody tr").all()
    return {r.get_attribute("data-instance"): [c.inner_text() for c in r.locator("td").all()[2:]] for r in rows}


def current_nodes(tab: Any) -> set[str]:
    return set(tab.eval_on_selector_all("#diagram g.node.current", "gs => gs.map(g => g.dataset.state)"))


def test_the_merged_fix_trace_steps_to_write_after_free(
    page: Any, trace_page: Path, screenshot: Callable[[Any, str], Path]
) -> None:
    page.goto(trace_page.as_uri())
    assert page.locator("#counter").inner_text() == "start / 4"
    assert current_nodes(page) == {"prefill/bootstrapping", "decode/bootstrapping"}
    for _ in range(3):
        page.keyboard.press("ArrowRight")
    page.click("#next")
    assert page.locator("#counter").get_attribute("data-step") == "4"
    assert page.locator("#violation").is_visible()
    assert "write_after_free (r0): prefill is in transferring while decode lacks kv_pages" in page.inner_text(
        "#violation"
    )
    assert current_nodes(page) == {"prefill/transferring", "decode/aborted"}
    assert instances(page) == {
        "prefill": ["transferring", "src_pages", ""],  # writing from its pages...
        "decode": ["aborted", "nothing", "kv_pages (move 2)"],  # ...into pages decode freed at move 2
    }
    assert page.inner_text("#flight") == "r0: abort_req"  # the ABORT that would have stopped it: still in flight
    assert page.locator("#sequence .row.current").get_attribute("data-step") == "4"
    screenshot(page, "trace")
    page.keyboard.press("ArrowLeft")
    assert page.locator("#counter").get_attribute("data-step") == "3"
    assert not page.locator("#violation").is_visible()
    assert instances(page)["prefill"][:2] == ["waiting_input", "src_pages"]
    assert page.inner_text("#flight") == "r0: abort_req"
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")  # move 1: decode took its pages and sent their indices
    assert instances(page)["decode"] == ["waiting", "kv_pages", ""]
    assert page.inner_text("#flight") == "r0: metadata"
    page.click("#sequence .row[data-step='2']")  # a row of the sequence diagram steps there
    assert page.locator("#counter").get_attribute("data-step") == "2"
    assert page.inner_text("#flight") == "r0: metadata, abort_req"


def test_the_corrected_systems_trace_set_steps_through_every_trace(
    page: Any, tmp_path: Path, screenshot: Callable[[Any, str], Path]
) -> None:
    from kvfsm.testing.trace_set import trace_set

    out = tmp_path / "trace_set.html"
    drawn = kvfsm("inspect", "specs/pd_abort/corrected.yaml", "--trace-set", "--html", str(out))
    assert drawn.returncode == 0, drawn.stdout + drawn.stderr
    chosen = trace_set(ROOT / "specs/pd_abort/corrected.yaml")
    page.goto(out.as_uri())
    options = page.locator("#trace-choice option").all_inner_texts()
    assert [o.split(" · ")[:2] for o in options] == [
        [str(n), f"{len(t.moves)} move{'s' if len(t.moves) != 1 else ''}"] for n, t in enumerate(chosen.traces, 1)
    ]
    for k, (goal, trace) in enumerate(zip(chosen.goals, chosen.traces, strict=True)):
        if k == 1:
            page.select_option("#trace-choice", "1")  # the chooser...
        elif k:
            page.keyboard.press("PageDown" if k % 2 else "n")  # ...or its keys
        assert page.locator("#counter").get_attribute("data-trace") == str(k)
        assert page.locator("#counter").inner_text() == f"start / {len(trace.moves)}"
        assert goal.name in page.inner_text("#covers")
        for _ in trace.moves:
            page.keyboard.press("ArrowRight")
        assert page.locator("#counter").get_attribute("data-step") == str(len(trace.moves)), goal.name
        end = {s.role: (s.target, ", ".join(s.holds) or "nothing") for s in trace.steps}  # each role's last step
        assert {r: (cells[0], cells[1]) for r, cells in instances(page).items()} == end, goal.name
        assert current_nodes(page) == {f"{role}/{state}" for role, (state, _held) in end.items()}, goal.name
        shown = page.locator(f"#sequence .trace[data-trace='{k}']")
        assert shown.is_visible() and shown.locator(".row.current").get_attribute("data-step") == str(len(trace.moves))
        assert not page.locator("#violation").is_visible() and page.locator("#sequence .row.violation").count() == 0
        if goal.name == "prefill: transferring --abort_req--> draining":  # the corrected abort, acknowledged
            screenshot(page, "trace_set")
    page.keyboard.press("p")
    assert page.locator("#counter").get_attribute("data-trace") == str(len(chosen.traces) - 2)
    assert page.locator("#sequence .trace:visible").count() == 1
    page.goto("about:blank")
    page.goto(out.as_uri() + "#trace=2&step=1")  # the address names a trace and a move
    assert page.locator("#counter").get_attribute("data-trace") == "1"
    assert page.locator("#counter").get_attribute("data-step") == "1"


def test_the_html_file_opens_offline_and_fetches_nothing(browser_context: Any, trace_page: Path) -> None:
    attempted: list[str] = []

    def refuse(route: Any) -> None:
        url = route.request.url
        if url.startswith("file://"):
            route.continue_()
        else:
            attempted.append(url)
            route.abort("internetdisconnected")

    tab = browser_context.new_page()
    try:
        tab.route("**/*", refuse)
        seen: list[str] = []
        tab.on("request", lambda r: seen.append(r.url))
        tab.goto(trace_page.as_uri())
        tab.keyboard.press("End")
        tab.wait_for_load_state("networkidle")
        assert tab.locator("#counter").get_attribute("data-step") == "4"
        assert tab.locator("#diagram svg g.node").count() > 10  # the diagram is inline, not fetched
    finally:
        tab.close()
    assert attempted == []
    assert [u for u in seen if not u.startswith("file://")] == []


def test_findings_are_pinned_on_the_diagram(page: Any, tmp_path: Path, screenshot: Callable[[Any, str], Path]) -> None:
    out = tmp_path / "pre_fix.html"
    assert kvfsm("inspect", "specs/moriio/write_pre_fix.yaml", "--html", str(out)).returncode == 0
    page.goto(out.as_uri())
    pinned = page.eval_on_selector_all("#diagram g.node.finding", "gs => gs.map(g => g.dataset.state)")
    assert sorted(pinned) == ["producer/deferred", "producer/writing"]
    assert page.locator(".findings li").count() == 2
    page.click(".findings li[data-finding='1']")
    assert page.eval_on_selector_all("#diagram g.focus", "gs => gs.map(g => g.dataset.state)") == ["producer/writing"]
    assert "KVF107" in page.inner_text(".findings li.focus")
    assert not page.locator("#stepper").is_visible()  # no trace: no stepper
    screenshot(page, "findings")


def test_a_kvfsm_test_story_steps_to_where_the_driver_diverged(
    page: Any, tmp_path: Path, screenshot: Callable[[Any, str], Path]
) -> None:
    result, out = tmp_path / "run.json", tmp_path / "story.html"
    tested = subprocess.run(
        [*KVFSM, "test", "../specs/kv_request.yaml", "--driver", "buggy_drivers:SkipsDecOnPutError", "--seed", "4",
         "--format", "json"],
        cwd=ROOT / "tests", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert tested.returncode == 1, tested.stderr
    result.write_text(tested.stdout)
    assert kvfsm("inspect", "specs/kv_request.yaml", "--story", str(result), "--html", str(out)).returncode == 0
    page.goto(out.as_uri())
    assert page.locator("#counter").inner_text() == "start / 3" and instances(page) == {}
    page.keyboard.press("End")
    assert page.inner_text("#move").startswith("t=0.0 start req-1: start_transfer() raised (injected fault)")
    assert "✗ observe says gpu_blocks still held by req-1" in page.inner_text("#violation")
    assert instances(page) == {"req-1": ["failed", "nothing", "gpu_blocks (move 3), queue_slot (move 3)"]}
    assert current_nodes(page) == {"failed"}
    assert page.locator("#sequence .row.violation").get_attribute("data-step") == "3"
    screenshot(page, "story")
    page.keyboard.press("ArrowLeft")
    assert not page.locator("#violation").is_visible()
    assert instances(page) == {"req-1": ["queued", "gpu_blocks, queue_slot", ""]}
    assert current_nodes(page) == {"queued"}
    assert page.eval_on_selector_all("#diagram g.edge.taken", "gs => gs.map(g => g.dataset.edge)") == ["pinned->queued"]


def test_a_journal_steps_to_each_finding_of_kvfsm_replay(
    page: Any, tmp_path: Path, stalled: Path, screenshot: Callable[[Any, str], Path]
) -> None:
    out = tmp_path / "journal.html"
    assert kvfsm("inspect", "specs/kv_request.yaml", "--journal", str(stalled), "--html", str(out)).returncode == 0
    page.goto(out.as_uri())
    assert page.eval_on_selector_all("#sequence .head", "ts => ts.map(t => t.textContent)") == ["req-2", "req-3"]
    broken = [
        int(n) for n in page.eval_on_selector_all("#sequence .row.violation", "rs => rs.map(r => r.dataset.step)")
    ]
    assert broken == [4, 6]
    page.click("#sequence .row[data-step='4']")
    assert page.inner_text("#move") == "t=145.000 complete: transferring → done"
    assert "KVF310 key \"req-2\" stayed in 'transferring'" in page.inner_text("#violation")
    assert instances(page)["req-2"] == ["done", "nothing", "gpu_blocks (move 4), queue_slot (move 4)"]
    page.evaluate("window.scrollTo(0, 0)")  # the click scrolled to the row
    screenshot(page, "journal")
    page.keyboard.press("End")
    assert "KVF312" in page.inner_text("#violation") and current_nodes(page) == {"queued"}


def _serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``kvfsm inspect ARGS`` serving; its URL is the last word of its first line."""
    proc = subprocess.Popen(
        [*KVFSM, "inspect", *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
    if found is None:
        proc.kill()
        raise AssertionError(f"no URL in {line!r}: {proc.stderr.read() if proc.stderr else ''}")
    return proc, found.group(1)


def _stop(proc: subprocess.Popen[str]) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_served_page_is_the_same_and_ctrl_c_exits_130(page: Any, tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    kvfsm("explore", "specs/pd_abort/merged_fix.yaml", "--trace", str(trace))
    proc, url = _serve("specs/pd_abort/merged_fix.yaml", "--trace", str(trace))
    try:
        page.goto(url + "#step=4")
        assert page.locator("#counter").get_attribute("data-step") == "4"
        assert current_nodes(page) == {"prefill/transferring", "decode/aborted"}
        import urllib.error
        import urllib.request

        request = urllib.request.Request(url, headers={"Host": "attacker.example:80"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 421  # a DNS name rebound to loopback is not this server
    finally:
        assert _stop(proc) == 130


def _free_pair() -> int:
    """A port P with P+1 free too (kvfsm demo --metrics serves prefill on P, decode on P+1)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two free ports in a row")


def test_the_live_view_of_a_running_demo_changes(
    page: Any, tmp_path: Path, screenshot: Callable[[Any, str], Path]
) -> None:
    port = _free_pair()
    log = tmp_path / "demo.err"
    with log.open("w") as errors:  # a file, not a pipe: a pipe nobody drains would stall the demo
        demo = subprocess.Popen(
            [*KVFSM, "demo", "--requests", "100000", "--metrics", str(port)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    server = None
    try:
        deadline = time.monotonic() + 90
        while "state and metrics at" not in log.read_text() and demo.poll() is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        prefill, decode = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"
        server, url = _serve("--live", prefill, "--live", decode, "--interval", "0.3")
        page.goto(url)
        page.wait_for_selector(".tracker table")
        first, reads = _counts(page), _reads(page)
        changed, until = first, time.monotonic() + 30
        while changed == first and time.monotonic() < until:  # the page's own polls, not a reload
            time.sleep(0.3)
            changed = _counts(page)
        assert changed != first, f"the counts stayed {first}"
        assert _reads(page) > reads
        assert list(changed) == ["pd_prefill_corrected", "pd_decode_corrected"], changed  # both processes, one page
        endpoints = page.eval_on_selector_all(".tracker", "ts => ts.map(t => t.dataset.endpoint)")
        assert endpoints == [prefill, decode]
        screenshot(page, "live")
    finally:
        if server is not None:
            assert _stop(server) == 130
        demo.send_signal(signal.SIGINT)
        try:
            demo.wait(timeout=30)
        except subprocess.TimeoutExpired:
            demo.kill()


def _reads(tab: Any) -> int:
    return int(tab.locator("#live-status").get_attribute("data-reads") or 0)


def _counts(tab: Any) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for tracker in tab.locator(".tracker").all():
        name = tracker.get_attribute("data-tracker")
        out[name] = [c.inner_text() for c in tracker.locator("tr[data-state] td.count").all()]
    return out
