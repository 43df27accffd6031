"""What every protocol's module checks once its servers are closed: journals, leaks, divergences."""

from __future__ import annotations

from typing import Any

from kvfsm.replay import check_log
from kvfsm.spec.bundled import SPECS
from kvfsm.spec.system import load_system


def closed_clean(pair: Any, protocol: str) -> dict[str, Any]:
    """Close the pair; assert no page is held, no SGLang event was refused, and each journal replays clean."""
    summaries = pair.close()
    assert set(summaries) == {"decode", "prefill0", "prefill1"}
    for name, summary in summaries.items():
        assert summary["held_pages"] == 0, f"{name} still holds pages: {summary}"
        assert summary["refused"] == [], f"{name}: SGLang did what the spec refuses: {summary['refused']}"
        assert summary["live"] == 0, summary
    system = load_system(SPECS / "pd_abort" / f"{protocol}.yaml")
    for name, path in pair.journals.items():
        report = check_log(system.roles["decode" if name == "decode" else "prefill"].spec, path)
        assert report.conforms, [f.message for f in report.findings]
        assert report.instances > 0
    return summaries
