"""SGLang 0.5.23's real Mooncake PD classes in processes of their own, with kvfsm's pd_abort specs around them.

These tests run in the SGLang venv (``./dev.sh test`` sets it up and runs
them there: SGLang pins its own torch). Where SGLang cannot be imported they
are not collected, except under ``KVFSM_REQUIRE_SGLANG=1`` (what
``./dev.sh test`` sets), where that is an error: CI must run them all.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def _have_sglang() -> bool:
    # Not find_spec("sglang"): this folder, on sys.path's tests/, is a namespace package of that name.
    try:
        return importlib.util.find_spec("sglang.srt.disaggregation") is not None
    except ImportError:
        return False


HAVE_SGLANG = _have_sglang()
REQUIRED = bool(os.environ.get("KVFSM_REQUIRE_SGLANG"))

collect_ignore_glob = [] if HAVE_SGLANG or REQUIRED else ["test_*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.sglang)


def require_sglang() -> None:
    if not HAVE_SGLANG:
        pytest.fail("SGLang is not installed but KVFSM_REQUIRE_SGLANG is set: ./dev.sh setup builds .venv/sglang")


def start_pair(protocol: str, journals: Path, *, base_port: int, **kwargs: object) -> Iterator[object]:
    """A decode server and two prefill servers of ``protocol``; closed (and killed if need be) afterwards."""
    require_sglang()
    from kvfsm.adapters.sglang_pair import Pair

    pair = Pair(protocol, journals, name=protocol, prefills=2, pages=4, pages_per_room=4, base_port=base_port, **kwargs)  # type: ignore[arg-type]
    try:
        yield pair
    finally:
        for server in (*pair.prefills, pair.decode):
            server.kill()
