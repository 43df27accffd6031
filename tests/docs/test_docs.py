"""Every fenced block of README.md and docs/*.md runs as written, and says what it really prints.

Run with ``pytest --run-docs tests/docs`` (``./dev.sh test`` does, as its own step). One test per
block, named ``FILE:LINE``. What each kind of block must do:

- **python**: run as a script from a scratch copy of the clone (``specs/`` and the rest are links
  into it, so files a block writes land in the scratch directory, removed at the end). A block
  that names something only the prose defines gets a few lines in ``GIVEN`` below, run before it;
  ``THEN`` checks what a block's comments claim.
- **commands** (untagged or ``bash`` blocks whose lines start ``kvfsm``, ``python``, ``pytest``,
  ``./dev.sh``, ``spin``, ``$ ``...): each command runs as written under bash, with ``.venv/bin``
  first on PATH, and must exit 0 unless the doc says otherwise (``exit N`` below). Under a ``$ cmd``
  line, the lines up to the next ``$`` are that command's output.
- **output**: an untagged block right after a command block (nothing but blank lines and
  directives between) is the last command's output. The real output must contain every documented
  line, in order, after ``normalise``: whitespace and rich's table rules collapsed; durations,
  rates, addresses and scratch paths masked. A doc line may wrap where the command's does not; ``...`` or ``…`` in a doc
  line, or a doc line that is only one, skips whatever the command printed there.
- **synopsis** (``kvfsm SUB [--option ...]`` usage lines): every ``--option`` is in ``kvfsm SUB --help``.
- **yaml**: parsed; a block with ``kvfsm: 1`` and ``machine:`` is a whole spec and passes
  ``kvfsm check``; with ``from PATH`` it must be contained in that file (every key and value it
  shows, list items matched in any order), and that file passes ``kvfsm check``.
- **json**, **toml**: parsed.
- **text**: diagrams, logs and tables no command here prints; the layout block's paths must exist.

Directives: an HTML comment on the lines before a fence (invisible when rendered),
``<!-- doctest: D; D -->``, with D one of
  ``continues``   run in the same scratch directory after the block of this doc that precedes it
                  (python blocks of one chain run as one script, sharing names);
  ``cwd tests``   run the commands from ``tests/`` of the scratch copy;
  ``exit N...``   the expected exit status of each command, in order (one N: of every command);
  ``output of: CMD``  the block is what CMD prints (CMD run as a command block would be);
  ``vary``        the output's numbers differ from run to run (processes, threads): all masked;
  ``from PATH``   the yaml block is (part of) the bundled file PATH;
  ``file NAME``   the block is the text of file NAME, written into the scratch directory for the
                  blocks that continue it.

A directive's value cannot hold a ``;``. ``EXEMPT`` lists the blocks that cannot run here, each
with why; the doc says so too, once. Blocks that need vLLM skip where it is not installed
(``KVFSM_NO_VLLM=1``).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_BIN = Path(sys.executable).parent
WORKERS = 3  # the 2-core CI machine: most blocks wait on a subprocess's start-up
TIMEOUT_S = 240

# (file, a snippet of the block) -> why it does not run here. The default is that a block runs.
EXEMPT: dict[tuple[str, str], str] = {
    ("README.md", "./dev.sh test"): "./dev.sh test is the CI run this test is a step of; ./dev.sh demo is kvfsm demo, "
    "whose ledger docs/demo.md runs",
    ("README.md", "pip install kvfsm"): "installs from PyPI (a network); tests/test_packaging.py installs the wheel",
    ("docs/vllm.md", "pip install torch"): "./dev.sh setup and pip install into the venv from PyPI (a network)",
    ("docs/vllm.md", "pypi.org/simple"): "downloads vLLM's sdist from PyPI (a network)",
    ("docs/vllm.md", "vllm serve MODEL"): "starts vLLM's OpenAI server, which serves until stopped",
    ("docs/vllm.md", "api_server --model tiny"): "starts vLLM's OpenAI server, which serves until stopped",
    ("docs/demo.md", "kvfsm demo --engine vllm:"): "seven phases of real vLLM engines: about 100 s alone, past 4 "
    "minutes on a loaded 2-core machine (tests/engine runs each phase)",
    ("docs/cpu_offload.md", "pytest tests/test_sim.py --run-slow"): "the 30,000-request soak: minutes on two cores "
    "(./dev.sh test runs tests/test_sim.py without it)",
    ("docs/sglang.md", "./dev.sh test"): "./dev.sh test is the CI run this test is a step of; the soak takes hours",
    ("docs/moriio.md", "python benchmarks/moriio_soak.py"): "soaks of thousands of requests on real TransferEngines: "
    "minutes each (tests/test_moriio.py runs the same runners small)",
    ("docs/moriio.md", "python -m kvfsm.showcase.engine.pd MODEL"): "MODEL is yours: two vLLM engines serving it for "
    "minutes (tests/engine runs the pair on a tiny model)",
    ("docs/mooncake.md", 'connect("127.0.0.1:50051")'): "needs a mooncake_master on 127.0.0.1:50051 and an engine's "
    "KV tensors (tests/test_mooncake_store.py drives the worker on a real master)",
    ("docs/mooncake.md", "KVFSM_MOONCAKE_MASTER="): "needs a mooncake_master on 127.0.0.1:50051 "
    "(tests/test_mooncake_model.py starts one)",
    (
        "docs/nixl.md",
        'NixlAgent(f"prefill-{rank}")',
    ): "a sketch of an engine's calls: rank, block_bytes, peer_infos and "
    "the blocks are the engine's (tests/test_nixl_real.py runs them on real agents)",
    ("docs/inspect.md", "kvfsm inspect --live http://127.0.0.1:9400"): "both serve a page until Ctrl-C "
    "(tests/inspect/test_browser.py serves each and stops it: exit 130)",
    ("docs/watch.md", "/var/log/kvfsm/vllm_send-10368.jsonl"): "the journal a watched vLLM deployment writes "
    "(tests/test_watch_vllm.py replays the one its run writes)",
}

RECORDER = """
class Recorder:  # a driver with every method a spec may name: each call is recorded, none raises
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **_kw: self.calls.append((name, args))


