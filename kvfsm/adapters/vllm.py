"""The module path vLLM is given for kvfsm's connectors; loading each connector class on first use is its one job.

Name it in vLLM's ``KVTransferConfig``::

    KVTransferConfig(kv_connector="CpuOffloadConnector", kv_connector_module_path="kvfsm.adapters.vllm", ...)

vLLM's factory imports this module and asks it for the class by name
(``getattr(module, kv_connector)``). The classes it loads:

- ``CpuOffloadConnector`` from :mod:`kvfsm.adapters.vllm_connector` (its two
  halves are in :mod:`kvfsm.adapters.vllm_cpu_offload`);
- ``MooncakeStoreConnector`` from :mod:`kvfsm.adapters.vllm_mooncake`;
- ``NixlConnector`` from :mod:`kvfsm.adapters.vllm_nixl`;
- ``MoRIIOConnector`` from :mod:`kvfsm.adapters.vllm_moriio`;
- ``WatchConnector`` from :mod:`kvfsm.adapters.vllm_watch`.

Each of them imports vLLM, so this module imports none of them until vLLM
asks: kvfsm itself imports without vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_VLLM_CONNECTORS = {
    "CpuOffloadConnector": "vllm_connector",
    "MooncakeStoreConnector": "vllm_mooncake",
    "NixlConnector": "vllm_nixl",
    "MoRIIOConnector": "vllm_moriio",
    "WatchConnector": "vllm_watch",
}
"""Connector classes vLLM may name; they import vLLM, so they load on first use."""


if not TYPE_CHECKING:  # hidden from mypy, which would otherwise type every missing name in this module as Any

    def __getattr__(name: str) -> Any:
        """Load a vLLM connector class on demand (PEP 562): vLLM's factory does ``getattr(module, kv_connector)``."""
        if name in _VLLM_CONNECTORS:
            try:
                module = importlib.import_module(f"{__package__}.{_VLLM_CONNECTORS[name]}")
            except ImportError as exc:
                if not (exc.name or "").startswith("vllm"):
                    raise
                raise ImportError(
                    f"{name} is a vLLM connector and needs vLLM ({exc}); install it without its CUDA torch "
                    "as docs/vllm.md says (./dev.sh setup does)"
                ) from exc
            return getattr(module, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
