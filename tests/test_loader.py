"""The spec loader: every schema problem is a KVF001 finding with file, line, column and a fix.

Positions are asserted exactly; they are computed from the text (``_at``) rather
than counted by hand, so a test fails only when the loader points elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvfsm.spec as spec_api
from kvfsm.spec import Finding, SpecError, read, read_text
from kvfsm.spec.findings import READ_ERROR

ROOT = Path(__file__).resolve().parent.parent
CANONICAL = ROOT / "specs" / "kv_request.yaml"

BASE = """\
kvfsm: 1
machine: base
key: request_id
params:
  transfer_timeout: 30.0
resources:
  blocks: {release: free_blocks}
states:
  pinned:  {initial: true, holds: [blocks], waits: local}
  sending: {holds: [blocks], timeout: {after: transfer_timeout, fire: expire}}
  done:    {final: success}
  failed:  {final: failure}
transitions:
  - {event: send,     from: pinned,  to: sending}
  - {event: complete, from: sending, to: done}
  - {event: expire,   from: sending, to: failed}
  - {event: abort,    from: "*",     to: failed}
ignore:
  - {event: [abort], in: [done, failed]}
"""

STR_FORMAT = re.compile(
    r"^(?P<path>.+):(?P<line>\d+): (?P<message>.+) \((?P<code>KVF\d{3})\)\.(?: (?P<fix>.+))?$", re.S
)


def _variant(old: str, new: str, text: str = BASE) -> str:
    assert text.count(old) == 1, f"{old!r} must occur once in the base spec"
    return text.replace(old, new)


def _errors(text: str, path: str = "spec.yaml") -> list[Finding]:
    with pytest.raises(SpecError) as info:
        read_text(text, path)
    return list(info.value.findings)


def _only(text: str) -> Finding:
    findings = _errors(text)
    assert len(findings) == 1, [str(f) for f in findings]
    return findings[0]


def _at(text: str, needle: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, column) of the ``nth`` occurrence of ``needle`` in ``text``."""
    index = -1
    for _ in range(nth + 1):
        index = text.index(needle, index + 1)
    line = text.count("\n", 0, index) + 1
    col = index - (text.rfind("\n", 0, index) + 1) + 1
    return line, col


def _assert_at(finding: Finding, text: str, needle: str, nth: int = 0) -> None:
    assert (finding.line, finding.col) == _at(text, needle, nth), str(finding)


def test_base_spec_parses_and_is_clean() -> None:
    spec = read_text(BASE, "base.yaml")
    assert spec_api.run_checks(spec) == []


def test_canonical_spec_reads_with_every_section() -> None:
    spec = read(CANONICAL)
    assert spec.name == "kv_request"
    assert list(spec.states) == ["pinned", "queued", "transferring", "done", "failed", "aborted", "expired"]
    assert spec.resources["queue_slot"].acquire == "enqueue_job"
    assert spec.params == {"transfer_timeout": 30.0}
    assert spec.on_error == "fail"


# -- unknown keys ------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_closest_known_key() -> None:
    text = _variant("transitions:\n", "transition:\n")
    findings = _errors(text)
    unknown = [f for f in findings if "unknown key" in f.message]
    assert len(unknown) == 1
    f = unknown[0]
    assert f.code == "KVF001"
    assert "'transition'" in f.message
    assert "Did you mean 'transitions'?" in f.fix
    _assert_at(f, text, "transition:")
    # ... and, since the real key is now absent, that is reported in the same error.
    assert any("missing required key 'transitions'" in g.message for g in findings)


def test_unknown_key_without_a_close_match_lists_the_allowed_keys() -> None:
    text = _variant("key: request_id\n", "key: request_id\nzzz: 1\n")
    f = _only(text)
    assert "Did you mean" not in f.fix
    assert "Allowed keys: kvfsm, machine, doc, key" in f.fix
    _assert_at(f, text, "zzz")