"""
VLLM_CONFIG = "from vllm.config import KVTransferConfig\n"
BUGGY_DRIVERS = "import sys\nsys.path.insert(0, 'tests')\nfrom buggy_drivers import StoreSender as make_sender\n"

# (file, a snippet of the block) -> python run before it, for the names only the prose defines.
GIVEN: dict[tuple[str, str], str] = {
    ("README.md", 'tracker.begin("req-1")'): RECORDER + "driver = Recorder()\n",
    ("docs/guide.md", "tracker.begin(req_id)"): RECORDER
    + 'import kvfsm\nspec = kvfsm.load("specs/kv_request.yaml")\ndriver = Recorder()\nreq_id = "req-1"\n',
    ("docs/guide.md", "@kvfsm.batch"): "import kvfsm\n",
    ("docs/guide.md", "remote_request_id=meta.remote_request_id"): RECORDER
    + "import types\nimport kvfsm\n"
    + 'tracker = kvfsm.Tracker(kvfsm.load("specs/nixl_decode.yaml"), Recorder())\n'
    + 'meta = types.SimpleNamespace(remote_request_id="p-1")\nlocal_id, notif_id = "d-1", "p-1"\n',
    ("docs/guide.md", "prefill.deliver_many"): RECORDER
    + 'import kvfsm\nprefill = kvfsm.Tracker(kvfsm.load("specs/nixl_prefill.yaml"), Recorder())\n'
    + 'request_ids, agent_name, tp_ratio = ["p-1"], "decode-0", 2\nprefill.begin("p-1", block_ids=[0])\n',
    ("docs/nixl.md", "KVTransferConfig(kv_connector="): VLLM_CONFIG,
    ("docs/vllm.md", "KVTransferConfig(kv_connector="): VLLM_CONFIG,
    ("docs/vllm.md", 'kv_connector="MooncakeStoreConnector"'): VLLM_CONFIG,
    ("docs/testing.md", "spec_tests("): BUGGY_DRIVERS,
    ("docs/testing.md", "spec_machine("): BUGGY_DRIVERS,
}

# (file, a snippet of the block) -> python run after it: what its comments say, checked.
THEN: dict[tuple[str, str], str] = {
    ("README.md", 'tracker.begin("req-1")'): (
        "\nassert [name for name, _ in driver.calls] == "
        '["enqueue_job", "start_transfer", "free_gpu_blocks", "task_done"], driver.calls\n'
        'assert tracker.state("req-1") is None and tracker.live() == 0  # done, and drained by finished()\n'
    ),
    ("docs/testing.md", "spec_machine("): (  # as written, at the smallest size: 500 examples are a campaign
        "\nTestSender.settings = settings(max_examples=50, deadline=None)\nTestSender().runTest()\n"
        "TestSenderPool().runTest()\n"
    ),
}

COMMANDS = ("kvfsm", "python", "pytest", "./dev.sh", "spin", "pip", "curl", "vllm", "grep", "echo", "export", ".venv/")


@dataclass
class Block:
    path: str  # relative to the clone
    line: int  # of the opening fence
    lang: str
    text: str
    directives: dict[str, str]
    after_command: bool  # only blank lines and directives since the previous block, a command block
    kind: str = ""
    commands: list[str] = field(default_factory=list)
    outputs: list[str | None] = field(default_factory=list)  # documented output per command

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def _directives(lines: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in lines:
        for m in re.finditer(r"<!--\s*doctest:(.*?)-->", line):
            for part in m.group(1).split(";"):
                name, _, value = part.strip().partition(" ")
                if name == "output" and value.startswith("of:"):
                    name, value = "output of:", value[3:]
                if name:
                    found[name] = value.strip()
    return found


def extract(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i, since = 0, 0
    while i < len(lines):
        m = re.match(r"^(\s*)(```+)\s*([\w+-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
        between = lines[since:i]
        prose = [ln for ln in between if ln.strip() and not re.fullmatch(r"\s*<!--.*-->\s*", ln)]
        directive_lines = []
        for ln in reversed(between):
            if not ln.strip() or re.fullmatch(r"\s*<!--.*-->\s*", ln):
                directive_lines.append(ln)
            else:
                break
        after = bool(blocks) and not prose and blocks[-1].kind == "commands"
        block = Block(
            str(path.relative_to(ROOT)), i + 1, lang, "\n".join(body) + "\n", _directives(directive_lines), after
        )
        classify(block)
        blocks.append(block)
        i = since = j + 1
    return blocks


def _is_command(line: str) -> bool:
    words = [w for w in line.split() if w != "\\"]
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    return bool(words) and words[0].startswith(COMMANDS)


def _is_synopsis(text: str) -> bool:
    return bool(re.search(r"\[--|\b(SPEC|SYSTEM|LOG|URL)\b", text)) and text.lstrip().startswith("kvfsm ")


def classify(block: Block) -> None:
    text, lang = block.text, block.lang
    if lang == "python":
        block.kind = "python"
    elif lang == "yaml":
        block.kind = "yaml"
    elif lang in ("json", "toml"):
        block.kind = lang
    elif lang not in ("", "bash", "text", "console"):
        block.kind = "text"
    elif _is_synopsis(text):
        block.kind = "synopsis"
    elif "output of:" in block.directives or (block.after_command and lang == ""):
        block.kind = "output"
    elif text.lstrip().startswith("$ "):
        block.kind = "commands"
        for line in text.splitlines():
            if line.startswith("$ "):
                block.commands.append(line[2:])
                block.outputs.append(None)
            elif block.commands and block.commands[-1].endswith("\\"):
                block.commands[-1] += "\n" + line
            elif block.commands:
                block.outputs[-1] = (block.outputs[-1] or "") + line + "\n"
    elif text.strip() and all(_is_command(ln) for ln in _logical_lines(text)):
        block.kind = "commands"
        block.commands = _logical_lines(text)
        block.outputs = [None] * len(block.commands)
    else:
        block.kind = "text"


def _logical_lines(text: str) -> list[str]:
    """Shell lines, a trailing backslash joining the next; comments and blank lines dropped."""
    out: list[str] = []
    for line in text.splitlines():
        if out and out[-1].endswith("\\"):
            out[-1] += "\n" + line
        elif line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


ALL = [b for doc in DOCS for b in extract(doc)]


def _needs_vllm(block: Block) -> bool:
    text = _given(block) + block.text + block.directives.get("output of:", "")
    return "from vllm" in text or "--engine vllm" in text


def _exempt(block: Block) -> str | None:
    for (path, snippet), why in EXEMPT.items():
        if path == block.path and snippet in block.text:
            return why
    return None


def _given(block: Block, table: dict[tuple[str, str], str] | None = None) -> str:
    table = GIVEN if table is None else table
    return "".join(code for (path, snippet), code in table.items() if path == block.path and snippet in block.text)


# ---- running --------------------------------------------------------------------------------------


# What a clone has at its top (and the venv): not out/, .hypothesis/ or caches, which commands write.
CLONE = [n for n in subprocess.run(["git", "ls-tree", "--name-only", "HEAD"], cwd=ROOT, capture_output=True,
         text=True, check=True).stdout.split() if n != "tests"] + [".venv"]  # fmt: skip
_scratch_root: list[Path] = []  # made by the first scratch(), removed at exit
_scratch_lock = threading.Lock()


def scratch() -> Path:
    """A scratch copy of the clone: a link per top-level entry, tests/ a directory of links, so
    whatever a command writes (relative paths, .hypothesis/, t.json) stays out of the repo."""
    with _scratch_lock:
        if not _scratch_root:
            _scratch_root.append(Path(tempfile.mkdtemp(prefix="kvfsm-docs-")))
            atexit.register(shutil.rmtree, _scratch_root[0], True)  # links are unlinked, never followed
    where = Path(tempfile.mkdtemp(dir=_scratch_root[0]))
    for name in CLONE:
        (where / name).symlink_to(ROOT / name)
    (where / "tests").mkdir()
    for entry in (ROOT / "tests").iterdir():
        if entry.name not in ("__pycache__", ".hypothesis"):
            (where / "tests" / entry.name).symlink_to(entry)
    return where


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(COLUMNS="160", TERM="dumb", NO_COLOR="1", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    env.pop("FORCE_COLOR", None)
    return env


@dataclass
class Run:
    command: str
    status: int
    output: str
    seconds: float = 0.0


TIMES: dict[str, float] = {}  # block id -> seconds its job took (conftest.py prints the slowest)


def _run(command: str, cwd: Path, extra: dict[str, str] | None = None) -> Run:
    start = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", "-c", command], cwd=cwd, env=_env(extra), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return Run(command, -1, out + f"\n(timed out after {TIMEOUT_S} s)", TIMEOUT_S)
    return Run(command, done.returncode, done.stdout + done.stderr, time.monotonic() - start)


def _chain(block: Block) -> list[Block]:
    """The block and the blocks of its doc it continues, in order."""
    doc = [b for b in ALL if b.path == block.path]
    chain = [block]
    while "continues" in chain[0].directives:
        earlier = [
            b for b in doc if b.line < chain[0].line and (b.kind in ("python", "commands") or "file" in b.directives)
        ]
        if not earlier:
            break
        chain.insert(0, earlier[-1])
    return chain


def execute(block: Block) -> list[Run]:
    """Run the block (after what it continues) in a scratch copy; the runs of the block itself."""
    start = time.monotonic()
    try:
        return _execute(block)
    finally:
        TIMES[block.id] = time.monotonic() - start


def _execute(block: Block) -> list[Run]:
    where = scratch()
    runs: list[Run] = []
    chain = _chain(block)
    script: list[str] = []
    exported: dict[str, str] = {}
    for at, member in enumerate(chain):
        runs = []
        if "file" in member.directives:
            (where / member.directives["file"]).write_text(member.text)
        elif member.kind == "python":
            script.append(_given(member) + member.text + _given(member, THEN))
            if member is not block and chain[at + 1].kind == "python":
                continue  # one script with the python blocks after it
            (where / "_doc_block.py").write_text("\n".join(script))
            runs.append(_run(f"python _doc_block.py  # {member.id}", where, exported))
            script = []
            if member is not block and runs[0].status != 0:
                raise AssertionError(f"{member.id}, which {block.id} continues, failed:\n{runs[0].output[-3000:]}")
        else:
            cwd = where / "tests" if member.directives.get("cwd") == "tests" else where
            for command in member.commands:
                if command.startswith("export "):
                    exported.update(a.partition("=")[::2] for a in shlex.split(command)[1:] if "=" in a)
                runs.append(_run(command, cwd, exported))
            if member is not block and [r.status for r in runs] != _expected(member, len(runs)):
                raise AssertionError(f"{member.id}, which {block.id} continues, failed:\n{runs[-1].output[-3000:]}")
    return runs


def _expected(block: Block, count: int) -> list[int]:
    codes = [int(c) for c in block.directives.get("exit", "0").split()]
    return codes * count if len(codes) == 1 else codes


_pool = ThreadPoolExecutor(WORKERS)
_futures: dict[str, Future[list[Run]]] = {}


def _submit_all() -> None:
    if _futures:
        return
    shared = [b for b in ALL if _shares_vllm(b)]
    if shared and importlib.util.find_spec("vllm") is not None:
        _submit_shared(shared)  # first: the longest job
    for block in ALL:
        if _needs_vllm(block) and importlib.util.find_spec("vllm") is None:
            continue
        if block in shared:
            continue
        if _exempt(block) is None and block.kind in ("python", "commands"):
            _futures[block.id] = _pool.submit(execute, block)
        elif block.kind == "output" and "output of:" in block.directives and _exempt(block) is None:
            holder = Block(block.path, block.line, "", "", {}, False, "commands", [block.directives["output of:"]])
            holder.directives = {k: v for k, v in block.directives.items() if k in ("cwd", "exit")}
            _futures[block.id] = _pool.submit(execute, holder)


def _submit_shared(shared: list[Block]) -> None:
    picks: dict[str, Future[list[Run]]] = {b.id: Future() for b in shared}
    _futures.update(picks)

    def hand_out(batch: Future[list[Run]]) -> None:
        error = batch.exception()
        for at, block in enumerate(shared):
            if error is not None:
                picks[block.id].set_exception(error)
            else:
                picks[block.id].set_result([batch.result()[at]])

    _pool.submit(execute_shared, shared).add_done_callback(hand_out)


def _shares_vllm(block: Block) -> bool:
    """A python block that only imports vLLM (a config): run with the others in one interpreter,
    each in a namespace of its own, since importing vLLM costs half a minute a process."""
    return (
        block.kind == "python"
        and _needs_vllm(block)
        and _exempt(block) is None
        and "continues" not in block.directives
        and "__main__" not in block.text
    )


_SHARED_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
results = []
for name in sys.argv[1:]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(name, run_name="__doc_block__")
        results.append([0, out.getvalue()])
    except BaseException:
        results.append([1, out.getvalue() + traceback.format_exc()])
json.dump(results, open("_results.json", "w"))
"""


