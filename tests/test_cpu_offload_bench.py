"""The offload benchmark runs end to end and reports what it measured (figures are not asserted: see benchmarks/)."""

from __future__ import annotations

import json

from kvfsm.showcase.bench import offload


def test_quick_run_measures_every_cell_and_every_call_and_renders_them() -> None:
    report = offload.run(quick=True)
    threads = sorted({r.threads for r in report.copies})
    assert report.primary_threads == threads[0]
    cells = sorted((r.threads, r.block_size, r.blocks, r.direction) for r in report.copies)
    assert cells == sorted(
        (t, bs, n, d) for t in threads for bs in (16, 64) for n in (1, 64) for d in ("offload", "load")
    )
    assert all(r.driver_gbps > 0 and r.contiguous_gbps > 0 and r.two_pass_gbps > 0 for r in report.copies)

    calls = [c.call for c in report.calls]
    assert calls[0] == "get_num_new_matched_tokens (hit)" and "request_finished (store)" in calls
    assert len(calls) == 7 and report.us_per_request > 0

    table = offload.format_table(report)
    assert f"target: driver >= 80% of contiguous for >= 64 blocks at {report.primary_threads} thread(s)" in table
    data = json.loads(json.dumps(report.as_dict()))
    assert data["target"]["blocks_at_least"] == 64 and len(data["copies"]) == len(report.copies)