@pytest.mark.parametrize(
    ("old", "new", "needle", "owner", "suggestion"),
    [
        ("{initial: true, holds: [blocks],", "{initial: true, hold: [blocks],", "hold:", "state 'pinned'", "holds"),
        ("{release: free_blocks}", "{release: free_blocks, aquire: pin}", "aquire", "resource 'blocks'", "acquire"),
        ("to: done}", "to: done, dO: x}", "dO:", "transition", "do"),
        ("fire: expire}}", "fire: expire, afterr: 3}}", "afterr", "state 'sending' timeout", "after"),
        ("in: [done, failed]}", "in: [done, failed], states: [done]}", "states: [done]", "ignore rule", None),
    ],
    ids=["state", "resource", "transition", "timeout", "ignore"],
)
def test_unknown_key_inside_a_section_is_reported_where_written(
    old: str, new: str, needle: str, owner: str, suggestion: str | None
) -> None:
    text = _variant(old, new)
    f = _only(text)
    assert f.code == "KVF001"
    assert f.message.startswith(f"{owner} has unknown key")
    _assert_at(f, text, needle)
    if suggestion:
        assert f"Did you mean {suggestion!r}?" in f.fix
    assert "Allowed keys:" in f.fix


# -- wrong types -------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "needle", "fragment"),
    [
        (
            "holds: [blocks], waits",
            "holds: 5, waits",
            "5, waits",
            "state 'pinned': holds must be a name, not the number 5",
        ),
        ("holds: [blocks], waits", "holds: {blocks: 0}, waits", "0}", "holds: blocks must be at least 1, not 0"),
        ("{initial: true,", '{initial: "yes",', '"yes"', "state 'pinned': initial must be true or false, not 'yes'"),
        ("{initial: true,", "{initial: 1,", "1,", "initial must be true or false"),
        ("transfer_timeout: 30.0", "transfer_timeout: soon", "soon", "param 'transfer_timeout' must be a number"),
        ("transfer_timeout: 30.0", 'transfer_timeout: "30"', '"30"', "param 'transfer_timeout' must be a number"),
        ("transfer_timeout: 30.0", "transfer_timeout: [30]", "[30]", "param 'transfer_timeout' must be a single value"),
        ("transfer_timeout: 30.0", "transfer_timeout: -5", "-5", "must be a finite, non-negative number"),
        ("transfer_timeout: 30.0", "transfer_timeout: .inf", ".inf", "must be a finite, non-negative number"),
        ("transfer_timeout: 30.0", "transfer_timeout: .nan", ".nan", "must be a finite, non-negative number"),
        ("transfer_timeout: 30.0", "transfer_timeout: !!int abc", "!!int", "must be a number, not the value 'abc'"),
        ("after: transfer_timeout", "after: -1.5", "-1.5", "state 'sending' timeout: after must be a finite"),
        ("after: transfer_timeout", "after: true", "true, fire", "timeout: after must be a number"),
        ("{final: success}", "{final: true}", "true}", "final must be 'success' or 'failure', not 'true'"),
        ("waits: local}", "waits: remote}", "remote", "waits must be 'local', not 'remote'"),
        ("from: pinned,", "from: {a: b},", "{a: b}", "transition source must be a name or a list of names"),
        ("to: sending}", "to: [sending]}", "[sending]", "transition target must be a single value, not a list"),
        ("to: done}", "to: 5}", "5}", "transition target must be a name, not the number 5"),
        ("machine: base", "machine: [base]", "[base]", "machine must be a single value, not a list"),
    ],
    ids=[
        *("holds-number", "holds-count-zero", "initial-string", "initial-number"),
        *("param-word", "param-quoted", "param-list", "param-negative", "param-inf", "param-nan", "param-bad-tag"),
        *("after-negative", "after-bool", "final-bool", "waits-remote"),
        *("from-mapping", "to-list", "to-number", "machine-list"),
    ],
)
def test_value_of_the_wrong_type_is_reported_at_the_value(old: str, new: str, needle: str, fragment: str) -> None:
    text = _variant(old, new)
    f = _only(text)
    assert f.code == "KVF001"
    assert fragment in f.message
    _assert_at(f, text, needle)