def execute_shared(blocks: list[Block]) -> list[Run]:
    """Run independent python blocks in one interpreter, one namespace each; a run per block."""
    start = time.monotonic()
    where = scratch()
    names = []
    for at, block in enumerate(blocks):
        names.append(f"_doc_block_{at}.py")
        (where / names[-1]).write_text(_given(block) + block.text + _given(block, THEN))
    (where / "_shared.py").write_text(_SHARED_RUNNER)
    run = _run("python _shared.py " + " ".join(names), where)
    TIMES["(python blocks importing vLLM, one interpreter)"] = time.monotonic() - start
    if run.status != 0:
        return [run] * len(blocks)
    results = json.loads((where / "_results.json").read_text())
    return [Run(f"python  # {b.id}", status, output) for b, (status, output) in zip(blocks, results, strict=True)]


# ---- output matching ------------------------------------------------------------------------------

_MASKS = [
    (re.compile(r"\b\d[\d,]*(\.\d+)?\s*(states/s|/s)\b"), "<rate>"),
    (re.compile(r"\b\d[\d,]*(\.\d+)?\s*(s|ms|µs|us|ns|min)\b"), "<time>"),
    (re.compile(r"\b0x[0-9a-f]+\b"), "<addr>"),
    (re.compile(r"\bpid \d+\b"), "pid <n>"),
    (re.compile(r"/tmp/[^\s'\"]+"), "<tmp>"),
    (re.compile("[\u2500-\u257f]+"), " "),  # rich's table rules and borders: the columns are what a reader compares
    (re.compile(r"[ \t]+"), " "),
]


