"""One exit-code contract for every `kvfsm` command, run in-process on good, bad, unusable and incomplete input.

0 clean; 1 findings or violation (with --strict, warnings too); 2 unusable input or usage; 3 incomplete.
Every `--format json` run prints one JSON document and nothing else on stdout. The table names every command
that `kvfsm --help` lists, so a new command without a row fails here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from buggy_drivers import PEER_SPEC
from drivers import recording_driver

import kvfsm
from kvfsm import Tracker
from kvfsm.cli import main
from kvfsm.observe import DebugServer

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
KV = str(SPECS / "kv_request.yaml")
CORRECTED = str(SPECS / "pd_abort" / "corrected.yaml")
MERGED_FIX = str(SPECS / "pd_abort" / "merged_fix.yaml")
RANKED = str(SPECS / "explore" / "nixl_mla.yaml")
WARNS = str(ROOT / "tests" / "specs" / "broken" / "kvf102_unreachable.yaml")
BROKEN = str(ROOT / "tests" / "specs" / "broken" / "kvf101_no_initial.yaml")
GOOD_DRIVER = "buggy_drivers:StoreSender"
BAD_DRIVER = "buggy_drivers:SkipsDecOnPutError"

PEER_RUN = ["--driver", "buggy_drivers:NeedsPeer", "--seed", "0", "--min-coverage", "0", "--examples", "20"]

HEAD = b'{"journal":1,"machine":"kv_request","pid":1,"opened":0.0}\n'
ILLEGAL = b'{"key":"b","generation":2,"event":"abort","from":"pinned","to":"done","time":2.5}\n'


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The files the rows name: {MISSING}, {MALFORMED}, {GOOD_LOG}, {BAD_LOG}, {OUT}, {TRACE}, {DIR}, {PEER}, {PAGE}."""
    d = tmp_path_factory.mktemp("contract")
    (d / "malformed.yaml").write_text("machine: [unclosed\n  states: {\n")
    (d / "good.jsonl").write_bytes(HEAD)
    begin = b'{"key":"b","generation":2,"event":"begin","from":"","to":"pinned","time":2.0}\n'
    (d / "bad.jsonl").write_bytes(HEAD + begin + ILLEGAL)
    (d / "trace.json").write_text("{}")
    (d / "peer.yaml").write_text(PEER_SPEC)  # NeedsPeer cannot take one edge: a gap a lowered bar lets pass
    return {
        "MISSING": str(d / "missing.yaml"),
        "MALFORMED": str(d / "malformed.yaml"),
        "GOOD_LOG": str(d / "good.jsonl"),
        "BAD_LOG": str(d / "bad.jsonl"),
        "OUT": str(d / "out.svg"),
        "TRACE": str(d / "trace.json"),
        "DIR": str(d / "out"),
        "PEER": str(d / "peer.yaml"),
        "PAGE": str(d / "page.html"),
    }


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    spec = kvfsm.load(KV)
    tracker = Tracker(spec, recording_driver(spec))
    tracker.begin("r")
    with DebugServer([tracker]) as server:
        yield server.url


Row = tuple[str, list[str], int]
"""(what it pins, argv with {NAME} placeholders, the exit status)."""

