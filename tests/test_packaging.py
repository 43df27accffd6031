"""The light install: a wheel built from this checkout, installed into a clean venv with its core dependencies only.

A connector author who only writes and checks specs runs ``pip install kvfsm``
and must get the spec language, checks, diagrams as text, explore, replay and
``kvfsm.testing`` without torch or any system package; a driver, the demo or
the benchmark must then say which extra to install instead of failing deep
inside. The venv is built once per module (the wheel's dependencies come from
the package index) and every test runs commands in it, from a folder outside
the checkout so that nothing is imported from here by accident.

Deselect with ``-m "not packaging"``. It skips only when the package index
cannot be reached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvfsm.cli.common import EXIT_USAGE, missing_extra

ROOT = Path(__file__).resolve().parents[1]

HEAVY = (
    "torch",
    "numpy",
    "transitions",
    "python-statemachine",
    "pyzmq",
    "mooncake-transfer-engine-non-cuda",
    "nixl",
    "graphviz",
    "prometheus-client",
    "opentelemetry-api",
)
"""Distributions that only extras may bring: none may be in the light install."""

JOURNAL_SCRIPT = '''
import sys

import kvfsm
from kvfsm.replay import JsonlJournal
from kvfsm.spec.bundled import SPECS


class Driver:
    """kv_request's actions, doing nothing: the journal records what the Tracker decided."""

    def enqueue_job(self, key: str) -> None: ...
    def start_transfer(self, key: str, **payload: object) -> None: ...
    def task_done(self, key: str) -> None: ...
    def free_gpu_blocks(self, key: str) -> None: ...


spec = kvfsm.load(SPECS / "kv_request.yaml")
journal = JsonlJournal(sys.argv[1], machine=spec.name)
tracker = kvfsm.Tracker(spec, Driver(), observer=journal)
for key in ("req-1", "req-2", "req-3"):
    tracker.begin(key)
for event in ("enqueue", "start", "complete"):
    tracker.fire("req-1", event)