def test_section_of_the_wrong_shape_says_what_to_write() -> None:
    text = _variant("transitions:\n", "transitions: {send: pinned}\ntransitions_old:\n")
    findings = _errors(text)
    shape = next(f for f in findings if "transitions must be a list" in f.message)
    assert "'- {...}'" in shape.fix
    text = _variant("states:\n", "states: pinned\nstates_old:\n")
    shape = next(f for f in _errors(text) if f.message.startswith("states must be a mapping"))
    assert shape.message == "states must be a mapping, not the value 'pinned'"
    assert "one entry per name" in shape.fix


def test_holds_listing_a_resource_twice_is_an_error() -> None:
    # Holding a resource "twice" would acquire and release it twice.
    text = _variant("holds: [blocks], waits", "holds: [blocks, blocks], waits")
    f = _only(text)
    assert f.message == "state 'pinned': holds lists 'blocks' twice"
    _assert_at(f, text, "blocks", nth=3)


def test_empty_holds_list_means_holding_nothing() -> None:
    spec = read_text(_variant("{holds: [blocks], timeout", "{holds: [], timeout"))
    assert spec.states["sending"].holds == ()


def test_empty_source_list_is_an_error() -> None:
    text = _variant("from: pinned,", "from: [],")
    f = _only(text)
    assert f.message == "transition source is an empty list"
    _assert_at(f, text, "[],")


def test_state_written_with_no_body_is_a_plain_state() -> None:
    spec = read_text(_variant("  failed:  {final: failure}\n", "  failed:  {final: failure}\n  parked:\n"))
    parked = spec.states["parked"]
    assert (parked.initial, parked.final, parked.holds, parked.timeout) == (False, None, (), None)


# -- missing required keys ---------------------------------------------------


@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("kvfsm", "kvfsm: 1"),
        ("machine", "machine: <name>"),
        ("key", "key: request_id"),
        ("transitions", "transitions:"),
    ],
)
def test_missing_required_top_level_key_is_reported_at_the_spec_start(key: str, fix: str) -> None:
    sections = re.split(r"^(?=\S)", BASE, flags=re.M)  # one chunk per top-level key
    text = "".join(c for c in sections if not c.startswith(f"{key}:"))
    f = _only(text)
    assert f.message == f"the spec is missing required key {key!r}"
    assert fix in f.fix
    assert (f.line, f.col) == (1, 1)


def test_missing_states_is_reported_with_what_to_add() -> None:
    text = "kvfsm: 1\nmachine: m\nkey: k\ntransitions: []\n"
    f = _only(text)
    assert f.message == "the spec is missing required key 'states'"
    assert "initial and a final state" in f.fix


def test_resource_without_release_is_reported_at_its_name() -> None:
    text = _variant("  blocks: {release: free_blocks}\n", "  blocks:\n    acquire: pin_blocks\n")
    f = _only(text)
    assert f.message == "resource 'blocks' is missing required key 'release'"
    assert "release: <driver method>" in f.fix
    _assert_at(f, text, "blocks:")


@pytest.mark.parametrize("key", ["event", "from", "to"])
def test_transition_missing_a_required_key_is_reported(key: str) -> None:
    written = {"event": "event: complete, ", "from": "from: sending, ", "to": ", to: done"}[key]
    line = "  - {event: complete, from: sending, to: done}\n"
    text = _variant(line, line.replace(written, ""))
    f = _only(text)
    assert f.message == f"transition is missing required key {key!r}"
    assert "event: <name>, from:" in f.fix


def test_timeout_missing_fire_is_reported_at_the_timeout_key() -> None:
    text = _variant("timeout: {after: transfer_timeout, fire: expire}", "timeout: {after: transfer_timeout}")
    f = _only(text)
    assert f.message == "state 'sending' timeout is missing required key 'fire'"
    _assert_at(f, text, "timeout: {")


# -- schema version ----------------------------------------------------------


