"""What ``kvfsm test`` and ``kvfsm replay`` found, read back onto the page at the step where it happened.

A failing story and a journal are one machine's run: many keys of one spec
over time, not one request across roles, so each key is its own lane and
there is no channel. The story comes from ``kvfsm test SPEC --format json``
(its ``failure.story`` and the transitions each line made,
``failure.moves``), the divergence shown at its last line; a journal's lines
are its transitions, each finding of :func:`kvfsm.replay.check_log` shown at
the line it names. A trace replayed on a system's drivers (``kvfsm test
SYSTEM --trace T --format json``) is the trace itself, with the step where
the drivers parted from it marked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec

from ..explore import Trace
from ..replay import Record, check_log
from ..replay.read import STOPS, log_lines
from ..spec import Finding, Spec, is_system_file, read
from ..testing.trace_replay import Mismatch
from .page import InspectError, Page, TraceView, build, drawn
from .steps import Moment, Moved, timeline

MAX_LANES = 8
"""Keys drawn side by side at most: a wider page is no longer read as one picture (``--key`` picks others)."""
MAX_ROWS = 2000
"""Journal lines stepped through at most (the page carries every snapshot)."""


def _spec_page(path: str | Path, option: str) -> tuple[Page, Spec]:
    if is_system_file(path):
        raise InspectError(f"{option} is one machine's run, and {path} is a system file: name the machine's spec")
    return drawn(path, [], option), read(path)


def build_story(path: str | Path, result: str | Path) -> Page:
    """The page of a spec with the story of a failing ``kvfsm test SPEC --format json`` run (``result``) stepped
    through, the divergence at the line where it happened."""
    page, spec = _spec_page(path, "--story")
    data = _json(result, "machine", "kvfsm test SPEC --format json")
    failure = data.get("failure")
    if data.get("machine") != spec.name:
        raise InspectError(
            f"{result} is a kvfsm test run of machine {data.get('machine')!r}, not {spec.name!r} ({path}); "
            "inspect it with the spec it tested"
        )
    if failure is None:
        raise InspectError(f"{result}: the run passed, so it has no story (kvfsm test tells one when a driver fails)")
    story, moves = failure.get("story"), failure.get("moves")
    if not _strings(story) or not isinstance(moves, list) or not all(isinstance(m, list) for m in moves):
        raise InspectError(
            f"{result}: failure.story or failure.moves is missing; write it with kvfsm test --format json"
        )
    problems = [str(p) for p in failure.get("problems") or ()] or [str(failure.get("error") or "")]
    told = "; " + "; ".join(problems)
    rows = []
    for n, line in enumerate(story, start=1):
        last = n == len(story)
        moved = tuple(_moved(m, result) for m in (moves[n - 1] if n <= len(moves) else ()))
        text = line.removesuffix(told) if last else line
        rows.append(Moment(text, moved, "; ".join(problems) if last else ""))
    keys = list(dict.fromkeys(m.key for r in rows for m in r.moves))
    view = TraceView(
        tuple(timeline(rows, spec.holds)), tuple(keys), "", "kvfsm test", problems[0], spec.name,
        channel=False, chart="\n".join(story), chart_from="kvfsm test",
        purpose=f"the story of seed {data.get('seed')}: {problems[0]}",
    )  # fmt: skip
    page.traces.append(view)
    page.title = f"kvfsm test story of {spec.name}"
    return page


def _json(path: str | Path, field: str, how: str) -> dict[str, Any]:
    """The JSON object in ``path``, which must have ``field`` (what ``how`` writes)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InspectError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InspectError(f"{path} is not JSON ({exc}); write it with {how} > FILE") from None
    if not isinstance(data, dict) or field not in data:
        raise InspectError(f"{path} has no '{field}': write it with {how} > FILE")
    return data


def _strings(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, str) for x in value)


def _moved(m: object, result: str | Path) -> Moved:
    if not isinstance(m, Mapping) or not all(isinstance(m.get(f), str) for f in ("key", "event", "from", "to")):
        raise InspectError(f"{result}: failure.moves holds {m!r}, not a move with key, event, from and to")
    return Moved(m["key"], m["event"], m["from"], m["to"])