tracker.fire("req-2", "abort")
tracker.close()
journal.close()
'''
"""Written into the venv's folder and run there: a Tracker of the installed package writing a journal."""


@dataclass(frozen=True)
class LightInstall:
    """A clean venv holding the wheel and its core dependencies, and how to run commands in it."""

    root: Path
    work: Path
    """A folder outside the checkout: the working directory of every command."""
    specs: Path
    """The bundled specs inside the installed package."""

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def env(self) -> dict[str, str]:
        """The caller's environment without anything that could reach the checkout or the dev venv."""
        env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP"}}
        env["VIRTUAL_ENV"] = str(self.root)
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONNOUSERSITE"] = "1"
        return env

    def run(self, *argv: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in argv], cwd=self.work, env=self.env(), capture_output=True, text=True, timeout=120
        )

    def kvfsm(self, *argv: str | Path) -> subprocess.CompletedProcess[str]:
        return self.run(self.root / "bin" / "kvfsm", *argv)


def _pip(python: Path | str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit status {proc.returncode}"


def _source_copy(dest: Path) -> Path:
    """What a wheel is built from, copied out of the checkout so no stale build/ folder can leak into it."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvfsm", src / "kvfsm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


@pytest.fixture(scope="module")
def light(tmp_path_factory: pytest.TempPathFactory) -> LightInstall:
    base = tmp_path_factory.mktemp("light")
    work = base / "work"
    work.mkdir()
    root = base / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(root)
    python = root / "bin" / "python"

    probe = _pip(
        python, "download", "--no-deps", "--retries", "1", "--timeout", "15", "-d", str(base), "pyyaml", cwd=work
    )
    if probe.returncode != 0:
        pytest.skip(f"the package index cannot be reached, so the light install cannot be tried: {_last_line(probe)}")

    built = _pip(sys.executable, "wheel", "--no-deps", "-w", str(base / "dist"), str(_source_copy(base)), cwd=work)
    assert built.returncode == 0, f"building the wheel failed:\n{built.stdout}\n{built.stderr}"
    (wheel,) = (base / "dist").glob("kvfsm-*.whl")
    installed = _pip(python, "install", str(wheel), cwd=work)
    assert installed.returncode == 0, f"installing the wheel failed:\n{installed.stdout}\n{installed.stderr}"

    where = subprocess.run(
        [str(python), "-c", "import kvfsm; from kvfsm.spec.bundled import SPECS; print(kvfsm.__file__); print(SPECS)"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert Path(where[0]).is_relative_to(root), f"kvfsm was imported from {where[0]}, not from the clean venv"
    return LightInstall(root=root, work=work, specs=Path(where[1]))


def _bundled(specs: Path) -> list[Path]:
    return sorted(specs.rglob("*.yaml"))


def _rejected(spec: Path) -> bool:
    """A seed's shape before its fix, shipped to be rejected (``*_pre_fix.yaml``)."""
    return spec.stem.endswith("_pre_fix")


@pytest.mark.packaging
def test_the_light_install_brings_no_torch_and_no_extra(light: LightInstall) -> None:
    listed = light.run(light.python, "-m", "pip", "list", "--format", "json")
    assert listed.returncode == 0, listed.stderr
    names = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert "kvfsm" in names
    assert sorted(names & set(HEAVY)) == []
    torch = light.run(light.python, "-c", "import importlib.util; print(importlib.util.find_spec('torch'))")
    assert torch.stdout.strip() == "None"


@pytest.mark.packaging
def test_the_wheel_ships_every_bundled_spec(light: LightInstall) -> None:
    shipped = {p.relative_to(light.specs).as_posix() for p in _bundled(light.specs)}
    source = {p.relative_to(ROOT / "kvfsm" / "specs").as_posix() for p in _bundled(ROOT / "kvfsm" / "specs")}
    assert shipped == source
    assert (light.specs.parent / "py.typed").is_file()


@pytest.mark.packaging
def test_the_wheel_ships_the_inspect_pages_assets_as_they_are(light: LightInstall) -> None:
    """kvfsm inspect inlines them into every page: nothing is downloaded or built when a user runs it."""
    source = ROOT / "kvfsm" / "inspect" / "assets"
    shipped = light.specs.parent / "inspect" / "assets"
    names = sorted(p.name for p in source.iterdir() if p.is_file())
    assert names and sorted(p.name for p in shipped.iterdir()) == names
    assert all((shipped / n).read_bytes() == (source / n).read_bytes() for n in names)


@pytest.mark.packaging
def test_every_bundled_spec_checks_clean_in_the_light_install(light: LightInstall) -> None:
    specs = [spec for spec in _bundled(light.specs) if not _rejected(spec)]
    result = light.kvfsm("check", *specs)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(specs)} spec(s): 0 error(s)" in result.stdout
    for spec in filter(_rejected, _bundled(light.specs)):
        assert light.kvfsm("check", spec).returncode == 1, f"{spec.name} is shipped to be rejected"


@pytest.mark.packaging
@pytest.mark.parametrize("fmt, opening", [("mermaid", "stateDiagram-v2"), ("dot", 'digraph "kv_request"')])
def test_diagrams_as_text_need_no_graphviz(light: LightInstall, fmt: str, opening: str) -> None:
    out = light.work / f"kv_request.{fmt}"
    result = light.kvfsm("diagram", light.specs / "kv_request.yaml", "-f", fmt, "-o", out)
    assert result.returncode == 0, result.stdout + result.stderr
    assert opening in out.read_text()


@pytest.mark.packaging
def test_explore_verifies_the_bundled_corrected_protocol(light: LightInstall) -> None:
    result = light.kvfsm("explore", light.specs / "pd_abort" / "corrected.yaml", "--requests", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "verified" in result.stdout


@pytest.mark.packaging
def test_a_journal_written_by_the_installed_tracker_replays_clean(light: LightInstall) -> None:
    script = light.work / "write_journal.py"
    script.write_text(JOURNAL_SCRIPT)
    journal = light.work / "kv_request.jsonl"
    written = light.run(light.python, script, journal)
    assert written.returncode == 0, written.stderr
    result = light.kvfsm("replay", light.specs / "kv_request.yaml", journal)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.packaging
def test_kvfsm_testing_imports_without_torch(light: LightInstall) -> None:
    result = light.run(light.python, "-c", "import kvfsm.testing")
    assert result.returncode == 0, result.stderr


@pytest.mark.packaging
@pytest.mark.parametrize(
    "module", ["kvfsm.drivers.cpu_offload", "kvfsm.drivers.mooncake", "kvfsm.adapters.vllm_cpu_offload"]
)
def test_importing_a_driver_without_torch_names_the_torch_extra(light: LightInstall, module: str) -> None:
    result = light.run(light.python, "-c", f"import {module}")
    assert result.returncode != 0
    assert "ImportError: kvfsm.drivers needs torch: pip install 'kvfsm[torch]'" in result.stderr


@pytest.mark.packaging
@pytest.mark.parametrize("command", ["demo", "bench"])
def test_showcase_commands_without_their_extra_say_which_in_one_line(light: LightInstall, command: str) -> None:
    result = light.kvfsm(command)
    assert result.returncode == EXIT_USAGE
    assert result.stderr.strip().splitlines() == [
        f"kvfsm {command} needs torch, which is not installed: pip install 'kvfsm[showcase]'"
    ]


def test_a_missing_third_party_module_is_reported_as_its_extra(capsys: pytest.CaptureFixture[str]) -> None:
    missing = ImportError("no", name="kvfsm_no_such_module.sub")
    assert missing_extra("demo", "showcase", missing) == EXIT_USAGE
    assert capsys.readouterr().err.strip() == (
        "kvfsm demo needs kvfsm_no_such_module, which is not installed: pip install 'kvfsm[showcase]'"
    )


@pytest.mark.parametrize("name", ["kvfsm.showcase.gone", "json", None])
def test_an_import_error_that_is_not_a_missing_extra_is_raised_again(name: str | None) -> None:
    broken = ImportError("cannot import name 'x'", name=name)
    with pytest.raises(ImportError) as raised:
        missing_extra("demo", "showcase", broken)
    assert raised.value is broken
