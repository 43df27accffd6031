"""Every bundled driver binds to its spec on the tightened contract, and the vLLM adapter names no state of them.

Binding checks each do/acquire method's signature against the payload its
event declares, and that each release takes the key alone; a driver that
kept a ``**payload`` catch-all or a release that needs payload would be
refused here, before any request exists.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import kvfsm.adapters.vllm_cpu_offload
from kvfsm import Tracker
from kvfsm.drivers import pd_loopback
from kvfsm.drivers.cpu_offload import LOAD_SPEC, STORE_SPEC, CpuOffload
from kvfsm.drivers.kv_cache import KVLayout
from kvfsm.drivers.mooncake import BlockBuffer, EmbeddedMaster, StoreLoader, StoreSender, connect_embedded
from kvfsm.spec import load
from kvfsm.spec.bundled import PD_ABORT, SPECS

LAYOUT = KVLayout(num_layers=1, block_size=4, num_kv_heads=1, head_size=2)


def _offload() -> CpuOffload:
    return CpuOffload(LAYOUT, num_gpu_blocks=4, num_cpu_blocks=4, device="cpu")


def _store() -> object:
    return connect_embedded(EmbeddedMaster())


BINDINGS: list[tuple[Path, Callable[[], object]]] = [
    (LOAD_SPEC, lambda: _offload().load),
    (STORE_SPEC, lambda: _offload().store),
    (SPECS / "mooncake_store_send.yaml", lambda: StoreSender(_store(), BlockBuffer(4, 64))),  # type: ignore[arg-type]
    (SPECS / "mooncake_store_load.yaml", lambda: StoreLoader(_store(), BlockBuffer(4, 64))),  # type: ignore[arg-type]
    *[(PD_ABORT / f"decode_{v}.yaml", lambda: pd_loopback.PDLoopback().decode) for v in ("merged_fix", "corrected")],
    *[(PD_ABORT / f"prefill_{v}.yaml", lambda: pd_loopback.PDLoopback().prefill) for v in ("merged_fix", "corrected")],
]


@pytest.mark.parametrize(("spec", "driver"), BINDINGS, ids=[p.stem for p, _ in BINDINGS])
def test_every_bundled_driver_binds_to_its_spec(spec: Path, driver: Callable[[], object]) -> None:
    Tracker(spec, driver())


@pytest.mark.parametrize(("spec", "driver"), BINDINGS, ids=[p.stem for p, _ in BINDINGS])
def test_no_driver_action_takes_a_payload_catch_all(spec: Path, driver: Callable[[], object]) -> None:
    model = load(spec)
    actions = {r.release for r in model.resources.values()} | {r.acquire for r in model.resources.values() if r.acquire}
    actions |= {t.do for t in model.transitions if t.do}
    bound = driver()
    catch_alls = [
        name
        for name in sorted(actions)
        if any(p.kind is p.VAR_KEYWORD for p in inspect.signature(getattr(bound, name)).parameters.values())
    ]
    assert catch_alls == [], f"{type(bound).__name__} takes **payload in {catch_alls}"


def constants_outside_docstrings(module: ModuleType) -> set[object]:
    """The literal constants ``module``'s code uses, its docstrings left out."""
    source = ast.parse(Path(inspect.getfile(module)).read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(source)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return {node.value for node in ast.walk(source) if isinstance(node, ast.Constant) and id(node) not in docstrings}


def test_the_vllm_adapter_names_no_live_state_of_its_specs() -> None:
    """The adapter asks the Tracker (accepts) and the spec (live) instead of comparing state names."""
    live = {s for spec in (LOAD_SPEC, STORE_SPEC) for s in load(spec).live}
    assert constants_outside_docstrings(kvfsm.adapters.vllm_cpu_offload) & live == set()