@pytest.mark.parametrize("written", ["2", "0", '"1"', "1.0", "one"])
def test_unsupported_schema_version_is_reported(written: str) -> None:
    text = _variant("kvfsm: 1\n", f"kvfsm: {written}\n")
    f = _only(text)
    assert f.message.startswith("unsupported schema version")
    assert f.fix == "This kvfsm reads schema version 1: write 'kvfsm: 1'."
    _assert_at(f, text, written)


# -- YAML syntax ---------------------------------------------------------------


def test_yaml_syntax_error_reports_line_and_column() -> None:
    text = _variant(
        "  - {event: complete, from: sending, to: done}\n", "  - {event: complete, from: sending, to: done\n"
    )
    f = _only(text)
    assert f.code == "KVF001"
    assert f.message.startswith("YAML syntax error:")
    assert f.line > 1 and f.col >= 1


def test_tab_indentation_is_a_syntax_error_at_the_tab() -> None:
    text = _variant("  done:    {final: success}\n", "\tdone:    {final: success}\n")
    f = _only(text)
    assert "'\\t'" in f.message
    _assert_at(f, text, "\tdone")


@pytest.mark.parametrize(
    ("new", "needle"),
    [
        ("from: *,     to: failed}", "*,"),
        ("from: [sending, *], to: failed}", "*]"),
    ],
)
def test_bare_wildcard_is_told_to_be_quoted(new: str, needle: str) -> None:
    text = _variant('from: "*",     to: failed}', new)
    f = _only(text)
    assert "bare *" in f.message
    assert 'write "*"' in f.fix
    _assert_at(f, text, needle)


def test_bare_wildcard_in_block_style_is_told_to_be_quoted() -> None:
    text = _variant(
        '  - {event: abort,    from: "*",     to: failed}\n', "  - event: abort\n    from: *\n    to: failed\n"
    )
    f = _only(text)
    assert 'write "*"' in f.fix
    _assert_at(f, text, "*\n")


def test_two_yaml_documents_are_an_error() -> None:
    f = _only(BASE + "---\nkvfsm: 1\n")
    assert "single document" in f.message


# -- duplicate keys -------------------------------------------------------------


def test_duplicate_top_level_key_is_reported_at_the_repeat() -> None:
    text = _variant("key: request_id\n", "key: request_id\nmachine: again\n")
    f = _only(text)
    assert f.message == "the spec repeats key 'machine'"
    _assert_at(f, text, "machine", nth=1)


def test_duplicate_state_name_is_reported_at_the_repeat() -> None:
    text = _variant("  failed:  {final: failure}\n", "  failed:  {final: failure}\n  done:    {final: failure}\n")
    f = _only(text)
    assert f.message == "states repeats key 'done'"
    _assert_at(f, text, "done:", nth=1)


def test_duplicate_key_inside_a_transition_is_reported() -> None:
    text = _variant("to: done}", "to: done, to: failed}")
    f = _only(text)
    assert f.message == "transition repeats key 'to'"
    _assert_at(f, text, "to: failed}")


# -- empty input, files ----------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "~\n"])
def test_empty_spec_says_how_to_start(text: str) -> None:
    f = _only(text)
    assert f.message == "the spec is empty"
    assert "kvfsm: 1" in f.fix


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "a list"), ("hello\n", "the value 'hello'")])
def test_spec_that_is_not_a_mapping_is_an_error(text: str, kind: str) -> None:
    assert _only(text).message == f"the spec must be a mapping, not {kind}"


def test_missing_file_is_a_read_error_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    findings = spec_api.check(path)
    assert [(f.code, f.path, f.message) for f in findings] == [(READ_ERROR, str(path), "no such spec file")]
    with pytest.raises(SpecError) as info:
        spec_api.load(path)
    assert info.value.findings[0].code == READ_ERROR


def test_directory_is_a_read_error(tmp_path: Path) -> None:
    (f,) = spec_api.check(tmp_path)
    assert f.code == READ_ERROR
    assert "directory" in f.message
    assert "glob" in f.fix


def test_file_that_is_not_utf8_is_a_read_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(BASE.replace("base", "b\xe4se").encode("latin-1"))
    (f,) = spec_api.check(path)
    assert f.code == READ_ERROR
    assert "UTF-8" in f.fix


