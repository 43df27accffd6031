"""The MoRIIO connector (:mod:`kvfsm.adapters.vllm_moriio`) as a plug of the P/D runner (:mod:`kvfsm.showcase.engine.pd`).

Name it ``kvfsm.adapters.vllm_moriio_pd:MORIIO``::

    python -m kvfsm.showcase.engine.pd MODEL --connector kvfsm.adapters.vllm_moriio_pd:MORIIO --phases serve,abort,kill

It is WRITE mode, so the runner sends a prompt's decode request together with
its prefill request (``concurrent``), as vLLM's MoRIIO router does: both
carry the same ``transfer_id``, made up here, and the decode request names
the prefill rank's notify socket. That socket's port must be known before
either engine starts: it is chosen when this module is imported in the
runner (a free port outside the kernel's ephemeral range) and handed to the
engine processes, which inherit the runner's environment, as
``KVFSM_MORIIO_NOTIFY_PORT``. This module does not import vLLM.
"""

from __future__ import annotations

import os
import random
import socket
import uuid
from collections.abc import Mapping
from typing import Any

PORT_ENV = "KVFSM_MORIIO_NOTIFY_PORT"
TRANSFER_TIMEOUT = 2.0
"""Seconds the prefill's writes of one request may stay in flight (a prompt's KV is a few hundred KiB on loopback)."""


def notify_port(host: str = "127.0.0.1") -> int:
    """The prefill rank's notify port for this run: ``$KVFSM_MORIIO_NOTIFY_PORT``, or a free one, exported there."""
    given = os.environ.get(PORT_ENV)
    if given:
        return int(given)
    rng = random.Random()
    for _ in range(50):  # bounded: a port outside 32768-60999, so no outgoing connection takes it meanwhile
        port = rng.randrange(20000, 32000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        os.environ[PORT_ENV] = str(port)
        return port
    raise RuntimeError(f"no free TCP port in 20000-31999 on {host} after 50 tries; set {PORT_ENV}")


class MoRIIOPD:
    """kvfsm's ``MoRIIOConnector``: the prefill WRITEs into the decode engine's blocks over the TransferEngine."""

    name = "moriio"
    concurrent = True
    abort_waits_for_transfer = True  # an aborted load keeps its blocks until the prefill answers its release

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = notify_port(host)
        self._pending: dict[str, str] = {}
        """Transfer ids made for a decode request whose prefill request has not gone out yet, by prompt key."""

    def kv_transfer_config(self, role: str, options: Any) -> dict[str, Any]:
        """``options`` is the runner's ``PDOptions``: the prefill waits ``abort_timeout`` for ``remote_blocks``, a
        decode request waits at most ``decode_deadline`` for its write."""
        if options.lost_notif > 0:
            raise ValueError("lost_notif injects NIXL notifications; MoRIIOPD has no fault injection")
        if role == "prefill":
            extra: dict[str, Any] = {
                "notify_host": self.host, "notify_port": self.port,
                "defer_timeout": options.abort_timeout, "transfer_timeout": TRANSFER_TIMEOUT,
            }  # fmt: skip
        else:
            extra = {"recv_timeout": options.decode_deadline}
        return {
            "kv_connector": "MoRIIOConnector",
            "kv_connector_module_path": "kvfsm.adapters.vllm_moriio",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "engine_id": f"{role}-engine",
            "kv_load_failure_policy": options.failure_policy,
            "kv_connector_extra_config": extra,
        }

    def prefill_params(self, key: str) -> dict[str, Any]:
        transfer_id = self._pending.pop(key, None) or _new_id(key)
        return {"do_remote_decode": True, "transfer_id": transfer_id}

    def decode_params(self, key: str, from_prefill: Mapping[str, Any] | None) -> dict[str, Any]:
        """What the prefill returned when it went first; else a new transfer id its prefill request will carry."""
        if from_prefill:
            if not from_prefill.get("do_remote_prefill"):
                raise ValueError(
                    f"prompt {key}: the prefill returned no kv_transfer_params to load from ({from_prefill})"
                )
            return dict(from_prefill)
        transfer_id = self._pending[key] = _new_id(key)
        return {
            "do_remote_prefill": True, "transfer_id": transfer_id,
            "remote_host": self.host, "remote_notify_port": self.port,
        }  # fmt: skip

    def stats(self, scheduler_connector: Any, worker_connector: Any) -> dict[str, Any]:
        return {
            "scheduler": scheduler_connector.stats(),
            "worker": worker_connector.stats(),
            "live": worker_connector.live(),
            "reading": worker_connector.waiting(),
            "loads": worker_connector.loads(),
        }


def _new_id(key: str) -> str:
    return f"{key}-{uuid.uuid4().hex[:12]}"


MORIIO = MoRIIOPD()
"""The plug ``MODULE:ATTR`` names; made on import, which fixes the run's notify port (see the module doc)."""