def build_journal(path: str | Path, log: str | Path, keys: Sequence[str] = ()) -> Page:
    """The page of a spec with a journal's transitions stepped through, each ``kvfsm replay`` finding at its line.

    Shown are ``keys`` (as the journal writes them: ``req-7``, or JSON for a
    key that is no string), else the keys with findings, else every key; at
    most :data:`MAX_LANES` of them.
    """
    page, spec = _spec_page(path, "--journal")
    try:
        report = check_log(spec, log)
    except OSError as exc:
        raise InspectError(f"cannot read {log}: {exc.strerror or exc}") from None
    lines = list(_records(log))
    at: dict[int, list[Finding]] = {}
    for f in report.findings:
        at.setdefault(f.line, []).append(f)
    key_at = {n: k for n, k, _r in lines}
    seen = list(dict.fromkeys(k for _n, k, _r in lines))
    if keys:
        unknown = [k for k in keys if k not in seen]
        if unknown:
            shown = ", ".join(seen[:10]) + (", …" if len(seen) > 10 else "")
            raise InspectError(f"{log} has no transition of key {', '.join(unknown)} (its keys: {shown or 'none'})")
        chosen = list(dict.fromkeys(keys))
        if len(chosen) > MAX_LANES:
            raise InspectError(f"--key names {len(chosen)} keys; a page draws at most {MAX_LANES} side by side")
        what = "keys " + ", ".join(chosen)
    else:
        broken = list(dict.fromkeys(key_at[n] for n in at if n in key_at))
        chosen, what = (broken, "the keys with findings") if broken else (seen, "every key")
        if len(chosen) > MAX_LANES:
            which = "keys with findings" if broken else "keys"
            what = f"the first {MAX_LANES} of {len(chosen)} {which}; --key picks others"
            chosen = chosen[:MAX_LANES]
    rows = _journal_rows(lines, at, set(chosen), key_at)
    if len(rows) > MAX_ROWS:
        raise InspectError(
            f"{len(rows)} lines of keys {', '.join(chosen)}: more than {MAX_ROWS}; pick fewer with --key"
        )
    by_code = ", ".join(f"{n} {code}" for code, n in report.by_code.items())
    verdict = f"{report.total} finding(s) ({by_code})" if report.total else ""
    view = TraceView(
        tuple(timeline(rows, spec.holds)), tuple(chosen), "", "kvfsm replay", verdict, spec.name, channel=False,
        purpose=f"{log}: {what}, {verdict or 'conforms'}",
    )  # fmt: skip
    page.traces.append(view)
    page.title = f"journal {Path(log).name} of {spec.name}"
    return page


def _records(log: str | Path) -> Iterable[tuple[int, str, Record]]:
    """``(line, key as shown, record)`` per transition line; other lines are the checker's to report."""
    decode = msgspec.json.Decoder(Record).decode
    try:
        with log_lines(log) as lines:
            for n, raw in enumerate(lines, start=1):
                try:
                    record = decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                key = record.key if isinstance(record.key, str) else msgspec.json.encode(record.key).decode()
                yield n, key, record
    except STOPS:
        return  # where reading stopped is a KVF300/KVF302 finding at that line


def _journal_rows(
    lines: Sequence[tuple[int, str, Record]],
    at: Mapping[int, list[Finding]],
    chosen: set[str],
    key_at: Mapping[int, str],
) -> list[Moment]:
    """A row per transition of a chosen key, with the findings at its line; a finding at a line that is no
    transition (damage, the log's end) is a row of its own, where the log has it."""
    rows: list[tuple[int, Moment]] = []
    for n, key, r in lines:
        if key in chosen:
            moved = Moved(key, r.event, r.from_, r.to)
            rows.append((n, Moment(f"t={r.time:.3f} {moved}", (moved,), _told(at.get(n, ())))))
    for n, found in at.items():
        if n not in key_at:
            rows.append((n, Moment(f"line {n}", (), _told(found))))
    rows.sort(key=lambda nr: nr[0])
    return [r for _n, r in rows]


def _told(findings: Iterable[Finding]) -> str:
    return "; ".join(f"line {f.line}: {f.code} {f.message}" for f in findings)


def build_replayed(path: str | Path, trace: Trace, result: str | Path) -> Page:
    """The page of a system with ``trace`` stepped through and what replaying it on the drivers found (``result``,
    from ``kvfsm test SYSTEM --trace T --format json``) at its step: where they diverged, or that it reproduced."""
    data = _json(result, "trace_system", "kvfsm test SYSTEM --trace TRACE.json --format json")
    page = build(path, trace)
    if (data.get("trace_system"), data.get("property")) != (trace.system, trace.prop):
        raise InspectError(
            f"{result} replayed {data.get('property')!r} of {data.get('trace_system')!r}, not {trace.prop!r} of "
            f"{trace.system!r}: give the trace it replayed"
        )
    steps = data.get("steps")
    if not isinstance(steps, list) or len(steps) > len(trace.steps):
        raise InspectError(f"{result}: 'steps' is no list of at most the trace's {len(trace.steps)} steps")
    for n, (done, step) in enumerate(zip(steps, trace.steps, strict=False)):
        if not isinstance(done, Mapping) or done.get("step") != step.as_dict():
            raise InspectError(f"{result} replayed another trace: its step {n} differs from {trace.path}'s")
    (view,) = page.traces
    snaps = list(view.snaps)
    mismatch = data.get("mismatch")
    if isinstance(mismatch, Mapping) and isinstance(mismatch.get("index"), int):
        index = min(mismatch["index"], len(trace.steps) - 1)
        at = sum(1 for s in trace.steps[: index + 1] if s.action != "begin")  # begins are all in the start
        told = Mismatch(index, *(str(mismatch.get(f)) for f in ("label", "what", "expected", "actual")))
        snaps[at] = replace(snaps[at], violation=True, problem=f"the drivers diverged from the trace at {told}")
    page.traces[0] = replace(
        view, snaps=tuple(snaps), purpose=f"{data.get('verdict')} on the drivers: {data.get('summary')}"
    )
    page.title = f"{trace.prop} in {trace.system}, {data.get('verdict')} on the drivers"
    return page