def test_findings_from_a_file_name_that_file(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text(_variant("transitions:\n", "transitons:\n"), encoding="utf-8")
    findings = spec_api.check(path)
    assert findings and all(f.path == str(path) for f in findings)
    assert all(str(f).startswith(f"{path}:") for f in findings)


# -- names ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "needle", "what"),
    [
        ("machine: base", "machine: my-machine", "my-machine", "machine"),
        ("key: request_id", "key: request id", "request id", "key"),
        ("  done:    {final: success}", "  1st:    {final: success}", "1st", "state name"),
        ("event: send,", "event: send!,", "send!", "transition event"),
        ("to: sending}", "to: sending, do: start transfer}", "start transfer", "transition do"),
        ("{release: free_blocks}", "{release: free.blocks}", "free.blocks", "resource 'blocks': release"),
        ("  transfer_timeout: 30.0", "  transfer-timeout: 30.0", "transfer-timeout", "param name"),
    ],
)
def test_invalid_name_is_reported_with_the_naming_rule(old: str, new: str, needle: str, what: str) -> None:
    text = _variant(old, new)
    findings = [f for f in _errors(text) if "is not a valid name" in f.message]
    assert len(findings) == 1, [str(f) for f in _errors(text)]
    f = findings[0]
    assert f.message == f"{what} {needle!r} is not a valid name"
    assert "letters, digits and '_'" in f.fix
    _assert_at(f, text, needle)


def test_null_state_name_is_not_a_name() -> None:
    text = _variant("  done:    {final: success}", "  ~:    {final: success}")
    f = _only(text)
    assert f.message == "state name must be a name, not an empty value"


# -- several errors at once -------------------------------------------------------


def test_every_schema_error_in_a_file_is_reported_together_in_file_order() -> None:
    text = BASE
    text = _variant("machine: base", "machine: bad-name", text)
    text = _variant("transfer_timeout: 30.0", "transfer_timeout: -1", text)
    text = _variant("{release: free_blocks}", "{relase: free_blocks}", text)
    text = _variant("{initial: true,", "{initial: maybe,", text)
    text = _variant("to: done}", "to: done, on: x}", text)
    text = _variant("ignore:\n", "ignores:\n", text)
    findings = _errors(text)
    assert [f.code for f in findings] == ["KVF001"] * 7
    positions = [(f.line, f.col) for f in findings]
    assert positions == sorted(positions)
    expected = [
        _at(text, "bad-name"),
        _at(text, "-1"),
        _at(text, "blocks:"),  # 'release' is missing (it is misspelt) ...
        _at(text, "relase"),  # ... and the misspelling is an unknown key
        _at(text, "maybe"),
        _at(text, "on: x"),
        _at(text, "ignores"),
    ]
    assert positions == expected, [str(f) for f in findings]


def test_schema_errors_stop_before_the_static_checks() -> None:
    # The spec also has no initial state (KVF101), but the checks need a well-formed model first.
    text = _variant("{initial: true,", "{initial: maybe,")
    findings = _errors(text)
    assert {f.code for f in findings} == {"KVF001"}


# -- message form and robustness ---------------------------------------------------


def test_finding_reads_as_path_line_message_code_and_fix() -> None:
    f = _only(_variant("transitions:\n", "transitions: 5\n"))
    match = STR_FORMAT.match(str(f))
    assert match is not None, str(f)
    assert match["path"] == "spec.yaml"
    assert int(match["line"]) == f.line
    assert match["code"] == "KVF001"
    assert match["fix"] == f.fix
    assert f.as_dict()["col"] == f.col


def test_spec_error_message_lists_every_finding() -> None:
    with pytest.raises(SpecError) as info:
        read_text(_variant("machine: base", "machine: [x]\nzzz: 1"), "x.yaml")
    assert str(info.value).splitlines() == [str(f) for f in info.value.findings]
    assert len(info.value.findings) == 2