ROWS: list[Row] = [
    # check
    ("check clean", ["check", KV], 0),
    ("check clean json", ["check", KV, "--format", "json"], 0),
    ("check error finding", ["check", BROKEN, "--format", "json"], 1),
    ("check warning passes", ["check", WARNS], 0),
    ("check warning fails --strict", ["check", WARNS, "--strict", "--format", "json"], 1),
    ("check missing file", ["check", "{MISSING}"], 2),
    ("check malformed yaml: a KVF001 finding at its line", ["check", "{MALFORMED}", "--format", "json"], 1),
    ("check unknown option", ["check", KV, "--bogus"], 2),
    # diagram
    ("diagram clean", ["diagram", KV, "-f", "dot", "-o", "{OUT}"], 0),
    ("diagram missing file", ["diagram", "{MISSING}"], 2),
    ("diagram malformed yaml", ["diagram", "{MALFORMED}"], 2),
    ("diagram unknown format", ["diagram", KV, "-f", "nosuchformat"], 2),
    # explore
    ("explore verified", ["explore", CORRECTED, "-n", "1", "--format", "json"], 0),
    ("explore violated", ["explore", MERGED_FIX, "-n", "1", "--format", "json"], 1),
    ("explore incomplete", ["explore", CORRECTED, "-n", "2", "--max-states", "5", "--format", "json"], 3),
    ("explore a machine spec", ["explore", KV], 2),
    ("explore missing file", ["explore", "{MISSING}"], 2),
    ("explore bad bound", ["explore", CORRECTED, "--max-states", "zero"], 2),
    ("explore search option with --promela", ["explore", CORRECTED, "--promela", "{OUT}", "--first"], 2),
    # test
    ("test passes", ["test", KV, "--driver", GOOD_DRIVER, "--seed", "0", "--examples", "20", "--format", "json"], 0),
    ("test diverges", ["test", KV, "--driver", BAD_DRIVER, "--seed", "0", "--examples", "20", "--format", "json"], 1),
    ("test gap under a lowered bar passes", ["test", "{PEER}", *PEER_RUN], 0),
    ("test gap under a lowered bar fails --strict", ["test", "{PEER}", *PEER_RUN, "--strict"], 1),
    ("test spec failing its checks", ["test", BROKEN, "--driver", GOOD_DRIVER], 2),
    ("test missing spec", ["test", "{MISSING}", "--driver", GOOD_DRIVER], 2),
    ("test missing driver module", ["test", KV, "--driver", "no_such_module:make"], 2),
    ("test --trace option on a machine spec", ["test", KV, "--driver", GOOD_DRIVER, "--trace", "{TRACE}"], 2),
    ("test system option on --trace", ["test", CORRECTED, "--trace", "{TRACE}", "--examples", "5"], 2),
    ("test --trace with a file that is no trace", ["test", RANKED, "--trace", "{TRACE}"], 2),
    ("test unknown option", ["test", KV, "--bogus"], 2),
    # replay
    ("replay conforms", ["replay", KV, "{GOOD_LOG}", "--format", "json"], 0),
    ("replay illegal transition", ["replay", KV, "{BAD_LOG}", "--format", "json"], 1),
    ("replay missing log", ["replay", KV, "{MISSING}"], 2),
    ("replay malformed spec", ["replay", "{MALFORMED}", "{GOOD_LOG}"], 2),
    ("replay bad --max", ["replay", KV, "{GOOD_LOG}", "--max", "nosuch=1"], 2),
    # top
    ("top once json", ["top", "{URL}", "--once", "--format", "json"], 0),
    ("top bad interval", ["top", "{URL}", "--interval", "0"], 2),
    ("top --count given to --once", ["top", "{URL}", "--once", "--count", "2"], 2),
    ("top unreachable", ["top", "http://127.0.0.1:9/", "--once"], 2),
    # inspect: written to a file (serving runs until Ctrl-C: tests/inspect pins its 130)
    ("inspect a spec written", ["inspect", KV, "--html", "{PAGE}"], 0),
    ("inspect a spec with findings written", ["inspect", WARNS, "--html", "{PAGE}"], 0),
    ("inspect nothing named", ["inspect", "--html", "{PAGE}"], 2),
    ("inspect missing file", ["inspect", "{MISSING}", "--html", "{PAGE}"], 2),
    ("inspect --port given to --html", ["inspect", KV, "--html", "{PAGE}", "--port", "8000"], 2),
    ("inspect --trace given to a machine spec", ["inspect", KV, "--trace", "{TRACE}", "--html", "{PAGE}"], 2),
    ("inspect a system's trace set written", ["inspect", CORRECTED, "--trace-set", "--html", "{PAGE}"], 0),
    ("inspect --trace-set given to a machine spec", ["inspect", KV, "--trace-set", "--html", "{PAGE}"], 2),
    ("inspect --trace given to --trace-set", ["inspect", CORRECTED, "--trace-set", "--trace", "{TRACE}"], 2),
    ("inspect --trace-set given to --live", ["inspect", "--live", "http://127.0.0.1:9/", "--trace-set"], 2),
    ("inspect a ranked system's trace set written", ["inspect", RANKED, "--trace-set", "--html", "{PAGE}"], 0),
    # demo: the tour's check part alone (seconds); the job and bench take minutes: their usage paths are pinned
    ("demo tour check part json", ["demo", "--only", "check", "--format", "json", "--out", "{DIR}"], 0),
    ("demo job option given to the tour", ["demo", "--tour", "--requests", "5"], 2),
    ("demo tour option given to the job", ["demo", "--out", "{DIR}"], 2),
    ("demo MoRIIO option given to the pd job", ["demo", "--mode", "read"], 2),
    ("demo embedded driver given to the engines", ["demo", "--engine", "vllm", "--driver", "moriio"], 2),
    ("demo job size given to the engines", ["demo", "--engine", "vllm", "--requests", "5"], 2),
    ("demo unknown option", ["demo", "--bogus"], 2),
    ("demo bad fault rate", ["demo", "--fault-rate", "7", "--requests", "1"], 2),
    ("bench unknown option", ["bench", "--bogus"], 2),
    # the top-level parser
    ("no command", [], 2),
    ("unknown command", ["nosuchcommand"], 2),
]