def normalise(text: str, vary: bool = False) -> str:
    """One line, as a reader compares it: masks, then runs of spaces and tabs as one."""
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    if vary:
        text = re.sub(r"\d[\d,]*(\.\d+)?", "<n>", text)
    return text.strip()


def missing_lines(documented: str, actual: str, vary: bool = False) -> list[str]:
    """The documented lines the output does not have in order ([] when it has them all)."""
    flat = " ".join(normalise(line, vary) for line in actual.splitlines() if line.strip())
    at = 0
    missing = []
    for line in documented.splitlines():
        parts = [p.strip() for p in re.split(r"\.\.\.|…", normalise(line, vary)) if p.strip()]
        start = at
        for part in parts:
            found = flat.find(part, start)
            if found < 0:
                missing.append(line)
                break
            start = found + len(part)
        else:
            at = start
    return missing


# ---- yaml -----------------------------------------------------------------------------------------


def contained(part: Any, whole: Any) -> bool:
    """Every key and value of `part` is in `whole` (list items matched in any order)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and contained(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return isinstance(whole, list) and all(any(contained(p, w) for w in whole) for p in part)
    return bool(part == whole)


def contained_anywhere(part: Any, whole: Any) -> bool:
    if contained(part, whole):
        return True
    children = whole.values() if isinstance(whole, dict) else whole if isinstance(whole, list) else []
    return any(contained_anywhere(part, child) for child in children)


def _check(path: Path) -> Run:
    return _run(f"kvfsm check {shlex.quote(str(path))}", ROOT)


# ---- the test -------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block(block: Block) -> None:
    why = _exempt(block)
    if why is not None:
        pytest.skip(f"exempt: {why}")
    if _needs_vllm(block) and importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here (KVFSM_NO_VLLM=1)")
    _submit_all()
    check = globals()[f"_check_{block.kind}"]
    check(block)


def _check_python(block: Block) -> None:
    (run,) = _futures[block.id].result()
    assert run.status == 0, f"{block.id} failed:\n{run.output[-3000:]}"


def _check_commands(block: Block) -> None:
    runs = _futures[block.id].result()
    expected = _expected(block, len(block.commands))
    assert len(runs) == len(block.commands)
    for run, want, documented in zip(runs, expected, block.outputs, strict=True):
        assert run.status == want, (
            f"{block.id}: `{run.command}` exited {run.status}, the doc implies {want}:\n{run.output[-3000:]}"
        )
        if documented:
            _assert_shows(block, documented, run)
    following = [b for b in ALL if b.path == block.path and b.kind == "output" and b.after_command]
    nxt = next((b for b in following if b.line > block.line), None)
    if nxt is not None and not [b for b in ALL if b.path == block.path and block.line < b.line < nxt.line]:
        _assert_shows(nxt, nxt.text, runs[-1])


def _assert_shows(block: Block, documented: str, run: Run) -> None:
    missing = missing_lines(documented, run.output, vary="vary" in block.directives)
    assert not missing, (
        f"{block.id}: `{run.command}` does not print\n  "
        + "\n  ".join(missing)
        + f"\nit printed:\n{run.output[-4000:]}"
    )


def _check_output(block: Block) -> None:
    if block.id in _futures:
        (run,) = _futures[block.id].result()
        want = _expected(block, 1)[0]
        assert run.status == want, (
            f"{block.id}: `{run.command}` exited {run.status}, the doc implies {want}:\n{run.output[-3000:]}"
        )
        _assert_shows(block, block.text, run)
    # else: checked by the command block above it (test_block of that block)


def _check_synopsis(block: Block) -> None:
    usage: dict[str, set[str]] = {}
    sub = ""
    for line in block.text.splitlines():
        m = re.match(r"\s*kvfsm (\w+)", line)
        if m:
            sub = m.group(1)
        if sub:
            usage.setdefault(sub, set()).update(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line))
    for sub, options in usage.items():
        helptext = _run(f"kvfsm {sub} --help", ROOT).output
        unknown = sorted(o for o in options if o not in helptext)
        assert not unknown, f"{block.id}: `kvfsm {sub} --help` does not know {unknown}"


def _check_yaml(block: Block) -> None:
    data = yaml.safe_load(block.text)
    source = block.directives.get("from")
    if source:
        bundled = ROOT / source
        assert contained_anywhere(data, yaml.safe_load(bundled.read_text())), f"{block.id}: not in {source} as shown"
        run = _check(bundled)
        assert run.status == 0, run.output
    elif isinstance(data, dict) and data.get("kvfsm") == 1 and "machine" in data:
        with tempfile.TemporaryDirectory() as tmp:
            spec = Path(tmp) / f"{data['machine']}.yaml"
            spec.write_text(block.text)
            run = _check(spec)
        assert run.status == 0, f"{block.id}: kvfsm check:\n{run.output}"


def _check_json(block: Block) -> None:
    json.loads(block.text)


def _check_toml(block: Block) -> None:
    tomllib.loads(block.text)


def _check_text(block: Block) -> None:
    if block.path == "README.md" and block.text.startswith("kvfsm/"):
        for line in block.text.splitlines():
            name = line.split()[0] if line.strip() and not line.startswith(" ") else ""
            assert not name or (ROOT / name).exists(), f"{block.id}: {name} does not exist"