def test_state_and_resource_locations_are_their_names_in_block_style() -> None:
    text = "kvfsm: 1\nmachine: m\nkey: k\nresources:\n  blocks:\n    release: free\nstates:\n  a:\n    initial: true\n    holds: [blocks]\n    timeout:\n      after: 1\n      fire: go\n  b:\n    final: success\ntransitions:\n  - {event: go, from: a, to: b}\n"
    spec = read_text(text)
    assert (spec.states["a"].loc.line, spec.states["a"].loc.col) == _at(text, "a:")
    assert spec.states["b"].loc.line == _at(text, "b:")[0]
    assert spec.resources["blocks"].loc.line == _at(text, "blocks:")[0]
    timeout = spec.states["a"].timeout
    assert timeout is not None and timeout.loc.line == _at(text, "timeout:")[0]


_VOCAB = st.sampled_from(
    [
        *("kvfsm", "machine", "key", "states", "transitions", "resources", "params", "ignore", "on_error"),
        *("initial", "final", "holds", "waits", "timeout", "after", "fire", "event", "from", "to", "do", "in"),
        *("release", "acquire", "a", "b", "*", "local", "success", "1"),
    ]
)
_SCALARS = st.one_of(
    _VOCAB, st.integers(-3, 3), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=4)
)
_DOCS = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_VOCAB, inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(_VOCAB, _DOCS, max_size=8))
def test_arbitrary_yaml_gives_a_spec_or_findings_never_a_traceback(doc: dict[str, object]) -> None:
    text = yaml.safe_dump(doc)
    try:
        spec = read_text(text, "fuzz.yaml")
    except SpecError as exc:
        assert exc.findings and all(f.code == "KVF001" and f.line >= 1 for f in exc.findings)
        return
    assert isinstance(spec_api.run_checks(spec), list)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_mangled_canonical_spec_gives_findings_never_a_traceback(data: st.DataObject) -> None:
    lines = CANONICAL.read_text(encoding="utf-8").splitlines(keepends=True)
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        how = data.draw(st.sampled_from(["drop", "dup", "cut", "char"]))
        if how == "drop":
            del lines[i]
        elif how == "dup":
            lines.insert(i, lines[i])
        elif how == "cut":
            lines[i] = lines[i][: data.draw(st.integers(0, len(lines[i])))] + "\n"
        else:
            j = data.draw(st.integers(0, max(0, len(lines[i]) - 1)))
            lines[i] = lines[i][:j] + data.draw(st.sampled_from(list("*&:{}[]-'\"#\t "))) + lines[i][j + 1 :]
        if not lines:
            break
    try:
        spec = read_text("".join(lines), "mangled.yaml")
    except SpecError as exc:
        assert exc.findings
        return
    assert all(isinstance(f, Finding) for f in spec_api.run_checks(spec))


def test_a_system_file_read_as_a_machine_spec_gets_one_error_that_says_so() -> None:
    with pytest.raises(SpecError) as caught:
        read(ROOT / "specs" / "pd_abort" / "merged_fix.yaml")
    (finding,) = caught.value.findings
    assert finding.code == "KVF001" and "system file" in finding.message
    assert "kvfsm explore" in finding.fix


def test_nesting_too_deep_for_the_parser_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    findings = spec_api.check(deep)
    assert findings and all(f.code == "KVF001" for f in findings)
    assert any("nested too deeply" in f.message or "'a'" in f.message for f in findings)


def test_a_list_where_one_value_belongs_gets_a_fix() -> None:
    text = CANONICAL.read_text().replace("to: done}", "to: [done, failed]}", 1)
    with pytest.raises(SpecError) as caught:
        read_text(text, "t.yaml")
    assert any("single value" in f.message and f.fix for f in caught.value.findings)


def test_a_number_too_large_for_a_float_is_kvf001_not_an_internal_error() -> None:
    text = CANONICAL.read_text()
    huge = re.sub(r"transfer_timeout: [0-9.]+", "transfer_timeout: " + "9" * 400, text, count=1)
    finding = _only(huge)
    assert finding.code == "KVF001" and "out of range" in finding.message