def commands() -> set[str]:
    """The commands `kvfsm --help` lists (each on a line of its own, indented, before its help)."""
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        main(["--help"])
    listed = set(re.findall(r"^    ([a-z]+)\s", text.getvalue(), re.MULTILINE))
    assert listed, text.getvalue()
    return listed


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code if isinstance(exc.code, int) else 2
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_every_command_listed_has_rows() -> None:
    covered = {argv[0] for _what, argv, _code in ROWS if argv}
    assert commands() <= covered, f"commands with no row: {commands() - covered}"


@pytest.mark.parametrize(("what", "argv", "code"), ROWS, ids=[r[0] for r in ROWS])
def test_exit_status_and_pure_json(
    what: str,
    argv: list[str],
    code: int,
    files: dict[str, str],
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be left in the working directory (.hypothesis/, out/)
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    names: dict[str, str] = dict(files)
    if any("{URL}" in a for a in argv):
        names["URL"] = request.getfixturevalue("endpoint")
    args = [a.format(**names) if "{" in a else a for a in argv]
    status, out, err = run(args, capsys)
    assert status == code, f"{what}: exit {status}, not {code}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    if "json" in args and status in (0, 1, 3):
        json.loads(out)  # the whole of stdout is the one document: anything else beside it fails to parse
    if status == 2:
        assert "Traceback" not in out + err and "internal error" not in err, err
    assert not (tmp_path / ".hypothesis").exists(), f"{what} left .hypothesis/ in the working directory"


def test_help_states_the_contract(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--help"], *([c, "--help"] for c in sorted(commands()))):
        with pytest.raises(SystemExit):
            main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "2 unusable input or usage" in text and "3 incomplete" in text, argv


def test_unchecked_explore_in_json_keeps_stdout_pure(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`--unchecked --format json` used to print the role's check errors on stdout before the document."""
    status, out, _err = run(["explore", MERGED_FIX, "-n", "1", "--unchecked", "--format", "json"], capsys)
    assert status == 1
    json.loads(out)


@pytest.mark.parametrize("seed", ["0", "7"])
def test_kvfsm_test_runs_exactly_the_examples_asked_for(
    seed: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hypothesis counts valid examples only; the run used to go past --examples (100 asked, 143 ran)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    argv = ["test", KV, "--driver", GOOD_DRIVER, "--seed", seed, "--examples", "40", "--format", "json"]
    status, out, _err = run(argv, capsys)
    doc = json.loads(out)
    assert status == 0 and doc["examples"] == 40 and doc["coverage"]["examples"] == 40


def test_a_trace_of_a_system_with_ranks_is_replayed_one_tracker_per_rank(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It once failed with "internal error KeyError: 'decode#0'", then was refused; each rank now has its tracker."""
    system, trace = str(SPECS / "explore" / "nixl_mla_reversed.yaml"), str(tmp_path / "t.json")
    assert run(["explore", system, "--trace", trace], capsys)[0] == 1
    status, out, err = run(["test", system, "--trace", trace, "--format", "json"], capsys)
    doc = json.loads(out)
    assert status == 0 and doc["verdict"] == "reproduced" and doc["property"] == "read_after_free", err
    assert {s["step"]["role"] for s in doc["steps"]} >= {"prefill#0", "prefill#1"}
